"""What LLMEngine.add_request refuses (serve/engine/admission.check_request): each refusal names the limit and the fix,
and a request inside every limit passes."""

from __future__ import annotations

import pytest

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine.admission import check_request
from eagleray.serve.engine.sampling import SamplingParams

OK = dict(max_model_len=64, need=4, num_blocks=4, capture=False)


@pytest.mark.parametrize(
    "ids, params, change, match",
    [
        ([], SamplingParams(), {}, "prompt is empty"),
        (list(range(64)), SamplingParams(), {}, "prompt has 64 tokens, max_model_len is 64"),
        ([1, 2], SamplingParams(max_tokens=60), {"need": 5}, "needs up to 5 KV blocks.*\n.*fix: raise engine.num_kv_blocks"),
        ([1, 2], SamplingParams(capture_states=True), {}, "does not capture.*\n.*fix: call LLMEngine.enable_capture"),
    ],
)
def test_each_limit_is_refused_with_its_fix(ids, params, change, match):
    with pytest.raises(EaglerayError, match=match):
        check_request(ids, params, **{**OK, **change})


def test_a_request_inside_every_limit_passes():
    check_request(list(range(63)), SamplingParams(capture_states=True), **{**OK, "capture": True})
