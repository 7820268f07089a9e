"""Decode steps for :class:`~eagleray.platform.models.llama.LlamaModel` with static buffers and CUDA graphs.

A decode step takes one new token per sequence. :class:`DecodeGraphRunner` keeps fixed device
buffers (input ids, positions, block tables, sequence lengths, slot mapping) sized for the largest
batch bucket, builds the step on views of them, and on CUDA captures one ``torch.cuda.CUDAGraph``
per bucket (1, 2, 4, ..., 64). ``run`` copies a batch into the buffers, pads it to its bucket and
replays the graph. Nothing in the step reads a device value back to the host (capture would fail).

Two step implementations, both equal to the model's own forward:

- the *generic* step: ``model(ids, positions, DecodeMetadata, kv)`` (every supported architecture);
- :class:`FusedDecodeStep`: the same layers in ~10 launches each - q/k/v and gate/up as one GEMM
  each (the parameters become views of one fused tensor), fused residual-add + RMSNorm (in the batch-invariant
  Triton step of a small model: the adds in the products' epilogues, the norms in the next product), fused
  rotary + KV write, the split-K decode attention kernel, fused SiLU * up. Not for Qwen3 (q/k norm).

Padding rows (a batch of 3 runs in bucket 4) write their K/V to ``pad_slot``, by default the last
slot of the cache: the block manager must never hand out the cache's last block while a runner
uses it.

Use::

    runner = DecodeGraphRunner(model, kv, max_blocks_per_seq=64)
    runner.capture()                                   # CUDA only; a no-op elsewhere
    logits, aux = runner.run(DecodeRows(ids, positions, block_tables, seq_lens, slots))   # [B, V], [B, A] | None
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagleray.kernels import cpu_decode
from eagleray.kernels.decode_gemv import gemv, qkv_rope_gemv
from eagleray.kernels.decode_ops import (
    KVWrite,
    add_rmsnorm,
    add_rmsnorm_reference,
    rope_write_kv,
    rope_write_kv_reference,
    silu_mul,
    silu_mul_reference,
)
from eagleray.kernels.invariant_linear import fold_norm_weight, invariant_linear
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.attention import KVCache
from eagleray.platform.models.decode_metadata import DecodeMetadata
from eagleray.platform.models.row_graphs import DecodeRows, RowGraphs, row_slots

BUCKETS = (1, 2, 4, 8, 16, 32, 64)

Step = tuple[torch.Tensor, torch.Tensor | None]  # logits [B, V], aux [B, n_aux*H] or None


def fused_weights(done, linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused (weight, bias) of ``linears``: a :class:`FusedLinear` already made for inference, or a new one."""
    return (done.weight, done.bias) if done is not None else _fuse(linears)


