"""Exact tests of the verification kernels (Triton interpreter on CPU, tiny vocab).

Greedy cases are checked against hand-computed answers; sampled cases against the PyTorch
references, which draw the same hash-RNG uniforms, so equality is exact.
"""

import pytest
import torch

from eagleray.kernels.errors import VerifyInputError
from eagleray.kernels.verify import (
    LaunchConfig,
    verify_chain,
    verify_chain_greedy,
    verify_chain_reduced,
    verify_chain_reduced_reference,
    verify_chain_reference,
    verify_tree,
    verify_tree_greedy_host,
    verify_tree_reference,
)

V = 24
# The GPU-shaped launch (one row per program, several vocab blocks) at interpreter scale.
SMALL_TILES = LaunchConfig(block_v=8, warps=1, recover_block_v=16, recover_warps=1, batch_block=1)


def _onehot_logits(argmaxes: list[list[int]], vocab: int = V) -> torch.Tensor:
    """[B, K+1, V] logits whose row argmax is given."""
    logits = torch.randn(len(argmaxes), len(argmaxes[0]), vocab, generator=torch.Generator().manual_seed(0))
    for b, row in enumerate(argmaxes):
        for j, a in enumerate(row):
            logits[b, j, a] = 10.0
    return logits


def _zeros(b: int):
    return torch.zeros(b, dtype=torch.float32), torch.arange(b, dtype=torch.int64)


@pytest.mark.parametrize("config", [None, SMALL_TILES])
def test_greedy_chain_exact(config):
    logits = _onehot_logits([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [1, 2, 3, 4]])
    draft = torch.tensor([[3, 4, 5], [7, 4, 5], [3, 4, 9], [3, -1, -1], [-1, -1, -1]])
    temp, seed = _zeros(5)
    tokens, nacc = verify_chain(logits, draft, temperature=temp, seed=seed, config=config)
    assert nacc.tolist() == [3, 0, 2, 1, 0]  # accept all, reject at 0, mixed, padded, no drafts
    assert tokens.tolist() == [[3, 4, 5, 6], [3, -1, -1, -1], [3, 4, 5, -1], [3, 4, -1, -1], [1, -1, -1, -1]]


