"""The split-K paged decode attention kernel (interpreter on CPU) equals its PyTorch reference; its split
plan and input checks; a row's tail (positions read from slots of its own) scores it bitwise like a plain row."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import decode_attention as module
from eagleray.kernels.decode_attention import decode_attention, decode_attention_reference, split_plan
from eagleray.kernels.errors import KernelInputError

B, HQ, HKV, D, BS, NBLOCKS = 3, 8, 2, 16, 4, 20


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NBLOCKS, BS, HKV, D, generator=g)
    v_cache = torch.randn(NBLOCKS, BS, HKV, D, generator=g)
    q = torch.randn(B, HQ, D, generator=g)
    tables = torch.randperm(NBLOCKS, generator=g)[: B * 6].view(B, 6).to(torch.int32)  # [B, 6]
    lens = torch.tensor([23, 1, 9], dtype=torch.int32)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("split_tokens", [None, 16])
def test_kernel_matches_reference(window, split_tokens):
    q, k_cache, v_cache, tables, lens = _case()
    ref = decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.25, window)
    got = decode_attention(q, k_cache, v_cache, tables, lens, 0.25, window, tile=16, split_tokens=split_tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _natural_slots(tables: torch.Tensor, b: int, positions: list[int]) -> torch.Tensor:
    """The block-table slots of ``positions`` of row ``b`` -> [n] int64."""
    pos = torch.tensor(positions)
    return tables[b, pos // BS].long() * BS + pos % BS


def _tail_case():
    """Row 0 (length 23) keeps its positions 20..22 at scratch slots of the two unused blocks, in shuffled order, and
    its block-table slots there hold other K/V (a sibling's): with its tail it must read the scratch slots.
    -> plain inputs, the same inputs moved to the tail, tail_start [B] int32, tail_slots [B, 4] int64."""
    q, k_cache, v_cache, tables, lens = _case()
    free = sorted(set(range(NBLOCKS)) - set(tables.flatten().tolist()))  # [2] blocks no row reads
    scratch = torch.tensor([free[1] * BS + 2, free[0] * BS + 3, free[1] * BS])  # [3] slots of positions 20, 21, 22
    natural = _natural_slots(tables, 0, [20, 21, 22])  # [3]
    moved_k, moved_v = k_cache.clone(), v_cache.clone()
    for cache, moved in ((k_cache, moved_k), (v_cache, moved_v)):
        flat = moved.view(-1, HKV, D)  # [NBLOCKS*BS, Hkv, D]
        flat[scratch] = cache.view(-1, HKV, D)[natural]
        flat[natural] = torch.randn(3, HKV, D, generator=torch.Generator().manual_seed(9))  # what a sibling wrote
    tail_start = torch.tensor([20, 1, 8], dtype=torch.int32)  # rows 1 and 2: tails of their own slots
    tail_slots = torch.stack(
        [
            torch.cat([scratch, scratch[-1:]]),  # W = 4: the entry past the length is never read
            torch.cat([_natural_slots(tables, 1, [0]).repeat(4)]),  # position 1 is past row 1's length 1
            torch.cat([_natural_slots(tables, 2, [8]).repeat(4)]),  # row 2's last position (8) as its tail
        ]
    )  # [B, 4]
    return (q, k_cache, v_cache, tables, lens), (q, moved_k, moved_v, tables, lens), tail_start, tail_slots


ON_GPU = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
@pytest.mark.parametrize("reference", [False, True])
def test_a_tail_scores_its_rows_bitwise_like_plain_rows(reference, device):
    """The kernel (interpreted on CPU; compiled, in bf16, on a GPU) and its reference: a row whose last positions are
    read from scratch slots gives bitwise the output of the plain row over its block table; without the tail it
    reads the sibling's K/V."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cast = lambda ts: tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in ts)  # noqa: E731
    plain, moved, tail_start, tail_slots = _tail_case()
    plain, moved, (tail_start, tail_slots) = cast(plain), cast(moved), cast((tail_start, tail_slots))
    kw = dict(reference=reference) if reference else dict(tile=16, split_tokens=16)
    want = decode_attention(*plain, 0.25, **kw)
    got = decode_attention(*moved, 0.25, tail_start=tail_start, tail_slots=tail_slots, **kw)
    assert torch.equal(got, want)
    stale = decode_attention(*moved, 0.25, **kw)
    assert not torch.equal(stale[0], want[0]) and torch.equal(stale[1:], want[1:])


@pytest.mark.parametrize("window", [None, 5])
def test_the_kernel_with_a_tail_matches_its_reference(window):
    _, moved, tail_start, tail_slots = _tail_case()
    tail = dict(tail_start=tail_start, tail_slots=tail_slots)
    ref = decode_attention_reference(*moved, 0.25, window, **tail)
    got = decode_attention(*moved, 0.25, window, tile=16, split_tokens=16, **tail)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "tail",
    [
        lambda s, t: (s, None),  # one without the other
        lambda s, t: (None, t),
        lambda s, t: (s.long(), t),  # tail_start int64
        lambda s, t: (s, t.int()),  # tail_slots int32
        lambda s, t: (s[:2], t),  # one start short
        lambda s, t: (s, t[:, :0]),  # W = 0
        lambda s, t: (s, t.t().contiguous().t()),  # rows not contiguous
    ],
)
@pytest.mark.parametrize("reference", [False, True])
def test_bad_tails_are_refused_by_name(tail, reference):
    _, moved, tail_start, tail_slots = _tail_case()
    start, slots = tail(tail_start, tail_slots)
    with pytest.raises(KernelInputError, match="tail_start, tail_slots"):
        decode_attention(*moved, 0.25, reference=reference, tail_start=start, tail_slots=slots)


def test_fixed_split_tokens_make_the_plan_independent_of_the_batch():
    assert split_plan(1024, 1, 8, 64, split_tokens=256) == split_plan(1024, 64, 8, 64, split_tokens=256) == (4, 4)
    assert split_plan(1024, 1, 8, 64) != split_plan(1024, 64, 8, 64)  # without it the split follows the batch
    with pytest.raises(KernelInputError, match="split_tokens"):
        split_plan(1024, 1, 8, 64, split_tokens=100)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: (a[0], a[1], a[2][:-1], a[3], a[4]), "k_cache, v_cache"),  # V has fewer blocks than K
        (lambda a: (a[0][:, :7], a[1], a[2], a[3], a[4]), "q, k_cache"),  # Hq 7 not a multiple of Hkv 2
        (lambda a: (a[0][..., :12], a[1][..., :12], a[2][..., :12], a[3], a[4]), "q, k_cache"),  # head_dim 12
        (lambda a: (a[0], a[1], a[2], a[3].long(), a[4]), "block_tables, seq_lens"),
        (lambda a: (a[0], a[1], a[2], a[3], a[4][:2]), "block_tables, seq_lens"),  # one length short
    ],
)
def test_bad_inputs_are_refused_by_name(change, match):
    with pytest.raises(KernelInputError, match=match):
        decode_attention(*change(_case()), 0.25)


def test_without_triton_the_wrapper_names_the_reference(monkeypatch):
    monkeypatch.setattr(module, "triton", None)
    with pytest.raises(KernelInputError, match="use decode_attention_reference"):
        decode_attention(*_case(), 0.25)
