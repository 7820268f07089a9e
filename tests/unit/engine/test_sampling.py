from __future__ import annotations

import pytest
import torch

from eagleray.platform.errors import ConfigError
from eagleray.serve.engine.sampling import SamplingParams, draw, filter_logits, sample_rows


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


def _gens(seeds) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_draw_follows_each_rows_distribution_and_never_a_token_of_zero_mass():
    p = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.6, 0.05, 0.0])  # zero mass first, between and last
    n = 40_000
    got = draw(p.expand(n, -1), _gens(range(n)))  # [n]: one row per draw, a generator each
    freq = torch.bincount(got, minlength=7).double() / n
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    assert (freq[p == 0] == 0).all()
    assert ((freq - p.double()).abs() <= 5 * sigma + 1e-12).all(), freq.tolist()


def test_a_rows_draw_depends_on_its_generator_alone_not_on_the_rows_beside_it():
    probs = torch.rand(5, 1000).softmax(-1)  # [5, V]
    together = draw(probs, _gens([7, 8, 9, 10, 11]))
    alone = [int(draw(probs[i : i + 1], _gens([7 + i]))[0]) for i in range(5)]
    assert together.tolist() == alone
    assert draw(probs, _gens([7, 8, 9, 10, 11])).tolist() == together.tolist()  # a seed gives its tokens again


def test_sample_rows_takes_the_argmax_of_greedy_rows_and_consumes_no_draw_for_them():
    logits = torch.log(torch.tensor([[0.1, 0.7, 0.2], [0.3, 0.3, 0.4], [0.6, 0.3, 0.1]]))
    gens = _gens([1, 2, 3])
    out = sample_rows(logits, [0.0, 1.0, 0.0], gens)
    assert out[0] == 1 and out[2] == 0
    fresh = _gens([1, 2, 3])
    assert torch.rand((), generator=gens[0]) == torch.rand((), generator=fresh[0])  # greedy rows drew nothing
    assert torch.rand((), generator=gens[1]) != torch.rand((), generator=fresh[1])  # the sampled row drew one