def test_greedy_pytorch_path_equals_the_hand_computed_answer_and_the_reference():
    logits = _onehot_logits([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [1, 2, 3, 4]])
    draft = torch.tensor([[3, 4, 5], [7, 4, 5], [3, 4, 9], [3, -1, -1], [-1, -1, -1]])
    tokens, nacc = verify_chain_greedy(logits, draft)
    assert nacc.tolist() == [3, 0, 2, 1, 0]
    assert tokens.tolist() == [[3, 4, 5, 6], [3, -1, -1, -1], [3, 4, 5, -1], [3, 4, -1, -1], [1, -1, -1, -1]]
    logits, draft, *_ = _random_case()
    draft[::2, :2] = logits[::2, :2].argmax(-1)  # accepted prefixes in every other row
    temp, seed = _zeros(len(draft))
    ref = verify_chain_reference(logits, draft, None, temperature=temp, seed=seed)
    out = verify_chain_greedy(logits, draft)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_greedy_acceptance_on_the_host_equals_the_tensor_ops():
    """The CPU path (a loop over host ints) and the device path (tensor ops a CUDA graph captures) agree row by row:
    accepted prefixes, rejections at every position, padding, no drafts, one row."""
    from eagleray.kernels.verify_chain import accept_greedy, accept_greedy_host

    g = torch.Generator().manual_seed(3)
    for bsz, k in ((1, 1), (1, 4), (7, 3), (33, 5)):
        arg = torch.randint(0, 6, (bsz, k + 1), generator=g)
        d = torch.randint(0, 6, (bsz, k), generator=g)
        d[::3] = arg[::3, :k]  # every draft accepted in every third row
        d[1::4, k // 2 :] = -1  # padded rows
        host, dev = accept_greedy_host(arg, d), accept_greedy(arg, d)
        assert torch.equal(host[0], dev[0]) and torch.equal(host[1], dev[1]), (bsz, k)
        assert host[0].dtype == dev[0].dtype and host[1].dtype == dev[1].dtype


def test_greedy_k1_and_bf16():
    logits = _onehot_logits([[2, 9], [2, 9]]).to(torch.bfloat16)
    draft = torch.tensor([[2], [5]])
    tokens, nacc = verify_chain(logits, draft, temperature=_zeros(2)[0], seed=_zeros(2)[1])
    assert tokens.tolist() == [[2, 9], [2, -1]] and nacc.tolist() == [1, 0]


def _random_case(bsz=40, k=4, vocab=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, k + 1, vocab, generator=g) * 2
    q = torch.softmax(torch.randn(bsz, k, vocab, generator=g) + logits[:, :k], -1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(bsz, k)
    if bsz > 4:
        draft[3, 1:] = -1  # padded rows: fewer drafts
        draft[4, :] = -1
    temp = torch.rand(bsz, generator=g) + 0.3
    temp[::3] = 0.0  # mixed batch: greedy and sampled rows
    seeds = torch.randint(-(2**62), 2**62, (bsz,), generator=g)
    return logits, draft, q, temp, seeds


@pytest.mark.parametrize("use_q", [False, True])
@pytest.mark.parametrize("config", [None, SMALL_TILES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_matches_reference(use_q, config, dtype):
    # The interpreter runs one program per row with SMALL_TILES (~0.1 s a row): 12 rows keep every kind of row
    # (greedy, sampled and accepted, padded, no drafts); the default launch takes 40.
    logits, draft, q, temp, seeds = _random_case(bsz=40 if config is None else 12)
    logits = logits.to(dtype)
    qq = q if use_q else None
    got = verify_chain(logits, draft, qq, temperature=temp, seed=seeds, config=config)
    want = verify_chain_reference(logits, draft, qq, temperature=temp, seed=seeds)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    greedy = temp == 0
    assert (got[1][~greedy] > 0).any(), "some sampled drafts must be accepted"


def test_chain_seeded_determinism():
    logits, draft, q, temp, seeds = _random_case(seed=1)
    a = verify_chain(logits, draft, q, temperature=temp, seed=seeds)
    b = verify_chain(logits, draft, q, temperature=temp, seed=seeds)
    c = verify_chain(logits, draft, q, temperature=temp, seed=seeds + 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("config", [None, SMALL_TILES])
def test_reduced_matches_reference(config):
    logits, draft, _, temp, seeds = _random_case(bsz=40 if config is None else 12)  # 12 rows: as above
    d2t = torch.tensor([0, 0, 1, 1, 2, 4, 4, 5, 7, 9, 10, 12])  # draft id i -> target i + d2t[i]
    g = torch.Generator().manual_seed(5)
    q = torch.softmax(torch.randn(*draft.shape, len(d2t), generator=g), -1)
    draft_ids = torch.multinomial(q.reshape(-1, len(d2t)), 1, generator=g).reshape(draft.shape)
    draft = torch.where(draft >= 0, draft_ids + d2t[draft_ids], draft)
    got = verify_chain_reduced(logits, draft, q, d2t, temperature=temp, seed=seeds, config=config)
    want = verify_chain_reduced_reference(logits, draft, q, d2t, temperature=temp, seed=seeds)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


PARENTS = [-1, -1, -1, 0, 0, 1, 3, -1]  # root -> {0, 1, 2, 7}; 0 -> {3, 4}; 1 -> {5}; 3 -> {6}


def test_tree_greedy_exact():
    # rows: 0 = root, i+1 = after node i. Argmax path: root -> node 1 (tok 5) -> node 5 (tok 8).
    am = [[5, 2, 8, 0, 0, 0, 11, 0, 0]]
    logits = _onehot_logits(am + am)
    draft = torch.tensor([[4, 5, 6, 7, 9, 8, 1, 3], [4, 6, 6, 7, 9, 8, 1, 3]])
    parents = torch.tensor([PARENTS, PARENTS])
    temp, seed = _zeros(2)
    tokens, nacc, path = verify_tree(logits, draft, parents, temperature=temp, seed=seed)
    assert nacc.tolist() == [2, 0]
    assert tokens[0, :3].tolist() == [5, 8, 11] and tokens[1, :1].tolist() == [5]
    assert path[0, :2].tolist() == [1, 5] and (path[1] == -1).all()


def test_tree_greedy_host_walk_equals_the_reference_at_temperature_zero():
    """The CPU engine's greedy tree verification (a walk over the rows' argmaxes) returns what the reference does at
    T=0: random trees with repeated sibling tokens, a padded node, paths of every length."""
    bsz = 200
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(bsz, len(PARENTS) + 1, 6, generator=g)  # 6 tokens: siblings often repeat, paths often accepted
    draft = torch.randint(0, 6, (bsz, len(PARENTS)), generator=g)
    draft[::5, 2] = -1  # a padded node
    arg_rows = logits.argmax(-1)  # [B, N+1]
    draft[::7, 0], draft[::7, 3], draft[::7, 6] = arg_rows[::7, 0], arg_rows[::7, 1], arg_rows[::7, 4]  # 0 -> 3 -> 6 accepted
    parents = torch.tensor(PARENTS).expand(bsz, -1).contiguous()
    temp, seed = _zeros(bsz)
    tokens, nacc, path = verify_tree_reference(logits, draft, parents, temperature=temp, seed=seed)
    arg = logits.argmax(-1).tolist()
    lengths = set()
    for b in range(bsz):
        toks, pth = verify_tree_greedy_host(arg[b], draft[b].tolist(), PARENTS)
        k = int(nacc[b])
        assert (toks, pth) == (tokens[b, : k + 1].tolist(), path[b, :k].tolist()), f"row {b}"
        lengths.add(k)
    assert lengths >= {0, 1, 2, 3}, "the trees exercise accepted paths of several lengths"
    # the hand-computed case of test_tree_greedy_exact
    assert verify_tree_greedy_host([5, 2, 8, 0, 0, 0, 11, 0, 0], [4, 5, 6, 7, 9, 8, 1, 3], PARENTS) == ([5, 8, 11], [1, 5])
    assert verify_tree_greedy_host([5, 2, 8, 0, 0, 0, 11, 0, 0], [4, 6, 6, 7, 9, 8, -1, 3], PARENTS) == ([5], [])


@pytest.mark.parametrize("config", [None, LaunchConfig(block_v=8, warps=1, recover_block_v=8, recover_warps=1)])
def test_tree_matches_reference(config):
    bsz = 60 if config is None else 4
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(bsz, len(PARENTS) + 1, 12, generator=g) * 1.5
    draft = torch.randint(0, 12, (bsz, len(PARENTS)), generator=g)
    draft[:, 1] = draft[:, 0]  # a repeated sibling token
    draft[::2, 0] = logits[::2, 0].argmax(-1)
    draft[1, 7] = -1  # a padded node
    temp = torch.rand(bsz, generator=g) + 0.3
    temp[::3] = 0.0
    seeds = torch.arange(bsz) * 31 + 5
    parents = torch.tensor(PARENTS).expand(bsz, -1).contiguous()
    got = verify_tree(logits, draft, parents, temperature=temp, seed=seeds, config=config)
    want = verify_tree_reference(logits, draft, parents, temperature=temp, seed=seeds)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "mutate, arg",
    [
        (lambda a: a.update(logits=a["logits"][0]), "target_logits"),
        (lambda a: a.update(draft=a["draft"].to(torch.int32)), "draft_tokens"),
        (lambda a: a.update(draft=a["draft"][:, :1]), "draft_tokens"),
        (lambda a: a.update(q=a["q"][..., :5]), "draft_probs"),
        (lambda a: a.update(temp=a["temp"].double()), "temperature"),
        (lambda a: a.update(seed=a["seed"][:1]), "seed"),
        (lambda a: a.update(logits=a["logits"].transpose(1, 2).contiguous().transpose(1, 2)), "target_logits"),
        (lambda a: a.update(draft=a["draft"].t().contiguous().t()), "draft_tokens"),
    ],
)
def test_checked_wrapper_errors(mutate, arg):
    logits, draft, q, temp, seeds = _random_case(bsz=3, k=2)
    a = dict(logits=logits, draft=draft, q=q, temp=temp, seed=seeds)
    mutate(a)
    with pytest.raises(VerifyInputError) as err:
        verify_chain(a["logits"], a["draft"], a["q"], temperature=a["temp"], seed=a["seed"])
    assert err.value.arg == arg and "Fix:" in str(err.value)
    assert isinstance(err.value, ValueError)
