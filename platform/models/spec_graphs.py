"""The greedy speculative chain step as two CUDA graphs per (batch bucket, k): drafting and verification.

Drafting: the draft's catch-up over the positions committed since the last step (up to ``C = k_max + 1`` rows a
sequence, the rows past a sequence's count padded into the pad block), its first draft token from the last
catch-up row, then k-1 greedy chain steps. Verification: the target's batch-invariant step over k+1 rows a
sequence (the last committed token and the k drafts, each row attending to its own prefix), then greedy chain
verification (the Triton kernel on CUDA). A step is staged with one non-blocking host -> device copy
(:class:`~eagleray.platform.models.row_graphs.StepStage`) and the aux rows of the committed positions in one
device concatenation; nothing is read back to the host until the caller reads the accepted tokens. The
verification rows are the same kernels as a plain decode row, so a position's logits are bitwise those of
plain decoding (lossless in bf16).

Stage columns of sequence b (int64): ``[0, C)`` catch-up tokens, ``C`` first catch-up position, ``C+1`` the
number of catch-up tokens (1..C), ``C+2`` the last committed token, ``C+3`` its position, ``C+4..`` the block
table (entries past the sequence's blocks are stale and never read).
"""

from __future__ import annotations

from typing import Callable

import torch

from eagleray.platform.models.decode_metadata import DecodeMetadata
from eagleray.platform.models.draft_graphs import DraftGraphRunner
from eagleray.platform.models.graphs import DecodeGraphRunner
from eagleray.platform.models.row_graphs import GraphSet, StepStage, chain_metadata, pick_bucket, row_slots

GreedyVerify = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits, drafts -> tokens, nacc


