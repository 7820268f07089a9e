"""Fixed-shape row buffers and CUDA graphs per bucket: the mechanism under the engine's decode, verification and draft
steps (:class:`~eagleray.platform.models.graphs.DecodeGraphRunner`, :class:`~eagleray.platform.models.draft_graphs.DraftGraphRunner`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.decode_metadata import DecodeMetadata


@dataclass
class DecodeRows:
    """R query rows on the device: row r is token ``input_ids[r]`` at ``positions[r]`` of the sequence
    whose block table is ``block_tables[r]``; it attends to that sequence's positions 0..positions[r].

    With a tail (a draft tree's rows) row r reads positions ``tail_start[r] + j`` from slot ``tail_slots[r, j]``
    instead (its ancestors' scratch slots; :mod:`~eagleray.kernels.decode_attention`)."""

    input_ids: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64
    block_tables: torch.Tensor  # [R, MB] int32
    seq_lens: torch.Tensor  # [R] int32 = positions + 1
    slots: torch.Tensor  # [R] int64 cache slot of each row's token
    tail_start: torch.Tensor | None = None  # [R] int32 first position read from tail_slots
    tail_slots: torch.Tensor | None = None  # [R, W] int64

    @classmethod
    def of(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        block_size: int,
        row_seq: torch.Tensor | None = None,
    ) -> "DecodeRows":
        """tables [B, MB]; ``row_seq`` [R] the sequence of each row (default: row r is sequence r)."""
        rows = tables if row_seq is None else tables.index_select(0, row_seq)  # [R, MB]
        return cls(input_ids, positions, rows, (positions + 1).to(torch.int32), row_slots(rows, positions, block_size))

    @classmethod
    def of_paths(cls, paths: list[tuple[int, int, int, list[int]]], tables: torch.Tensor, block_size: int, width: int):
        """Rows of draft-tree nodes, each ``(sequence, token, start, path)``: ``path`` the cache indices (after
        ``start``) of the node's ancestors from the first tree position down to the node itself, last. The row sits at
        position start + len(path) - 1, writes its K/V at index start + path[-1] and reads positions start.. through
        its tail at start + path (padded to ``width`` with its own). ``tables`` [B, MB] int32; one host -> device copy."""
        host = [[b, tok, start] + path + [path[-1]] * (width - len(path)) + [len(path)] for b, tok, start, path in paths]
        dev = torch.tensor(host, dtype=torch.int64).to(tables.device)  # [R, 3 + width + 1]
        start, depth = dev[:, 2], dev[:, -1] - 1  # [R] each
        rows = tables.index_select(0, dev[:, 0])  # [R, MB]
        positions = start + depth  # [R]
        tail = row_slots(rows, start[:, None] + dev[:, 3:-1], block_size)  # [R, width]
        own = tail.gather(1, depth[:, None]).squeeze(1)  # [R]: the node's own slot ends its path
        return cls(dev[:, 1], positions, rows, (positions + 1).to(torch.int32), own, start.to(torch.int32), tail)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> "DecodeRows":
        """Rows ``start..stop-1``."""
        pick = slice(start, stop)
        tail = (None, None) if self.tail_slots is None else (self.tail_start[pick], self.tail_slots[pick])
        return DecodeRows(
            self.input_ids[pick], self.positions[pick], self.block_tables[pick], self.seq_lens[pick], self.slots[pick], *tail
        )

    def column(self, j: int, n: int, input_ids: torch.Tensor) -> "DecodeRows":
        """Rows laid out sequence-major, ``n`` a sequence: the j-th of each sequence, with ``input_ids`` [B]."""
        pick = slice(j, None, n)
        return DecodeRows(input_ids, self.positions[pick], self.block_tables[pick], self.seq_lens[pick], self.slots[pick])


def pick_bucket(buckets: tuple[int, ...], n: int, what: str, fix: str) -> int:
    """The smallest of the sorted ``buckets`` that holds ``n`` ``what``; an error naming ``fix`` past the largest."""
    for size in buckets:
        if size >= n:
            return size
    raise EaglerayError(f"a batch of {n} {what} exceeds the largest bucket {buckets[-1]}\n    fix: {fix}")


def row_slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots of row positions: tables [R, MB] int32 (row r's sequence), positions [R] or [R, W] int64 ->
    int64 of the same shape."""
    pos = positions.reshape(positions.shape[0], -1)  # [R, W]
    block = tables.gather(1, pos // block_size).to(torch.int64)  # [R, W]
    return (block * block_size + pos % block_size).reshape(positions.shape)


def chain_metadata(
    tables: torch.Tensor, first: torch.Tensor, steps: int, block_size: int, use_triton: bool
) -> list[tuple[torch.Tensor, DecodeMetadata]]:
    """The rows of ``steps`` greedy chain steps, step j at positions ``first + j``: tables [B, MB] int32, first [B]
    int64 -> per step (positions [B] int64, its :class:`DecodeMetadata`). Computed for all steps at once ([steps, B]
    tensors, each step's row contiguous): a chain step's own metadata was ~9 launches, and a drafting graph at batch
    1 is launch-bound."""
    if steps == 0:
        return []
    pos = first[None, :] + torch.arange(steps, device=first.device)[:, None]  # [S, B]
    slots = row_slots(tables, pos.t(), block_size).t().contiguous()  # [S, B] int64
    lens = (pos + 1).to(torch.int32)  # [S, B]
    return [(pos[j], DecodeMetadata(tables, lens[j], slots[j], block_size, use_triton)) for j in range(steps)]


class StepStage:
    """A step's per-sequence integers staged in one host -> device copy: pinned host rows [N, W] int64 (numpy
    view ``host``) and their device copy. The caller writes rows of ``host``, then :meth:`upload` queues one
    non-blocking copy, so staging never waits for the device. The host rows are written again only after the
    step's results were read back (that synchronisation orders the next write after this copy)."""

    def __init__(self, rows: int, width: int, device: torch.device):
        self._host = torch.zeros(rows, width, dtype=torch.int64, pin_memory=device.type == "cuda")  # [N, W]
        self.host = self._host.numpy()
        self.dev = torch.zeros(rows, width, dtype=torch.int64, device=device)  # [N, W]

    def upload(self, n: int) -> torch.Tensor:
        """Queue the copy of the first ``n`` host rows -> their device view [n, W]."""
        self.dev[:n].copy_(self._host[:n], non_blocking=True)
        return self.dev[:n]


def fill_rows(b: int, bucket: int, fills) -> None:
    """Stage a batch of ``b`` rows in static buffers padded to ``bucket`` rows: each (buffer, source, pad) gets
    ``source`` in its first rows (a 2-D source in its leading columns) and ``pad`` in rows b..bucket-1."""
    for buf, src, pad in fills:
        buf[(slice(0, b), *(slice(0, n) for n in src.shape[1:]))].copy_(src, non_blocking=True)
        if bucket > b:
            buf[b:bucket] = pad


class GraphSet:
    """CUDA graphs keyed by (key, bucket), captured once and replayed; run eagerly where graphs are off (CPU).

    ``replay(key, bucket, forward)`` returns ``forward(bucket)``'s outputs: from the (key, bucket) graph on CUDA -
    captured the first time it is needed when ``lazy``, or ahead by :meth:`capture` - else by running ``forward``.
    Graphs of one set share a memory pool (they replay one after another on one stream). ``captures`` counts the
    graphs captured so far (a step that captured one is not a measurement of the step's cost).
    """

    def __init__(self, device: torch.device, use_graphs: bool, lazy: bool):
        if use_graphs and device.type != "cuda":
            raise EaglerayError("CUDA graphs need the KV cache on a CUDA device\n    fix: use_graphs=False on CPU")
        self.use_graphs, self.lazy = use_graphs, lazy
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, object] = {}
        self.captures = 0
        self._pool = None

    def replay(self, key, bucket: int, forward):
        """``forward(bucket)``'s outputs: from the (key, bucket) graph on CUDA, else run eagerly."""
        if self.use_graphs and self.lazy and (key, bucket) not in self.graphs:
            self.capture(key, [bucket], forward)
        graph = self.graphs.get((key, bucket))
        if graph is None:
            return forward(bucket)
        graph.replay()
        return self.outputs[(key, bucket)]

    @torch.inference_mode()
    def capture(self, key, buckets, forward) -> None:
        """Warm up and capture one graph per bucket (largest first, one shared memory pool)."""
        if not self.use_graphs:
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for b in sorted(buckets, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile Triton kernels, pick cuBLAS algorithms
                    forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.outputs[(key, b)] = forward(b)
            self.graphs[(key, b)] = graph
            self.captures += 1

    def reset(self) -> None:
        """Drop every captured graph (the next replay captures again)."""
        self.graphs.clear()
        self.outputs.clear()


class RowGraphs(GraphSet):
    """Fixed-shape row buffers for batches up to ``max(buckets)`` rows, and one CUDA graph per bucket.

    A *row* is one query token attending to its sequence's cache up to and including itself. ``load``
    copies a batch into the buffers and pads it to its bucket (padding rows write their K/V to
    ``pad_slot``); ``replay`` (:class:`GraphSet`) runs ``forward(bucket)`` - captured once per (key, bucket) on
    CUDA, lazily or by :meth:`capture` - and returns its static outputs.
    """

    def __init__(
        self,
        device: torch.device,
        buckets,
        max_blocks: int,
        block_size: int,
        pad_slot: int,
        use_graphs: bool,
        lazy: bool,
        tail_width: int = 0,
    ):
        super().__init__(device, use_graphs, lazy)
        self.buckets, self.max_blocks, self.block_size = tuple(sorted(buckets)), int(max_blocks), block_size
        self.pad_slot = int(pad_slot)
        bmax = self.buckets[-1]
        self.input_ids = torch.zeros(bmax, dtype=torch.int64, device=device)  # [Bmax]
        self.positions = torch.zeros(bmax, dtype=torch.int64, device=device)  # [Bmax]
        self.block_tables = torch.full((bmax, self.max_blocks), -1, dtype=torch.int32, device=device)  # [Bmax, MB]
        self.seq_lens = torch.ones(bmax, dtype=torch.int32, device=device)  # [Bmax]
        self.slot_mapping = torch.full((bmax,), self.pad_slot, dtype=torch.int64, device=device)  # [Bmax]
        self.pad_block = self.pad_slot // block_size  # the block padding rows read and write (never handed out)
        self.block_tables[:, 0] = self.pad_block
        self.tail_width = int(tail_width)  # > 0: rows may carry tails of up to this many positions (tree rows)
        self.tail_start = torch.zeros(bmax, dtype=torch.int32, device=device)  # [Bmax]
        self.tail_slots = torch.full((bmax, max(self.tail_width, 1)), self.pad_slot, dtype=torch.int64, device=device)

    def bucket_for(self, b: int) -> int:
        return pick_bucket(self.buckets, b, "rows", "split the batch, or build the runner with larger buckets")

    def meta(self, b: int, use_triton: bool, split_tokens: int | None, tail: bool = False) -> DecodeMetadata:
        """The first ``b`` rows' metadata; ``tail``: with their tails (rows loaded with tails)."""
        tails = (self.tail_start[:b], self.tail_slots[:b]) if tail else (None, None)
        return DecodeMetadata(
            self.block_tables[:b], self.seq_lens[:b], self.slot_mapping[:b], self.block_size, use_triton, split_tokens, *tails
        )

    def load(self, rows: DecodeRows) -> int:
        """Copy ``rows`` (block tables of at most ``max_blocks`` blocks) into the buffers, padded with rows of one
        token at the pad slot -> the bucket the batch runs in."""
        b, nb = rows.num_rows, rows.block_tables.shape[1]
        if nb > self.max_blocks:
            raise EaglerayError(
                f"block table of {nb} blocks exceeds max_blocks_per_seq={self.max_blocks}\n"
                f"    fix: build the runner with a larger max_blocks_per_seq"
            )
        bucket = self.bucket_for(b)
        fills = [
            (self.input_ids, rows.input_ids, 0),
            (self.positions, rows.positions, 0),
            (self.block_tables, rows.block_tables, self.pad_block),
            (self.seq_lens, rows.seq_lens, 1),
            (self.slot_mapping, rows.slots, self.pad_slot),
        ]
        if rows.tail_slots is not None:
            fills += self._tail_fills(rows)
        fill_rows(b, bucket, fills)
        return bucket

    def _tail_fills(self, rows: DecodeRows) -> list:
        """The (buffer, source, pad) of rows' tails; padding rows read their pad slot at position 0."""
        width = rows.tail_slots.shape[1]
        if width > self.tail_width:
            raise EaglerayError(
                f"rows with tails of {width} positions but the row buffers hold tails of {self.tail_width}\n"
                f"    fix: build the runner with tail_width >= {width} (a draft tree's depth + 1)"
            )
        return [(self.tail_start, rows.tail_start, 0), (self.tail_slots, rows.tail_slots, self.pad_slot)]
