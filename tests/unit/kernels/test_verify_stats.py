"""Distribution tests: the verified tokens follow the TARGET distribution.

Thousands of rows with the same logits and different seeds go through one launch each; the
chi-square statistic of the observed token counts against the target probabilities is compared
with the alpha = 1e-3 critical value (Wilson-Hilferty approximation: scipy is not installed and
torch's Chi2 has no icdf). Seeds are fixed, so the outcome is deterministic; breaking the rule
(e.g. accepting with min(1, q/p)) makes these tests fail.
"""

import math

import torch

from eagleray.kernels.verify import verify_chain, verify_chain_reduced, verify_tree

B, V, T = 3000, 16, 0.8
Z_999 = 3.090232  # standard normal quantile at 1 - 1e-3


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def assert_follows(samples: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Chi-square goodness of fit; categories expected < 5 times are pooled."""
    n = samples.numel()
    assert n >= 300, f"{what}: too few samples ({n})"
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    crit = chi2_critical(int(keep.sum()) - 1)
    assert stat < crit, f"{what}: chi2 {stat:.1f} >= critical {crit:.1f} over {n} samples"


def _target(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 1.5  # [R, V]
    return logits, torch.softmax(logits / T, -1)


def _batch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return logits.expand(B, -1, -1).contiguous(), torch.full((B,), T), torch.arange(B) * 7 + 11


def test_chain_onehot_q_follows_target():
    logits, p = _target(3, 0)
    lg, temp, seeds = _batch(logits)
    draft = torch.tensor([int(p[0].argmax()), int(p[1].argsort()[-2])]).expand(B, -1).contiguous()
    tokens, nacc = verify_chain(lg, draft, temperature=temp, seed=seeds)
    assert_follows(tokens[:, 0], p[0], "first token")
    assert_follows(tokens[nacc >= 1, 1], p[1], "second token | first accepted")


def _sampled_drafts(p: torch.Tensor, k: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)  # [K, Vq] deliberately far from p
    draft = torch.multinomial(q, B, replacement=True, generator=g).t().contiguous()  # [B, K] ~ q
    return q.expand(B, -1, -1).contiguous(), draft


def test_chain_draft_probs_follows_target():
    logits, p = _target(3, 1)
    lg, temp, seeds = _batch(logits)
    q, draft = _sampled_drafts(p, 2, V, 2)
    tokens, nacc = verify_chain(lg, draft, q, temperature=temp, seed=seeds)
    assert_follows(tokens[:, 0], p[0], "first token")
    assert_follows(tokens[nacc >= 1, 1], p[1], "second token | first accepted")


def test_reduced_vocab_follows_target():
    logits, p = _target(2, 3)
    lg, temp, seeds = _batch(logits)
    d2t = torch.tensor([0, 1, 1, 2, 3, 3, 3, 4, 5, 6])  # 10 draft ids -> target ids 0,2,3,5,7,8,9,11,13,15
    q, draft_ids = _sampled_drafts(p, 1, len(d2t), 4)
    draft = draft_ids + d2t[draft_ids]
    tokens, _ = verify_chain_reduced(lg, draft, q, d2t, temperature=temp, seed=seeds)
    assert_follows(tokens[:, 0], p[0], "first token (reduced vocab)")


def test_tree_follows_target():
    parents = [-1, -1, -1, 0, 0, 1]  # root -> {0, 1, 2}; 0 -> {3, 4}; 1 -> {5}
    logits, p = _target(len(parents) + 1, 5)
    lg, temp, seeds = _batch(logits)
    top = p[0].argsort(descending=True).tolist()
    top1 = p[1].argsort(descending=True).tolist()
    tok = [top[0], top[1], top[2], top1[0], top1[1], 3]
    draft = torch.tensor(tok).expand(B, -1).contiguous()
    par = torch.tensor(parents).expand(B, -1).contiguous()
    tokens, nacc, path = verify_tree(lg, draft, par, temperature=temp, seed=seeds)
    assert_follows(tokens[:, 0], p[0], "first token (tree)")
    assert_follows(tokens[path[:, 0] == 0, 1], p[1], "second token | node 0 accepted")
