"""A small forward's attention metadata computed on the host: cache slots and the native kernel's row keys of up
to ``HOST_ROWS`` new tokens on a CPU (a decode step, a draft step, a verification), as Python ints.

The vectorised versions in :mod:`~eagleray.platform.models.attention` take about ten small tensor ops each (68 and
43 us at three rows on the 2-core CPU, more inside the engine, where each op may start a parallel region that wakes
its other OpenMP thread), and a speculative step builds three such forwards. The results are equal element for
element (tested); prefills and GPU batches keep the tensor ops.
"""

from __future__ import annotations

import torch

from eagleray.kernels import cpu_decode
from eagleray.platform.errors import EaglerayError

HOST_ROWS = 64  # new tokens of a CPU forward up to which its metadata is built on the host


def use_host(num_tokens: int, device: torch.device) -> bool:
    return device.type == "cpu" and num_tokens <= HOST_ROWS


def slot_mapping(query_lens: list[int], ctx: list[int], bt: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot [T] int64 of each new token: block_tables[b][idx // bs] * bs + idx % bs, idx = ctx[b] + i."""
    tables, width = bt.tolist(), bt.shape[1]
    slots: list[int] = []
    for b, (c, q) in enumerate(zip(ctx, query_lens)):
        need = (c + q + block_size - 1) // block_size
        row = tables[b]
        if need > width or any(row[i] < 0 for i in range(c // block_size, need) if q):
            raise EaglerayError(
                f"attention: sequence {b} needs {need} blocks for {c + q} tokens but its block table "
                f"has too few valid entries\n    fix: allocate blocks before the forward"
            )
        slots.extend(row[i // block_size] * block_size + i % block_size for i in range(c, c + q))
    return torch.tensor(slots, dtype=torch.int64)


def row_keys(query_lens: list[int], context_lens: list[int], tree_masks) -> cpu_decode.RowKeys:
    """The keys each query row sees (:func:`~eagleray.platform.models.attention.row_keys`): a causal row i of a
    sequence with c cached tokens c + i + 1 cached keys and no new ones; a draft-tree row c cached keys plus a bit
    mask over the sequence's q new ones."""
    seq: list[int] = []
    ctx: list[int] = []
    nnew: list[int] = []
    mask: list[int] = []
    trees = tree_masks or [None] * len(query_lens)
    for b, (q, c, tree) in enumerate(zip(query_lens, context_lens, trees)):
        seq += [b] * q
        if tree is None:
            ctx += range(c + 1, c + q + 1)
            nnew += [0] * q
            mask += [0] * q
            continue
        allowed = tree.to(torch.bool).tolist()
        for i in range(q):
            bits = sum(1 << j for j in range(q) if allowed[i][j])
            ctx.append(c)
            nnew.append(q)
            mask.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    keys = torch.tensor((seq, ctx, nnew, mask), dtype=torch.int64)  # [4, T]: one tensor made, its rows the four
    return cpu_decode.RowKeys(*keys)
