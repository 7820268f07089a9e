"""The CPU engine's threads: inside a step torch's small ops run on one thread and the native kernels on
all of them; outside a step the process's settings are untouched."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import cpu_decode, cpu_decode_build
from eagleray.serve.engine import SamplingParams

from .conftest import make_engine

native = pytest.mark.skipif(
    cpu_decode_build.unsupported() is not None, reason=f"native CPU kernels: {cpu_decode_build.unsupported()}"
)


@native
def test_a_step_uses_every_thread_and_leaves_the_settings_as_they_were(target, tokenizer):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = make_engine(target, tokenizer)
        assert engine.linear_backend == "native" and engine.threads.count == 2
        seen = []
        engine.add_request(
            "hello world",
            SamplingParams(max_tokens=3),
            on_output=lambda out: seen.append((torch.get_num_threads(), cpu_decode.threads())),
        )
        while engine.has_unfinished():
            engine.step()
        assert seen and all(s == (1, 2) for s in seen), "inside a step: torch on one thread, the kernels on two"
        assert torch.get_num_threads() == 2 and cpu_decode.threads() is None, "outside a step: untouched"
        with engine.threads.stepping():
            inner = make_engine(target, tokenizer)  # e.g. a hot-swap smoke test during a step
            with engine.threads.for_gemm():
                assert torch.get_num_threads() == 2, "prefill's GEMMs get torch's threads back"
            assert torch.get_num_threads() == 1
        assert inner.threads.count == 2
    finally:
        torch.set_num_threads(before)


def test_torch_backend_leaves_threads_alone(target, tokenizer):
    before = torch.get_num_threads()
    try:
        engine = make_engine(target, tokenizer, cpu_kernels="torch")
        engine.generate(["hello"], SamplingParams(max_tokens=2))
        assert engine.linear_backend == "torch (configured)" and torch.get_num_threads() == before
    finally:
        cpu_decode.configure("auto")
