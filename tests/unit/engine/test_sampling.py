from __future__ import annotations

import pytest
import torch

from eagleray.platform.errors import ConfigError
from eagleray.serve.engine.sampling import SamplingParams, filter_logits


def test_params_forbid_unknown_fields_and_name_them():
    with pytest.raises(ConfigError, match="sampling_params.temprature"):
        SamplingParams.parse({"temprature": 0.5})
    with pytest.raises(ConfigError, match="sampling_params.top_p"):
        SamplingParams.parse(top_p=1.5)
    p = SamplingParams.parse({"stop": "###", "seed": 3})
    assert p.stop == ["###"] and p.seed == 3 and p.greedy


def test_filter_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = filter_logits(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.7]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).tolist() == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    assert torch.equal(filter_logits(logits, torch.tensor([0, 0]), torch.tensor([1.0, 1.0])), logits)