def _fuse(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` by rows; their parameters become views."""
    weight = torch.cat([lin.weight.data for lin in linears])  # [sum(out), in]
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise EaglerayError("cannot fuse projections of which only some have a bias")
    bias = torch.cat([lin.bias.data for lin in linears]) if all(has_bias) else None  # [sum(out)]
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[start : start + n]
        if bias is not None:
            lin.bias.data = bias[start : start + n]
        start += n
    return weight, bias


FOLD_MAX_BYTES = 1 << 30  # folded copies larger than this are not made (SmolLM2's: 195 MB; 8B's would be 10 GB)


def room_for_folded(model, qkv, gate_up) -> bool:
    """Whether the folded copies of qkv, gate_up and the LM head are worth their memory: at most
    :data:`FOLD_MAX_BYTES` (on the H200 folding took 5% off SmolLM2's step at batch 1 but 1.2% off 8B's, which would
    pay 10 GB for it), and on CUDA within the free memory with 2 GiB to spare. Otherwise the norms stay kernels."""
    need = (
        sum(w.numel() * w.element_size() for w, _ in [*qkv[1:], *gate_up])
        + model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    )
    dev = model.lm_head.weight.device
    return need <= FOLD_MAX_BYTES and (dev.type != "cuda" or torch.cuda.mem_get_info(dev)[0] > need + (2 << 30))


class FusedDecodeStep:
    """The model's decode forward in few launches; call as ``step(ids, positions, meta, kv)``.

    ``invariant``: every product through :func:`~eagleray.kernels.invariant_linear.invariant_linear`
    (the native kernel on CPU), never cuBLAS or the batch-1 GEMVs, so a row's logits are bitwise the
    same at any batch size and beside any number of verified tokens (lossless speculation in bf16).
    With Triton (``FOLD_NORMS``) the residual adds ride the o/down products' epilogues and every RMSNorm after the
    first rides the next product: its weight folded into a copy of that product's weight (copies of qkv, gate_up and
    the LM head, made only where small: :func:`room_for_folded`), 1/rms in its epilogue from the sums of squares the
    product before wrote. Two launches a layer fewer. These products round differently from the model's own layers
    (the norm weight inside the bf16 weight, 1/rms applied to the sums), the same way for every row, so greedy
    speculation stays lossless.
    """

    FOLD_NORMS = True  # the invariant Triton step folds RMSNorm into the products (class-wide, for measurements)

    def __init__(self, model, use_triton: bool, use_gemv: bool | None = None, invariant: bool = False):
        arch = model.arch
        if arch.qk_norm:
            raise EaglerayError(
                f"the fused decode step does not implement q/k norms ({arch.model_type})\n"
                f"    fix: DecodeGraphRunner(..., fused=False) uses the model's own layers"
            )
        if invariant and model.tp.world != 1:
            raise EaglerayError(
                "the batch-invariant decode step runs on one rank (its products are not all-reduced)\n"
                "    fix: invariant=False for a tensor-parallel target"
            )
        self.model, self.use_triton, self.eps, self.invariant = model, use_triton, arch.rms_norm_eps, invariant
        # the element-wise ops: Triton kernels, or their PyTorch references (what the model's layers compute)
        kernels = (add_rmsnorm, rope_write_kv, silu_mul)
        self.add_rmsnorm, self.rope_write_kv, self.silu_mul = (
            kernels if use_triton else (add_rmsnorm_reference, rope_write_kv_reference, silu_mul_reference)
        )
        # batch 1: Triton GEMVs with the element-wise ops folded in (one rank only: no all-reduce there)
        self.use_gemv = (use_triton if use_gemv is None else use_gemv) and model.tp.world == 1 and not invariant
        fused = getattr(model, "_decode_fused", None)  # fuse once per model; later steps share it
        if fused is None:
            fused = (
                [
                    fused_weights(layer.self_attn.qkv, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                    for layer in model.layers
                ],
                [fused_weights(layer.mlp.gate_up, [layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in model.layers],
            )
            model._decode_fused = fused
        self.qkv, self.gate_up = fused
        self.fold = invariant and use_triton and self.FOLD_NORMS
        if self.fold:
            folded = getattr(model, "_decode_folded", None)
            if folded is None:  # once per model, so that every step of it (plain and verification) agrees
                folded = self._fold_weights(model) if room_for_folded(model, self.qkv, self.gate_up) else False
                model._decode_folded = folded
            self.fold = folded is not False
            if self.fold:
                self.folded_qkv, self.folded_gate_up, self.folded_lm_head = folded
        attn = model.layers[0].self_attn
        self.hq, self.hkv, self.scale, self.window = attn.heads, attn.kv_heads, attn.scale, attn.sliding_window
        self.inv_freq = attn.rotary.inv_freq.to(torch.float32)  # [D/2], the same for every layer

    def _fold_weights(self, model) -> tuple[list, list, torch.Tensor]:
        """qkv of layers 1.. and every gate_up times their norm's weight; the LM head times the last norm's."""
        qkv = [None] + [
            fold_norm_weight(w, layer.input_layernorm.weight) for (w, _), layer in zip(self.qkv[1:], model.layers[1:])
        ]
        gate_up = [
            fold_norm_weight(w, layer.post_attention_layernorm.weight) for (w, _), layer in zip(self.gate_up, model.layers)
        ]
        return qkv, gate_up, fold_norm_weight(model.lm_head.weight, model.norm.weight)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata, kv: KVCache) -> Step:
        m = self.model
        b = ids.shape[0]
        if b == 1 and self.use_gemv:
            return self._gemv_step(ids, positions, meta, kv)
        if self.fold:
            return self._folded_step(ids, positions, meta, kv)
        h, delta = m.embed(ids), None  # [B, H]
        wanted = set(m.aux_layer_ids)
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(m.layers):
            x, h = self.add_rmsnorm(h, delta, layer.input_layernorm.weight, self.eps)  # [B, H] x2
            if i in wanted:
                aux.append(h)
            qkv = self._linear(x, *self.qkv[i])  # [B, (Hq+2Hkv)*D]
            q = self.rope_write_kv(qkv, self._kv_write(i, positions, meta, kv))  # [B, Hq, D]
            o = meta.attend_cached(q, kv.k[i], kv.v[i], self.scale, self.window)  # [B, Hq, D]
            delta = self._proj(layer.self_attn.o_proj, o.reshape(b, -1))  # [B, H]
            x, h = self.add_rmsnorm(h, delta, layer.post_attention_layernorm.weight, self.eps)
            delta = self._proj(layer.mlp.down_proj, self.silu_mul(self._linear(x, *self.gate_up[i])))  # [B, H]
        x, h = self.add_rmsnorm(h, delta, m.norm.weight, self.eps)
        if m.arch.num_layers in wanted:
            aux.append(h)
        logits = self._linear(x, m.lm_head.weight)[:, : m.arch.vocab_size] if self.invariant else m.compute_logits(x)
        return logits, (torch.cat(aux, dim=-1) if aux else None)

    def _folded_step(self, ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata, kv: KVCache) -> Step:
        """The invariant Triton step with the residual adds in the o/down epilogues and RMSNorm in the next product
        (see the class docstring): per layer the four products, rotary + K/V write, attention, SiLU * up."""
        m, eps = self.model, self.eps
        b = ids.shape[0]
        h = m.embed(ids)  # [B, H]
        wanted = set(m.aux_layer_ids)
        aux: list[torch.Tensor] = []
        sq = None  # [B, T] fp32: h's rows' sums of squares, by the product that made h
        for i, layer in enumerate(m.layers):
            if i in wanted:
                aux.append(h)
            attn, mlp = layer.self_attn, layer.mlp
            if sq is None:  # the first layer: h is the embedding, normed by a kernel of its own
                x, _ = self.add_rmsnorm(h, None, layer.input_layernorm.weight, eps)  # [B, H]
                qkv = invariant_linear(x, *self.qkv[i])
            else:
                qkv = invariant_linear(h, self.folded_qkv[i], self.qkv[i][1], norm=(sq, eps))  # [B, (Hq+2Hkv)*D]
            q = self.rope_write_kv(qkv, self._kv_write(i, positions, meta, kv))  # [B, Hq, D]
            o = meta.attend_cached(q, kv.k[i], kv.v[i], self.scale, self.window)  # [B, Hq, D]
            h, sq = invariant_linear(
                o.reshape(b, -1).contiguous(), attn.o_proj.weight, attn.o_proj.bias, residual=h, squares=True
            )
            gu = invariant_linear(h, self.folded_gate_up[i], self.gate_up[i][1], norm=(sq, eps))  # [B, 2I]
            h, sq = invariant_linear(self.silu_mul(gu), mlp.down_proj.weight, mlp.down_proj.bias, residual=h, squares=True)
        if m.arch.num_layers in wanted:
            aux.append(h)
        logits = invariant_linear(h, self.folded_lm_head, norm=(sq, eps))[:, : m.arch.vocab_size]  # [B, V]
        return logits, (torch.cat(aux, dim=-1) if aux else None)

    def _kv_write(self, i: int, positions: torch.Tensor, meta: DecodeMetadata, kv: KVCache) -> KVWrite:
        """Layer ``i``'s new k and v: rotated at ``positions`` [B], stored in its cache at the rows' slots."""
        return KVWrite(positions, self.inv_freq, kv.k[i], kv.v[i], meta.slot_mapping, self.hq, self.hkv)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, K] @ weight [N, K].T: batch-invariant when asked (Triton on GPU, the native kernel on CPU)."""
        if not self.invariant:
            return F.linear(x, weight, bias)
        if self.use_triton:
            return invariant_linear(x.contiguous(), weight, bias)
        return cpu_decode.dispatch(x.contiguous(), weight, bias)

    def _proj(self, linear, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, linear.weight, linear.bias) if self.invariant else linear(x)

    def _gemv_step(self, ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata, kv: KVCache) -> Step:
        """Batch 1: 4 GEMV launches + attention per layer; norms, rotary, SiLU, residual adds folded in."""
        m, eps = self.model, self.eps
        h = m.embed(ids)  # [1, H] residual stream
        wanted = set(m.aux_layer_ids)
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(m.layers):
            if i in wanted:
                aux.append(h)
            attn, mlp = layer.self_attn, layer.mlp
            q = qkv_rope_gemv(
                h, layer.input_layernorm.weight, eps, *self.qkv[i], self._kv_write(i, positions, meta, kv)
            )  # [1, Hq, D]
            o = meta.attend_cached(q, kv.k[i], kv.v[i], self.scale, self.window)  # [1, Hq, D]
            h = gemv(o.reshape(1, -1), attn.o_proj.weight, attn.o_proj.bias, residual=h)  # [1, H]
            gu = gemv(h, *self.gate_up[i], mode="norm", norm_weight=layer.post_attention_layernorm.weight, eps=eps)  # [1, 2I]
            h = gemv(gu, mlp.down_proj.weight, mlp.down_proj.bias, mode="silu", residual=h)  # [1, H]
        if m.arch.num_layers in wanted:
            aux.append(h)
        logits = gemv(h, m.lm_head.weight, mode="norm", norm_weight=m.norm.weight, eps=eps)  # [1, V_pad]
        return logits[:, : m.arch.vocab_size], (torch.cat(aux, dim=-1) if aux else None)


class DecodeGraphRunner:
    """The target's decode step over :class:`RowGraphs` (CUDA graphs per bucket on CUDA).

    Rows score a plain decode batch (one row per sequence) and a chain verification (k+1 rows per
    sequence, each with its own length: every row's K/V is written before any row attends).
    ``invariant`` makes a row's result independent of the other rows (see :class:`FusedDecodeStep`);
    with ``lazy`` a bucket's graph is captured the first time a batch needs it. A change of the
    model's aux layers drops the graphs (they captured the old ones).
    """

    SPLIT_TOKENS = 256  # attention split length of the batch-invariant step

    def __init__(
        self,
        model,
        kv_cache: KVCache,
        max_blocks_per_seq: int,
        *,
        buckets=BUCKETS,
        fused: bool | None = None,
        use_triton: bool | None = None,
        use_graphs: bool | None = None,
        pad_slot: int | None = None,
        use_gemv: bool | None = None,
        invariant: bool = False,
        lazy: bool = False,
        tail_width: int = 0,
    ):
        dev = kv_cache.k.device
        cuda = dev.type == "cuda"
        self.model, self.kv = model, kv_cache
        self.use_triton = cuda if use_triton is None else use_triton
        fused = (not model.arch.qk_norm) if fused is None else fused
        if invariant and not fused:
            raise EaglerayError("the batch-invariant step is the fused one\n    fix: fused=True (not for q/k-norm models)")
        self.step = FusedDecodeStep(model, self.use_triton, use_gemv, invariant) if fused else self._generic_step
        self.split_tokens = self.SPLIT_TOKENS if invariant else None
        pad = kv_cache.num_blocks * kv_cache.block_size - 1 if pad_slot is None else int(pad_slot)
        graphs = cuda if use_graphs is None else use_graphs
        self.rows = RowGraphs(dev, buckets, max_blocks_per_seq, kv_cache.block_size, pad, graphs, lazy, tail_width)
        self.buckets, self.pad_slot, self.max_blocks = self.rows.buckets, pad, self.rows.max_blocks
        self.pad_block = self.rows.pad_block  # the block padding rows read and write
        self._aux_key = tuple(model.aux_layer_ids)

    @property
    def graphs(self) -> dict:
        return self.rows.graphs

    @property
    def captures(self) -> int:
        """Graphs captured so far (a step that captured one took a capture's time)."""
        return self.rows.captures

    @property
    def use_graphs(self) -> bool:
        return self.rows.use_graphs

    def _generic_step(self, ids, positions, meta, kv) -> Step:
        hidden, aux = self.model(ids, positions, meta, kv)  # [B, H], [B, A] | None
        return self.model.compute_logits(hidden), aux

    def _forward(self, b: int, tail: bool = False) -> Step:
        """The step on the first ``b`` rows of the static buffers (``tail``: with the rows' tails)."""
        r = self.rows
        return self.step(r.input_ids[:b], r.positions[:b], r.meta(b, self.use_triton, self.split_tokens, tail), self.kv)

    def bucket_for(self, b: int) -> int:
        return self.rows.bucket_for(b)

    def capture(self, buckets=None) -> None:
        self.rows.capture(self._aux_key, buckets or self.rows.buckets, self._forward)

    @torch.inference_mode()
    def run_staged(self, staged: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Score a plain decode batch staged on the device: ``staged`` [Bmax, 2 + max_blocks] int64 (a row per
        sequence: its last token, that token's position, its block table; rows past the batch padded to ``bucket``
        with a token at position 0 of the pad block). The rows' lengths and slots are derived inside the graph, so
        a step is one staging copy and one replay.

        Returns static views of ``bucket`` rows (valid until the next replay): logits [bucket, V], their argmax
        [bucket] (greedy tokens, no separate launch), aux [bucket, A] or None."""
        self._check_aux_key()
        return self.rows.replay(("staged", self._aux_key), bucket, lambda b: self._staged_forward(staged, b))

    def _staged_forward(self, staged: torch.Tensor, b: int):
        m, bs = staged[:b], self.rows.block_size
        pos = m[:, 1].contiguous()  # [b]
        tables = m[:, 2 : 2 + self.max_blocks].to(torch.int32)  # [b, MB]
        meta = DecodeMetadata(
            tables, (pos + 1).to(torch.int32), row_slots(tables, pos, bs), bs, self.use_triton, self.split_tokens
        )
        logits, aux = self.step(m[:, 0].contiguous(), pos, meta, self.kv)  # [b, V], [b, A] | None
        return logits, cpu_decode.argmax_last(logits), aux

    def _check_aux_key(self) -> None:
        """Drop the graphs when the model's aux layers changed (they captured the old ones)."""
        if tuple(self.model.aux_layer_ids) != self._aux_key:
            self.rows.reset()
            self._aux_key = tuple(self.model.aux_layer_ids)

    @torch.inference_mode()
    def run(self, rows: DecodeRows) -> Step:
        """Score ``rows`` (block tables of at most ``max_blocks_per_seq`` blocks; rows with tails - a draft tree's -
        replay graphs of their own).

        Returns views of static outputs (valid until the next ``run``): logits [B, V], aux or None.
        """
        b = rows.num_rows
        self._check_aux_key()
        bucket = self.rows.load(rows)
        if rows.tail_slots is not None:
            logits, aux = self.rows.replay(("tail", self._aux_key), bucket, lambda n: self._forward(n, tail=True))
        else:
            logits, aux = self.rows.replay(self._aux_key, bucket, self._forward)
        return logits[:b], (None if aux is None else aux[:b])
