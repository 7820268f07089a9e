"""Sampled speculative decoding follows the target's distribution (chi-square over many seeds).

The first two generated tokens of one prompt are sampled N times with different seeds; token 2
comes from speculative verification (draft tokens sampled from q, verified with p/q). Their joint
histogram is compared with the target's exact probabilities p(t1) p(t2 | t1). The same test run
with a deliberately broken verifier (sampled drafts verified as if they were argmax drafts, the
q of vLLM #16899's greedy-drafting path) must reject: the test can fail.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from eagleray.serve.engine import SamplingParams

from .conftest import make_engine

PROMPT = "hello world"
TEMPERATURE = 0.3
N = 2000


def _exact_pairs(target, tokenizer) -> dict[tuple[int, int], float]:
    ids = tokenizer(PROMPT)["input_ids"]
    logits, _ = target.forward_full(torch.tensor([ids]))
    p1 = (logits[0, -1] / TEMPERATURE).softmax(-1)  # [V]
    firsts = torch.nonzero(p1 > 1e-4).flatten().tolist()
    batch = torch.tensor([ids + [t] for t in firsts])  # [F, P+1]
    logits2, _ = target.forward_full(batch)
    p2 = (logits2[:, -1] / TEMPERATURE).softmax(-1)  # [F, V]
    return {(t1, t2): float(p1[t1] * p2[i, t2]) for i, t1 in enumerate(firsts) for t2 in range(p2.shape[1])}


def _sample(target, tokenizer, draft, seeds, check_rate=True, tree=None, **engine_kw) -> list[tuple[int, int]]:
    engine = make_engine(target, tokenizer, draft, k=2, tree=tree, max_num_seqs=128, **engine_kw)
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=2, ignore_eos=True, seed=s) for s in seeds]
    outs = engine.generate([PROMPT] * len(seeds), params)
    rate = engine.metrics.spec.num_accepted_tokens / max(engine.metrics.spec.num_drafts, 1)  # accepted per verification
    assert not check_rate or 0.05 < rate < 1.9, f"{rate:.2f} accepted per step: the test should exercise acceptance and recovery"
    return [tuple(o.token_ids[:2]) for o in outs]


def _chi2_pvalue(samples, exact) -> float:
    counts: dict = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    big = [pair for pair, p in exact.items() if p * n >= 5]
    observed = [counts.get(pair, 0) for pair in big]
    expected = [exact[pair] * n for pair in big]
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    assert len(big) >= 5, "too few categories for a meaningful test"
    return float(chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def exact(target, tokenizer):
    return _exact_pairs(target, tokenizer)


TREE = dict(depth=2, topk=3, num_draft_tokens=4)


@pytest.mark.parametrize("tree, path", [(None, "auto"), (TREE, "auto"), (TREE, "rows")], ids=["chain", "tree", "tree-rows"])
def test_sampled_spec_follows_target(target, tokenizer, copy_draft, exact, tree, path):
    """tree-rows: drafted and verified as rows of the row steps (a node a row, ancestors through the tails)."""
    samples = _sample(target, tokenizer, copy_draft, range(N), tree=tree, decode_path=path)
    assert _chi2_pvalue(samples, exact) > 1e-3


def test_broken_verifier_is_detected(target, tokenizer, copy_draft, exact, monkeypatch):
    from eagleray.serve.engine.verifier import Verifier

    real = Verifier.chain

    def argmax_q(self, logits, tokens, probs, temperature, seed, all_greedy=None):
        wrong = torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).to(probs.dtype)  # [B, K, Vd]
        return real(self, logits, tokens, wrong, temperature, seed, all_greedy)

    monkeypatch.setattr(Verifier, "chain", argmax_q)
    samples = _sample(target, tokenizer, copy_draft, range(N, 2 * N), check_rate=False)
    assert _chi2_pvalue(samples, exact) < 1e-6
