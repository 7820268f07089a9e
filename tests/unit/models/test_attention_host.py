"""A small CPU forward's attention metadata built on the host equals the tensor ops' (slots, row keys), and the
host path refuses the block tables the tensor path refuses."""

from __future__ import annotations

import pytest
import torch

from eagleray.platform.errors import EaglerayError
from eagleray.platform.models import attention, attention_host


def _both(monkeypatch, fn):
    """fn() on the host path, then on the tensor path (HOST_ROWS 0)."""
    host = fn()
    monkeypatch.setattr(attention_host, "HOST_ROWS", 0)
    tensor = fn()
    monkeypatch.setattr(attention_host, "HOST_ROWS", 64)
    return host, tensor


CASES = [  # (query_lens, context_lens): decode, verification, catch-up, a block boundary, a new prompt, no tokens
    ([1], [0]),
    ([1, 1, 1], [15, 16, 47]),
    ([5], [200]),
    ([3, 1, 4], [14, 31, 0]),
    ([17], [0]),
    ([0, 2], [5, 30]),
]


@pytest.mark.parametrize("qlens,ctx", CASES)
def test_host_slots_and_row_keys_equal_the_tensor_ops(monkeypatch, qlens, ctx):
    g = torch.Generator().manual_seed(len(qlens) * 7 + sum(ctx))
    tables = torch.randperm(256, generator=g)[: 16 * len(qlens)].view(len(qlens), 16).to(torch.int32)  # [B, 16]
    host, tensor = _both(monkeypatch, lambda: attention.AttentionMetadata.build(qlens, ctx, tables, 16))
    assert torch.equal(host.slot_mapping, tensor.slot_mapping) and host.slot_mapping.dtype == torch.int64
    keys_host, keys_tensor = _both(
        monkeypatch, lambda: attention.row_keys(attention.AttentionMetadata.build(qlens, ctx, tables, 16))
    )
    for field in ("seq", "ctx", "nnew", "mask"):
        assert torch.equal(getattr(keys_host, field), getattr(keys_tensor, field)), field


def test_host_row_keys_of_draft_trees_equal_the_tensor_ops(monkeypatch):
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)  # [4, 4]
    wide = torch.tril(torch.ones(64, 64, dtype=torch.bool))  # bit 63 set: the two's complement
    qlens, ctx, masks = [4, 1, 64], [9, 20, 3], [tree, None, wide]
    tables = torch.arange(15, dtype=torch.int32).view(3, 5)  # [3, 5]

    def keys():
        return attention.row_keys(attention.AttentionMetadata.build(qlens, ctx, tables, 16, tree_masks=masks))

    monkeypatch.setattr(attention_host, "HOST_ROWS", 128)  # 69 rows: the host path
    host = keys()
    monkeypatch.setattr(attention_host, "HOST_ROWS", 0)
    tensor = keys()
    for field in ("seq", "ctx", "nnew", "mask"):
        assert torch.equal(getattr(host, field), getattr(tensor, field)), field


@pytest.mark.parametrize("host_rows", [64, 0], ids=["host", "tensor"])
@pytest.mark.parametrize(
    "tables,qlens,ctx",
    [
        ([[3, -1]], [2], [15]),  # the second block is needed and not allocated
        ([[3]], [2], [15]),  # too few entries
    ],
    ids=["unallocated", "short"],
)
def test_both_paths_refuse_a_block_table_without_the_blocks_new_tokens_need(monkeypatch, host_rows, tables, qlens, ctx):
    monkeypatch.setattr(attention_host, "HOST_ROWS", host_rows)
    with pytest.raises(EaglerayError, match="sequence 0 needs 2 blocks for 17 tokens"):
        attention.AttentionMetadata.build(qlens, ctx, torch.tensor(tables, dtype=torch.int32), 16)
