"""The EAGLE-3 draft's forward over fixed row buffers with CUDA graphs: catch-up rows, chain rows, and the greedy chain
as one replay (the engine's draft path on CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagleray.kernels.decode_ops import KVWrite, add_rmsnorm, rope_write_kv, silu_mul
from eagleray.kernels.invariant_linear import invariant_linear
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.attention import KVCache
from eagleray.platform.models.decode_metadata import DecodeMetadata
from eagleray.platform.models.graphs import fused_weights
from eagleray.platform.models.row_graphs import DecodeRows, RowGraphs, chain_metadata, fill_rows


class FusedDraftStep:
    """The EAGLE-3 draft's forward on rows in ~17 launches instead of ~60: the Triton kernels of the target's decode
    step (RMSNorm with the residual add folded in, rotary + KV write, SiLU x up, split-K decode attention) around
    the layer's products. Called as the draft is, ``step(ids, positions, hidden, meta, kv) -> (normed, next_hidden)``,
    with ``meta`` a :class:`DecodeMetadata` on Triton; the same values as the draft's own forward up to the order of
    its float rounding (the draft's tokens only change which drafts are proposed, never the output).

    The products (fc, qkv, o, gate/up, down, LM head) of a forward of at most ``TRITON_PRODUCT_ROWS`` rows run on the
    target step's Triton linear (:func:`~eagleray.kernels.invariant_linear.invariant_linear`: plans tuned per GPU,
    launched with PDL), wider ones on cuBLAS. The draft needs no batch invariance; this is speed alone."""

    # class-wide, for measurements (jobs/bench/step_variants_h200.sh): 0 = cuBLAS for every product, the shipped
    # setting until the Triton products are measured on a GPU
    TRITON_PRODUCT_ROWS = 0

    def __init__(self, draft):
        if draft.tp.world != 1:
            raise EaglerayError(
                "the fused draft step runs on one rank (its products are not all-reduced)\n"
                "    fix: run a tensor-parallel draft through its own forward"
            )
        self.draft = draft
        mid = draft.midlayer
        attn, mlp = mid.self_attn, mid.mlp
        self.qkv = fused_weights(attn.qkv, [attn.q_proj, attn.k_proj, attn.v_proj])  # [(Hq+2Hkv)*D, 2H]
        self.gate_up = fused_weights(mlp.gate_up, [mlp.gate_proj, mlp.up_proj])  # [2I, H]
        self.hq, self.hkv, self.scale, self.window = attn.heads, attn.kv_heads, attn.scale, attn.sliding_window
        self.inv_freq = attn.rotary.inv_freq.to(torch.float32)  # [D/2]

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, meta: DecodeMetadata, kv: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.draft
        mid, t = d.midlayer, ids.shape[0]
        attn, mlp = mid.self_attn, mid.mlp
        hidden = hidden.to(d.arch.dtype)  # [T, H]
        hn, _ = add_rmsnorm(hidden, None, mid.hidden_norm.weight, mid.hidden_norm.eps)  # [T, H]
        en, _ = add_rmsnorm(d.embed(ids), None, mid.input_layernorm.weight, mid.input_layernorm.eps)  # [T, H]
        qkv = self._linear(torch.cat([en, hn], dim=-1), *self.qkv)  # [T, (Hq+2Hkv)*D]
        write = KVWrite(positions, self.inv_freq, kv.k[0], kv.v[0], meta.slot_mapping, self.hq, self.hkv)
        q = rope_write_kv(qkv, write)  # [T, Hq, D]; k, v stored at the rows' slots
        o = meta.attend_cached(q, kv.k[0], kv.v[0], self.scale, self.window)  # [T, Hq, D]
        residual = hn if mid.norm_before_residual else hidden
        norm2 = mid.post_attention_layernorm
        x, h = add_rmsnorm(
            residual, self._linear(o.reshape(t, -1), attn.o_proj.weight, attn.o_proj.bias), norm2.weight, norm2.eps
        )
        m = self._linear(silu_mul(self._linear(x, *self.gate_up)), mlp.down_proj.weight, mlp.down_proj.bias)  # [T, H]
        normed, pre = add_rmsnorm(h, m, d.norm.weight, d.norm.eps)  # [T, H] x2
        return normed, (normed if d.norm_output else pre)

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """The draft's :meth:`~eagleray.platform.models.eagle3.Eagle3Draft.combine_hidden_states` with its product
        here: aux [T, n_aux*H_t] -> [T, H]."""
        d = self.draft
        if d.input_norm is not None or aux.shape[-1] != d.fc_in:  # the draft's own (and its error for a wrong width)
            return d.combine_hidden_states(aux)
        return self._linear(aux.to(d.arch.dtype), d.fc.weight, d.fc.bias)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [T, H] -> draft logits [T, Vd] (the LM head's product here)."""
        return self._linear(normed, self.draft.lm_head.weight)[:, : self.draft.draft_vocab_size]

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ weight [N, K].T (+ bias) -> [T, N]: Triton up to TRITON_PRODUCT_ROWS rows, else cuBLAS."""
        if x.shape[0] <= self.TRITON_PRODUCT_ROWS:
            return invariant_linear(x.contiguous(), weight, bias)
        return F.linear(x, weight, bias)


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
        tail_width: int = 0,
    ):
        dev = kv_cache.k.device
        cuda = dev.type == "cuda"
        self.draft, self.kv = draft, kv_cache
        self.use_triton = cuda
        # the forward the graphs capture: the fused step on CUDA (one rank), else the draft's own
        self.step = FusedDraftStep(draft) if cuda and draft.tp.world == 1 else draft
        pad = kv_cache.num_blocks * kv_cache.block_size - 1
        graphs = cuda if use_graphs is None else use_graphs
        self.rows = RowGraphs(dev, buckets, max_blocks_per_seq, kv_cache.block_size, pad, graphs, lazy, tail_width)
        bmax, dt = self.rows.buckets[-1], draft.arch.dtype
        self.aux_in = torch.zeros(bmax, draft.fc_in, dtype=dt, device=dev)  # [Rmax, n_aux*H_t]
        self.hidden_in = torch.zeros(bmax, draft.arch.hidden_size, dtype=dt, device=dev)  # [Rmax, H]
        # the greedy chain's inputs: first draft token (target id), its position, the sequences' block tables
        self.chain_ids = torch.zeros(bmax, dtype=torch.int64, device=dev)  # [Bmax]
        self.chain_first = torch.zeros(bmax, dtype=torch.int64, device=dev)  # [Bmax]
        self.chain_tables = torch.full(
            (bmax, self.rows.max_blocks), self.rows.pad_block, dtype=torch.int32, device=dev
        )  # [Bmax, MB]
        vocab = draft.d2t.shape[0]
        self._draft_ids = torch.arange(vocab, dtype=torch.int64, device=dev)  # [Vd]
        self._target_ids = torch.zeros(vocab, dtype=torch.int64, device=dev)  # [Vd]: target_id_map's output

    def target_id_map(self) -> torch.Tensor:
        """[Vd] the target id of each draft id (draft id + d2t), made by one launch in the graph being captured (a
        token's mapping is then one gather instead of a gather and an add; d2t is read at every replay)."""
        return torch.add(self._draft_ids, self.draft.d2t, out=self._target_ids)

    def _forward(self, from_aux: bool, tail: bool = False):
        def forward(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            r = self.rows
            h = self.step.combine_hidden_states(self.aux_in[:b]) if from_aux else self.hidden_in[:b]  # [b, H]
            meta = r.meta(b, self.use_triton, None, tail)
            normed, hidden = self.step(r.input_ids[:b], r.positions[:b], h, meta, self.kv)
            return self.step.compute_logits(normed), hidden  # [b, Vd], [b, H]

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
            ids, hidden, out = self.chain_ids[:b], self.hidden_in[:b], []
            to_target = self.target_id_map()  # [Vd]
            rows = chain_metadata(self.chain_tables[:b], self.chain_first[:b], steps, self.rows.block_size, self.use_triton)
            for pos, meta in rows:  # [b], its metadata
                normed, hidden = self.step(ids, pos, hidden, meta, self.kv)  # [b, H]
                ids = to_target[self.step.compute_logits(normed).argmax(-1)]  # [b] target ids
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
        """``rows`` as :meth:`RowGraphs.load` (with tails: a draft tree's nodes, graphs of their own), hidden
        [R, n_aux*H_t] (from_aux) or [R, H] -> logits [R, Vd], next hidden [R, H] (views valid until the next run)."""
        b = rows.num_rows
        bucket = self.rows.load(rows)
        fill_rows(b, bucket, [(self.aux_in if from_aux else self.hidden_in, hidden, 0)])
        tail = rows.tail_slots is not None
        logits, nxt = self.rows.replay(("tail", from_aux) if tail else from_aux, bucket, self._forward(from_aux, tail))
        return logits[:b], nxt[:b]