class ChainStepGraphs:
    """Drafting and verification of a greedy chain step over fixed buffers for up to ``max(buckets)`` sequences.

    ``verify(logits [B, k+1, V] fp32, drafts [B, k]) -> (tokens [B, k+1], num_accepted [B])`` must not read
    device values back to the host (it is captured). Use::

        g.put(b, catch_up_tokens, first_pos, last_token, last_pos, block_table)   # each sequence b < n
        bucket = g.load(n, aux)               # [T, A] catch-up aux rows, sequence by sequence
        drafts = g.draft(bucket, k)           # [bucket, k] target ids
        tokens, nacc, aux = g.verify(bucket, k)
    """

    def __init__(self, target: DecodeGraphRunner, draft: DraftGraphRunner, verify: GreedyVerify, buckets, k_max: int):
        dev = target.kv.k.device
        self.target, self.drafter, self.verify_fn = target, draft, verify
        self.buckets = tuple(sorted(buckets))
        self.columns = k_max + 1  # C: catch-up rows a sequence
        self.block_size, self.pad_block = target.rows.block_size, target.rows.pad_block
        bmax, width = self.buckets[-1], self.columns + 4 + target.rows.max_blocks
        self.stage = StepStage(bmax, width, dev)
        self.pad_row = [0] * self.columns + [0, 1, 0, 0] + [self.pad_block] * target.rows.max_blocks
        aux_width = draft.draft.fc_in
        self.aux_cat = torch.zeros(bmax * self.columns, aux_width, dtype=target.model.arch.dtype, device=dev)  # [Bmax*C, A]
        self.col = torch.arange(self.columns, device=dev)  # [C]
        self.seq_index = torch.arange(bmax, device=dev)  # [Bmax]
        self.graphs = GraphSet(dev, target.rows.use_graphs, lazy=True)
        self._drafts: torch.Tensor | None = None  # the last draft() output: what verify() reads

    def capture(self, ks) -> None:
        """Capture drafting and verification for every bucket and each k in ``ks`` now (CUDA; a no-op elsewhere), on
        staged padding rows that touch only the pad block: a lazy capture inside a step would cost that step (and
        the adaptive policy's cost tables) a capture's time."""
        if not self.graphs.use_graphs:
            return
        self.stage.host[:] = self.pad_row
        self.stage.upload(self.buckets[-1])
        for k in ks:
            for b in sorted(self.buckets, reverse=True):
                self.draft(b, k)
                self.verify(b, k)
        torch.cuda.synchronize()  # the staging copy is done before a step writes the pinned rows again

    def bucket_for(self, n: int) -> int:
        return pick_bucket(self.buckets, n, "sequences", f"build the engine with max_num_seqs >= {n}")

    def put(self, b: int, tokens: list[int], first_pos: int, last_token: int, last_pos: int, table: list[int]) -> None:
        """Stage sequence ``b``: its catch-up tokens (1..C) from ``first_pos``, its last committed token at ``last_pos``."""
        row, c = self.stage.host[b], self.columns
        row[: len(tokens)] = tokens
        row[c : c + 4] = (first_pos, len(tokens), last_token, last_pos)
        row[c + 4 : c + 4 + len(table)] = table

    def load(self, n: int, aux: torch.Tensor) -> int:
        """Pad the staged rows to the bucket of ``n`` sequences, queue their copy, place the catch-up aux rows
        (``aux`` [T, A], sequence by sequence) -> the bucket."""
        bucket = self.bucket_for(n)
        if bucket > n:
            self.stage.host[n:bucket] = self.pad_row
        self.stage.upload(bucket)
        self.aux_cat[: aux.shape[0]].copy_(aux)
        return bucket

    def _key(self, kind: str, k: int) -> tuple:
        return (kind, k, tuple(self.target.model.aux_layer_ids))  # the target graphs capture the aux layers

    @torch.inference_mode()
    def draft(self, bucket: int, k: int) -> torch.Tensor:
        """The staged sequences' k greedy drafts [bucket, k] (target ids)."""
        self._drafts = self.graphs.replay(self._key("draft", k), bucket, lambda b: self._draft_forward(b, k))
        return self._drafts

    @torch.inference_mode()
    def verify(self, bucket: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Verify the last :meth:`draft` -> tokens [bucket, k+1] (-1 padded), num_accepted [bucket], target aux rows
        [bucket*(k+1), A] or None (static views, valid until the next call)."""
        return self.graphs.replay(self._key("verify", k), bucket, lambda b: self._verify_forward(b, k, self._drafts))

    def _staged(self, b: int):
        m, c = self.stage.dev[:b], self.columns
        return m[:, :c], m[:, c], m[:, c + 1], m[:, c + 2], m[:, c + 3], m[:, c + 4 :].to(torch.int32)

    def _draft_forward(self, b: int, k: int) -> torch.Tensor:
        step, bs, c = self.drafter.step, self.block_size, self.columns  # the draft's forward (FusedDraftStep on CUDA)
        tokens, first, count, _, last_pos, tables = self._staged(b)  # [b, C], [b] x4, [b, MB]
        valid = self.col[None, :] < count[:, None]  # [b, C]
        pos = torch.where(valid, first[:, None] + self.col, 0).reshape(-1)  # [b*C]; padding rows at the pad block's 0
        rows_tables = torch.where(valid[:, :, None], tables[:, None, :], self.pad_block).reshape(b * c, -1)  # [b*C, MB]
        src = torch.where(valid, (count.cumsum(0) - count)[:, None] + self.col, 0).reshape(-1)  # [b*C] row of aux_cat
        meta = DecodeMetadata(
            rows_tables, (pos + 1).to(torch.int32), row_slots(rows_tables, pos, bs), bs, self.drafter.use_triton
        )
        hidden_in = step.combine_hidden_states(self.aux_cat[src])  # [b*C, H]
        normed, hidden = step(tokens.reshape(-1), pos, hidden_in, meta, self.drafter.kv)  # [b*C, H] each
        last = self.seq_index[:b] * c + count - 1  # [b] each sequence's last catch-up row
        to_target = self.drafter.target_id_map()  # [Vd]
        ids = to_target[step.compute_logits(normed[last]).argmax(-1)]  # [b] first drafts
        hidden, out = hidden[last], [ids]  # [b, H]
        # the chain: draft j+1 at the position after the last committed token's
        for p, meta in chain_metadata(tables, last_pos, k - 1, bs, self.drafter.use_triton):  # [b], its metadata
            normed, hidden = step(ids, p, hidden, meta, self.drafter.kv)  # [b, H]
            ids = to_target[step.compute_logits(normed).argmax(-1)]  # [b]
            out.append(ids)
        return torch.stack(out, dim=1)  # [b, k]

    def _verify_forward(self, b: int, k: int, drafts: torch.Tensor):
        t, bs = self.target, self.block_size
        _, _, _, last_tok, last_pos, tables = self._staged(b)
        ids = torch.cat([last_tok[:, None], drafts], dim=1).reshape(-1)  # [b*(k+1)]
        pos = (last_pos[:, None] + self.col[: k + 1]).reshape(-1)  # [b*(k+1)]
        rows_tables = tables.repeat_interleave(k + 1, dim=0)  # [b*(k+1), MB]
        meta = DecodeMetadata(
            rows_tables, (pos + 1).to(torch.int32), row_slots(rows_tables, pos, bs), bs, t.use_triton, t.split_tokens
        )
        logits, aux = t.step(ids, pos, meta, t.kv)  # [b*(k+1), V], [b*(k+1), A] | None
        tokens, nacc = self.verify_fn(logits.float().view(b, k + 1, -1), drafts)  # [b, k+1], [b]
        return tokens, nacc, aux
