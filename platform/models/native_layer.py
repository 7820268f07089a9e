"""The CPU decode path's decoder layer as one native call (:mod:`eagleray.kernels.cpu_layer`), and the rule for when.

A target forward of decode-sized rows on a CPU with the native kernels on (a plain decode step, a speculative
verification: every forward outside a prefill's :func:`~eagleray.kernels.cpu_decode.blas_gemms`, up to
``cpu_decode.MAX_ROWS`` rows) runs each :class:`~eagleray.platform.models.layers.DecoderLayer` in one call instead of
~15 torch ops; plain and speculative decoding both take it for every row, so greedy speculation stays lossless (the
kernel's rows are batch-invariant). :func:`unfused_reason` says why a layer or forward keeps the PyTorch layer:

- the forward: not fp32 CPU rows, autograd, a prefill or more than ``MAX_ROWS`` rows, the native kernels off, no KV
  cache, metadata that computes attention itself (``DecodeMetadata``), or a draft tree wider than ``cpu_decode.MAX_NEW``;
- the layer: q/k/v or gate/up not fused, biases, qk-norm, a sliding window, tensor parallelism, non-fp32 weights or
  cache, or head shapes the attention kernel does not take.

The EAGLE-3 draft's layer (``eagle3.Eagle3Layer``: a second input, the token embeddings, and its ``hidden_norm``) takes
the same kernel by the same rule, the draft's forwards being decode-sized too (catch-up over the accepted tokens, the
chain's steps, a tree's levels); its hidden norm must be fp32 as well. What every layer of one shape in a forward
shares (cos/sin, slots, row keys, scratch) is made once, on the forward's metadata (``layouts``).

A prefill's forward (inside :func:`~eagleray.kernels.cpu_decode.blas_gemms`) runs each Llama layer the rule above takes
through :mod:`eagleray.kernels.cpu_prefill` instead (:func:`prefill_forward`): oneDNN's GEMMs for the products, the
same native row kernels between them; :func:`prefill_reason` says when it does not.
"""

from __future__ import annotations

import torch

from eagleray.kernels import cpu_decode, cpu_layer, cpu_prefill
from eagleray.platform.models.attention import AttentionMetadata, native_rows, row_keys

_REASON = "cpu_layer"  # key of why the forward keeps the PyTorch layers (None: it may fuse) in AttentionMetadata.layouts
_STEP = "cpu_layer.step"  # (_STEP, LayerShape): key of the forward's step for layers of that shape
_WEIGHTS = "_eagleray_cpu_layer"  # attribute of a layer: its kernel weights handle, kept between forwards


def forward_reason(h: torch.Tensor, attn: AttentionMetadata, cache) -> str | None:
    """Why this forward's rows keep the PyTorch layers (None: they may take the native layer)."""
    if h.device.type != "cpu" or h.dtype != torch.float32 or h.dim() != 2:
        return f"hidden states {h.dtype} on {h.device}: the native layer takes fp32 CPU rows"
    if torch.is_grad_enabled() and h.requires_grad:
        return "autograd is recording"
    if not cpu_decode.decode_rows(h.shape[0]):
        return f"{h.shape[0]} rows in a prefill, past {cpu_decode.MAX_ROWS} rows, or native kernels off ({cpu_decode.status()})"
    if not isinstance(attn, AttentionMetadata) or cache is None or attn.slot_mapping is None:
        return "no paged KV cache, or metadata that computes attention itself (the GPU row step's DecodeMetadata)"
    if not native_rows(attn):
        return f"a draft tree wider than {cpu_decode.MAX_NEW} new tokens"
    return None


def layer_reason(layer, cache) -> str | None:
    """Why ``layer`` (a DecoderLayer, or an Eagle3Layer: it has a ``hidden_norm``) keeps its PyTorch forward (None: the
    native layer computes it)."""
    att, mlp = layer.self_attn, layer.mlp
    if att.qkv is None or mlp.gate_up is None:
        return "q/k/v or gate/up not fused (training)"
    if any(b is not None for b in (att.qkv.bias, att.o_proj.bias, mlp.gate_up.bias, mlp.down_proj.bias)):
        return "biases"
    if att.q_norm is not None:
        return "qk_norm"
    if att.sliding_window is not None:
        return "sliding window"
    if att.o_proj.tp.world != 1:
        return "tensor parallelism"
    weights = (att.qkv.weight, att.o_proj.weight, mlp.gate_up.weight, mlp.down_proj.weight, cache[0])
    if any(w.dtype != torch.float32 for w in weights + _norms(layer)):
        return "weights or cache not fp32"
    return cpu_layer.supported(_shape(layer))


