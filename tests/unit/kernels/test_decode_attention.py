"""The split-K paged decode attention kernel (interpreter on CPU) equals its PyTorch reference; its split
plan and input checks."""

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
