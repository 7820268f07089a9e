"""The EAGLE-3 draft's forward over fixed row buffers with CUDA graphs: catch-up rows, chain rows, and the greedy chain
as one replay (the engine's draft path on CUDA)."""

from __future__ import annotations

import torch

from eagleray.platform.models.attention import KVCache
from eagleray.platform.models.decode_metadata import DecodeMetadata
from eagleray.platform.models.row_graphs import DecodeRows, RowGraphs, fill_rows, row_slots


class DraftGraphRunner:
    """The EAGLE-3 draft's forward over :class:`RowGraphs`: catch-up rows fed target aux states
    (``from_aux``) and chain rows fed the draft's own hidden state, each with CUDA graphs per bucket.

    Returns the draft logits and next hidden state of every row (static views).
    """

    def __init__(
        self,
        draft,
        kv_cache: KVCache,
        max_rows: int,
        max_blocks_per_seq: int,
        buckets,
        use_graphs: bool | None = None,
        lazy: bool = True,
    ):
        dev = kv_cache.k.device
        cuda = dev.type == "cuda"
        self.draft, self.kv = draft, kv_cache
        self.use_triton = cuda
        pad = kv_cache.num_blocks * kv_cache.block_size - 1
        self.rows = RowGraphs(
            dev, buckets, max_blocks_per_seq, kv_cache.block_size, pad, cuda if use_graphs is None else use_graphs, lazy
        )
        bmax, dt = self.rows.buckets[-1], draft.arch.dtype
        self.aux_in = torch.zeros(bmax, draft.fc_in, dtype=dt, device=dev)  # [Rmax, n_aux*H_t]
        self.hidden_in = torch.zeros(bmax, draft.arch.hidden_size, dtype=dt, device=dev)  # [Rmax, H]
        # the greedy chain's inputs: first draft token (target id), its position, the sequences' block tables
        self.chain_ids = torch.zeros(bmax, dtype=torch.int64, device=dev)  # [Bmax]
        self.chain_first = torch.zeros(bmax, dtype=torch.int64, device=dev)  # [Bmax]
        self.chain_tables = torch.full(
            (bmax, self.rows.max_blocks), self.rows.pad_block, dtype=torch.int32, device=dev
        )  # [Bmax, MB]

    def _forward(self, from_aux: bool):
        def forward(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            r = self.rows
            h = self.draft.combine_hidden_states(self.aux_in[:b]) if from_aux else self.hidden_in[:b]  # [b, H]
            normed, hidden = self.draft(r.input_ids[:b], r.positions[:b], h, r.meta(b, self.use_triton, None), self.kv)
            return self.draft.compute_logits(normed), hidden  # [b, Vd], [b, H]

        return forward

    def capture(self, chain_steps: int = 0) -> None:
        """Capture every bucket of both row kinds (catch-up from aux, chain from hidden) now, and of the greedy
        chain of ``chain_steps`` tokens (other lengths are captured when first used)."""
        for from_aux in (True, False):
            self.rows.capture(from_aux, self.rows.buckets, self._forward(from_aux))
        if chain_steps > 0:
            self.rows.capture(("chain", chain_steps), self.rows.buckets, self._chain_forward(chain_steps))

    def _chain_forward(self, steps: int):
        """Greedy drafting of ``steps`` tokens after the first, in one graph: each step's rows (position, slot)
        come from ``chain_first`` and ``chain_tables``, its token from the previous step's argmax."""

        def forward(b: int) -> torch.Tensor:
            bs = self.rows.block_size
            ids, hidden, out = self.chain_ids[:b], self.hidden_in[:b], []
            tables = self.chain_tables[:b]
            for j in range(steps):
                pos = self.chain_first[:b] + j  # [b]
                meta = DecodeMetadata(tables, (pos + 1).to(torch.int32), row_slots(tables, pos, bs), bs, self.use_triton)
                normed, hidden = self.draft(ids, pos, hidden, meta, self.kv)  # [b, H]
                ids = self.draft.to_target_ids(self.draft.compute_logits(normed).argmax(-1))  # [b] target ids
                out.append(ids)
            return torch.stack(out, dim=1)  # [b, steps]

        return forward

    @torch.inference_mode()
    def chain(
        self, first_ids: torch.Tensor, hidden: torch.Tensor, first_pos: torch.Tensor, tables: torch.Tensor, steps: int
    ) -> torch.Tensor:
        """Greedy chain: first_ids [B] (target ids of the first draft), hidden [B, H] (its draft state),
        first_pos [B] (its position), tables [B, nb] -> the next ``steps`` draft tokens [B, steps] (target ids)."""
        b = first_ids.shape[0]
        bucket = self.rows.bucket_for(b)
        fills = [
            (self.chain_ids, first_ids, 0),
            (self.hidden_in, hidden, 0),
            (self.chain_first, first_pos, 0),
            (self.chain_tables, tables, self.rows.pad_block),  # padding rows draft into the pad block
        ]
        fill_rows(b, bucket, fills)
        return self.rows.replay(("chain", steps), bucket, self._chain_forward(steps))[:b]

    @torch.inference_mode()
    def run(self, rows: DecodeRows, hidden: torch.Tensor, from_aux: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` as :meth:`RowGraphs.load`, hidden [R, n_aux*H_t] (from_aux) or [R, H]
        -> logits [R, Vd], next hidden [R, H] (views valid until the next run)."""
        b = rows.num_rows
        bucket = self.rows.load(rows)
        fill_rows(b, bucket, [(self.aux_in if from_aux else self.hidden_in, hidden, 0)])
        logits, nxt = self.rows.replay(from_aux, bucket, self._forward(from_aux))
        return logits[:b], nxt[:b]