def _norms(layer) -> tuple:
    """The layer's norm weights: input, post-attention (and a draft layer's hidden norm)."""
    hidden = getattr(layer, "hidden_norm", None)
    held = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return held if hidden is None else (*held, hidden.weight)


def _shape(layer) -> cpu_layer.LayerShape:
    att, mlp = layer.self_attn, layer.mlp
    inputs = 1 if getattr(layer, "hidden_norm", None) is None else 2
    return cpu_layer.LayerShape(
        att.o_proj.weight.shape[0], att.heads, att.kv_heads, att.head_dim, mlp.down_proj.weight.shape[1], inputs
    )


def unfused_reason(layer, h: torch.Tensor, attn: AttentionMetadata, cache) -> str | None:
    """Why this layer of this forward keeps the PyTorch layer (None: it takes the native one)."""
    return forward_reason(h, attn, cache) or layer_reason(layer, cache)


def forward(
    layer, h: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, cache, embeds: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``layer`` applied to h [T, H] in one native call -> [T, H], or None where :func:`unfused_reason` says no.
    ``embeds`` [T, H]: a draft layer's token embeddings (h is then its fc-combined hidden)."""
    weights = _ruled_weights(layer, h, attn, cache, _REASON, forward_reason)
    if weights is None:
        return None
    key = (_STEP, weights.shape)
    step = attn.layouts.get(key)
    if step is None:
        step = attn.layouts[key] = cpu_layer.step(_step_inputs(layer, positions, attn), weights.shape)
    return cpu_layer.decoder_layer(h, step, weights, None if embeds is None else embeds.contiguous())


_NOT_YET = "the forward's rule is not checked yet"


PREFILL_LAYER = True  # False: a prefill keeps the PyTorch layers (an A/B switch: bench prefill-ab)


def prefill_reason(h: torch.Tensor, attn: AttentionMetadata, cache) -> str | None:
    """Why this forward's rows keep the PyTorch layers in a prefill (None: a Llama layer takes cpu_prefill's)."""
    if not PREFILL_LAYER:
        return "native_layer.PREFILL_LAYER is off"
    if not cpu_decode.in_prefill():
        return "not a prefill (no blas_gemms)"
    if h.device.type != "cpu" or h.dtype != torch.float32 or h.dim() != 2:
        return f"hidden states {h.dtype} on {h.device}: the prefill layer takes fp32 CPU rows"
    if torch.is_grad_enabled() and h.requires_grad:
        return "autograd is recording"
    if not isinstance(attn, AttentionMetadata) or cache is None or attn.slot_mapping is None:
        return "no paged KV cache"
    if not native_rows(attn):
        return f"a draft tree wider than {cpu_decode.MAX_NEW} new tokens"
    return cpu_prefill.available()


def prefill_forward(
    layer, h: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, cache, out_rows: torch.Tensor | None = None
) -> torch.Tensor | None:
    """A Llama ``layer`` of a prefill (inside ``cpu_decode.blas_gemms``) applied to h [T, H] as oneDNN's GEMMs with the
    native row kernels between them (:mod:`eagleray.kernels.cpu_prefill`) -> [T, H] ([S, H]: the rows ``out_rows``
    [S] past attention), or None where :func:`prefill_reason` or :func:`layer_reason` says no."""
    weights = _ruled_weights(layer, h, attn, cache, _PREFILL_REASON, prefill_reason)
    if weights is None:
        return None
    key = (_PREFILL_STEP, weights.shape)
    kept = attn.layouts.get(key)  # (step, causal blocks)
    if kept is None:
        inputs, shape = _step_inputs(layer, positions, attn), weights.shape
        blocks = cpu_prefill.causal_blocks(inputs.keys, shape.heads // shape.kv_heads)
        kept = attn.layouts[key] = (cpu_layer.step(inputs, shape, scratch=False), blocks)
    att, mlp = layer.self_attn, layer.mlp
    products = cpu_prefill.Products(att.qkv.weight, att.o_proj.weight, mlp.gate_up.weight, mlp.down_proj.weight)
    return cpu_prefill.decoder_layer(h, kept[0], weights, products, kept[1], out_rows)


_PREFILL_REASON = "cpu_prefill"  # key of why a prefill keeps the PyTorch layers, in AttentionMetadata.layouts
_PREFILL_STEP = "cpu_prefill.step"  # (_PREFILL_STEP, LayerShape): key of a prefill's step


def _ruled_weights(layer, h: torch.Tensor, attn, cache, key: str, rule) -> cpu_layer.LayerWeights | None:
    """The layer's kernel weights where the forward's ``rule`` (h, attn, cache -> a reason or None; checked once a
    forward, its answer kept under ``key`` in the metadata's layouts) and :func:`layer_reason` let the layer take the
    native path, else None. Metadata of another kind (the GPU row step's computes attention itself): None."""
    if not isinstance(attn, AttentionMetadata):
        return None
    reason = attn.layouts.get(key, _NOT_YET)
    if reason is _NOT_YET:
        reason = attn.layouts[key] = rule(h, attn, cache)
    return None if reason is not None else _weights(layer, cache)


def _weights(layer, cache) -> cpu_layer.LayerWeights | None:
    """The layer's kernel weights (kept on it while what they were made from holds), or None where
    :func:`layer_reason` says no. Checked in every forward of every layer, cheaply while no parameter or module was
    registered anywhere since (:data:`_EPOCH`): the kept weight tensors' :func:`_marks` (4 us a layer on the 2-core
    CPU); after a registration, the layer's weights fetched through its modules again and their marks compared
    (23 us: the fetch was 17 of them, and every plain step paid it in each of SmolLM2's 30 layers: plain
    decoding at batch 1 38.3 -> 40.4 tok/s without it). An inference tensor has no version: a change to one in place is
    not seen (as :mod:`eagleray.kernels.weight_cache`); nor is a parameter or module replaced other than through
    PyTorch's registration (``module._parameters[name] = p``)."""
    kept = getattr(layer, _WEIGHTS, None)  # (handle, tensors, marks, epoch)
    if kept is not None and kept[3] == _EPOCH[0] and _marks(kept[1], cache) == kept[2]:
        return kept[0]
    if kept is not None and layer.self_attn.qkv is not None and layer.mlp.gate_up is not None:
        tensors = _tensors(layer)  # the same storages at the same versions: the same contiguous weights
        if _marks(tensors, cache) == kept[2]:
            setattr(layer, _WEIGHTS, (kept[0], tensors, kept[2], _EPOCH[0]))  # cheap checks again, on these tensors
            return kept[0]
    if layer_reason(layer, cache) is not None:
        return None
    held = cpu_layer.layer_weights(_params(layer, cache))
    tensors = _tensors(layer)
    setattr(layer, _WEIGHTS, (held, tensors, _marks(tensors, cache), _EPOCH[0]))  # held keeps the tensors alive
    return held


_EPOCH = [0]  # parameters and modules registered in this process (torch's global registration hooks)


def _registered(*_) -> None:
    _EPOCH[0] += 1  # a weight or module may have been replaced: every kept layer compares its weights whole once


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_module_registration_hook(_registered)


def _tensors(layer) -> tuple:
    att, mlp = layer.self_attn, layer.mlp
    return (*_norms(layer), att.qkv.weight, att.o_proj.weight, mlp.gate_up.weight, mlp.down_proj.weight)


def _marks(tensors: tuple, cache) -> tuple:
    """Each weight's version and storage (a change in place, or its ``.data`` replaced), the cache's storage."""
    return (
        *((None if w.is_inference() else w._version, w.data_ptr()) for w in tensors),
        cache[0].data_ptr(),
        cache[1].data_ptr(),
    )


def _params(layer, cache) -> cpu_layer.LayerParams:
    att, mlp = layer.self_attn, layer.mlp
    n1, n2, nh = layer.input_layernorm, layer.post_attention_layernorm, getattr(layer, "hidden_norm", None)
    return cpu_layer.LayerParams(
        n1.weight, n2.weight, att.qkv.weight, att.o_proj.weight, mlp.gate_up.weight, mlp.down_proj.weight,
        cache[0], cache[1], n1.eps, n2.eps, att.scale, None if nh is None else nh.weight,
        0.0 if nh is None else nh.eps, bool(getattr(layer, "norm_before_residual", False)),
    )  # fmt: skip


def _step_inputs(layer, positions: torch.Tensor, attn: AttentionMetadata) -> cpu_layer.StepInputs:
    cos, sin = layer.self_attn.rotary.cos_sin(positions, torch.float32)  # [T, 1, D] each
    d = cos.shape[-1]
    return cpu_layer.StepInputs(
        cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous(), attn.slot_mapping.contiguous(),
        attn.block_tables.contiguous(), row_keys(attn), attn.block_size,
    )  # fmt: skip
