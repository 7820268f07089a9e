"""A Llama decoder layer of a decode-sized forward in one native call (fp32, AVX-512 or AVX2): ``kernels/cpu_layer.c``.

    from eagleray.kernels import cpu_layer
    params = cpu_layer.LayerParams(in_norm, post_norm, qkv, o, gate_up, down, k_cache, v_cache, eps, eps, scale)
    step = cpu_layer.step(cpu_layer.StepInputs(cos, sin, slots, tables, keys, block_size), params.shape())  # once a forward
    out = cpu_layer.decoder_layer(h, step, cpu_layer.layer_weights(params))                          # per layer
    ref = cpu_layer.decoder_layer_reference(h, step_inputs, params)                                  # PyTorch
    draft = cpu_layer.LayerParams(..., hidden_norm=hidden_norm, hidden_eps=eps)  # the EAGLE-3 draft's layer
    out = cpu_layer.decoder_layer(hidden, step, cpu_layer.layer_weights(draft), embeds)   # draft_layer_reference

For T rows h [T, H]: RMSNorm, the q/k/v product, RoPE, the K/V write into the paged cache, paged attention, the o
product + residual, RMSNorm, the gate/up product, SiLU(gate) * up, the down product + residual: the work of the PyTorch
layer (``platform/models/layers.DecoderLayer``) without its ~15 small torch ops a layer (15-40 us of dispatch each on
the 2-core CPU). The products are :mod:`cpu_decode`'s packed-panel linear, the attention its paged attention; every
phase is row-wise, so a row's output is bitwise the same alone, beside other rows or on another thread count. No
biases, qk-norm, sliding window or tensor parallelism: the caller uses the PyTorch layer for those.

The EAGLE-3 draft's layer (``platform/models/eagle3.Eagle3Layer``) is the same kernel with a second input: for the
token embeddings e and the fc-combined hidden h [T, H], q/k/v read [RMSNorm(e), hidden_norm(h)] [T, 2H] and the o
product's residual is h (hidden_norm(h) with ``norm_residual``); the rest is the Llama layer's.

``step`` holds what every layer of a forward shares (cos/sin, slots, the rows' keys, scratch rows), ``layer_weights``
one layer's packed weights and cache (kept between forwards while :meth:`LayerWeights.current`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from eagleray.kernels import cpu_decode, cpu_panels
from eagleray.kernels.errors import KernelInputError
from eagleray.kernels.reference_ops import rotate_half, write_kv

_STEP_INTS = ("T", "H", "Hq", "Hkv", "D", "I", "bs", "bt_w", "threads")
_STEP_PTRS = ("cos", "sin", "slots", "bt", "seq", "ctx", "nnew", "mask", "xn", "qkv", "att", "h1", "gu", "act")
_WEIGHT_PTRS = ("in_norm", "post_norm", "qkv", "o", "gate_up", "down", "kc", "vc", "hid_norm")


class _Step(ctypes.Structure):  # layer_step_t
    _fields_ = [(n, ctypes.c_int64) for n in _STEP_INTS] + [(n, ctypes.c_void_p) for n in _STEP_PTRS]


class _Weights(ctypes.Structure):  # layer_weights_t
    _fields_ = (
        [(n, ctypes.c_void_p) for n in _WEIGHT_PTRS]
        + [(n, ctypes.c_float) for n in ("in_eps", "post_eps", "scale", "hid_eps")]
        + [("norm_residual", ctypes.c_int32), ("bf16", ctypes.c_int32)]
    )


@dataclass(frozen=True)
class LayerShape:
    hidden: int  # H
    heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # D
    intermediate: int  # I
    inputs: int = 1  # 1: a Llama layer (q/k/v read RMSNorm(h), H features); 2: an EAGLE-3 draft layer (2H features)


@dataclass
class StepInputs:
    """What every layer of one forward shares."""

    cos: torch.Tensor  # [T, D] fp32
    sin: torch.Tensor  # [T, D] fp32
    slots: torch.Tensor  # [T] int64 cache slot of each row's new K/V
    block_tables: torch.Tensor  # [B, W] int32
    keys: cpu_decode.RowKeys  # the keys each row sees
    block_size: int  # of the paged caches


@dataclass
class LayerParams:
    """One layer's weights (unpacked, as the model holds them) and K/V cache; ``hidden_norm`` makes it a draft layer."""

    in_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H] ([.., 2H] for a draft layer): q, k, v stacked
    o: torch.Tensor  # [H, Hq D]
    gate_up: torch.Tensor  # [2 I, H]: gate, up stacked
    down: torch.Tensor  # [H, I]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    in_eps: float
    post_eps: float
    scale: float
    hidden_norm: torch.Tensor | None = None  # [H]: the draft layer's norm of the fc-combined hidden (None: Llama)
    hidden_eps: float = 0.0
    norm_residual: bool = False  # the draft layer's residual is hidden_norm(h) (vLLM's norm_before_residual), not h

    def shape(self) -> LayerShape:
        d, hkv = self.k_cache.shape[3], self.k_cache.shape[2]
        inputs = 1 if self.hidden_norm is None else 2
        return LayerShape(self.in_norm.shape[0], self.o.shape[1] // max(d, 1), hkv, d, self.down.shape[1], inputs)

    def sources(self) -> tuple:
        """The unpacked weights a :class:`LayerWeights` is made from (what :meth:`LayerWeights.current` compares)."""
        held = (self.in_norm, self.post_norm, self.qkv, self.o, self.gate_up, self.down)
        return held if self.hidden_norm is None else (*held, self.hidden_norm)


@dataclass
class LayerStep:
    shape: LayerShape
    rows: int
    struct: _Step
    keep: tuple  # the tensors struct points into
    h_shape: torch.Size = torch.Size()  # [T, H]
    address: int = 0  # of struct


@dataclass
class LayerWeights:
    shape: LayerShape
    struct: _Weights
    sources: tuple  # the unpacked weights (LayerParams.sources) struct was made from (kept: a caller may compare ids)
    keep: tuple
    block_size: int = 0
    address: int = 0  # of struct


def supported(shape: LayerShape) -> str | None:
    """Why the native layer cannot take this shape (None: it can)."""
    s = shape
    if s.kv_heads <= 0 or s.heads % s.kv_heads or s.heads // s.kv_heads > 16:
        return f"heads {s.heads} / kv heads {s.kv_heads}: needs a whole group of at most 16 query heads per kv head"
    if s.head_dim % 16 or s.head_dim > 256:
        return f"head_dim {s.head_dim}: needs a multiple of 16 up to 256"
    return None


def _require(ok: bool, arg: str, expected: str, got, fix: str) -> None:
    if not ok:
        raise KernelInputError(arg, expected, str(got), fix)


def _f32(t: torch.Tensor, shape: tuple, arg: str) -> None:
    ok = t.device.type == "cpu" and t.dtype == torch.float32 and tuple(t.shape) == shape and t.is_contiguous()
    _require(ok, arg, f"a contiguous fp32 CPU tensor {list(shape)}", f"{list(t.shape)} {t.dtype}", "use the PyTorch layer")


def step(inputs: StepInputs, shape: LayerShape, scratch: bool = True) -> LayerStep:
    """Check one forward's inputs and allocate its scratch rows (once a forward; every layer of shape ``shape``).
    ``scratch=False``: none (a prefill's step, :mod:`eagleray.kernels.cpu_prefill`, whose phases get their rows)."""
    reason = supported(shape)
    _require(reason is None, "shape", "a shape the native layer handles", reason, "use the PyTorch layer")
    t, s = inputs.slots.shape[0], shape
    _f32(inputs.cos, (t, s.head_dim), "cos")
    _f32(inputs.sin, (t, s.head_dim), "sin")
    _require(
        inputs.slots.dtype == torch.int64 and inputs.slots.dim() == 1 and inputs.slots.is_contiguous(),
        "slots", "[T] int64 contiguous", f"{list(inputs.slots.shape)} {inputs.slots.dtype}", "pass the slot mapping",
    )  # fmt: skip
    bt = inputs.block_tables
    _require(bt.dtype == torch.int32 and bt.dim() == 2 and bt.is_contiguous(), "block_tables", "[B, W] int32 contiguous",
             f"{list(bt.shape)} {bt.dtype}", "pass the metadata's block tables")  # fmt: skip
    cpu_decode.check_rows(inputs.keys, t)
    nqkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    sizes = (s.inputs * s.hidden, nqkv, s.heads * s.head_dim, s.hidden, 2 * s.intermediate, s.intermediate)
    rows = [torch.empty(t, n, dtype=torch.float32) for n in sizes] if scratch else []  # xn, qkv, att, h1, gu, act
    threads = cpu_decode.threads() or torch.get_num_threads()
    ints = (t, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, inputs.block_size, bt.shape[1], threads)
    tensors = (inputs.cos, inputs.sin, inputs.slots, bt, *cpu_decode.row_tensors(inputs.keys), *rows)
    struct = _Step(*ints, *(x.data_ptr() for x in tensors))  # no scratch: its pointers NULL
    return LayerStep(s, t, struct, tensors, torch.Size((t, s.hidden)), ctypes.addressof(struct))


def layer_weights(params: LayerParams) -> LayerWeights:
    """One layer's packed weights and cache as the kernel reads them (keep it while :meth:`LayerWeights.current`)."""
    p = params
    s = p.shape()
    reason = supported(s)
    _require(reason is None, "params", "a layer shape the native layer handles", reason, "use the PyTorch layer")
    nqkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    for name, w, want in (("in_norm", p.in_norm, (s.hidden,)), ("post_norm", p.post_norm, (s.hidden,)),
                          ("qkv", p.qkv, (nqkv, s.inputs * s.hidden)), ("o", p.o, (s.hidden, s.heads * s.head_dim)),
                          ("gate_up", p.gate_up, (2 * s.intermediate, s.hidden)), ("down", p.down, (s.hidden, s.intermediate)),
                          ("v_cache", p.v_cache, tuple(p.k_cache.shape)), ("k_cache", p.k_cache, tuple(p.k_cache.shape))):  # fmt: skip
        _f32(w, want, f"params.{name}")
    if p.hidden_norm is not None:
        _f32(p.hidden_norm, (s.hidden,), "params.hidden_norm")
    packed = [cpu_panels.packed(w) for w in (p.qkv, p.o, p.gate_up, p.down)]
    held = (p.in_norm, p.post_norm, *packed, p.k_cache, p.v_cache) + (() if p.hidden_norm is None else (p.hidden_norm,))
    pointers = tuple(x.data_ptr() for x in held) + ((0,) if p.hidden_norm is None else ())  # hid_norm NULL: Llama
    bf16 = sum(1 << i for i, q in enumerate(packed) if q.dtype == torch.bfloat16)  # products packed in bf16 (exact)
    struct = _Weights(*(x or None for x in pointers), p.in_eps, p.post_eps, p.scale, p.hidden_eps, int(p.norm_residual), bf16)
    return LayerWeights(s, struct, p.sources(), held, p.k_cache.shape[1], ctypes.addressof(struct))


def decoder_layer(h: torch.Tensor, step: LayerStep, weights: LayerWeights, embeds: torch.Tensor | None = None) -> torch.Tensor:
    """h [T, H] fp32 -> the layer's output [T, H] (new tensor); writes the rows' K/V into the layer's cache.
    ``embeds`` [T, H] fp32: a draft layer's token embeddings (given exactly when ``weights`` is a draft layer's)."""
    if h.dtype != torch.float32 or h.shape != step.h_shape or not h.is_contiguous() or h.device.type != "cpu":
        _f32(h, tuple(step.h_shape), "h")
    if step.struct.xn is None:
        raise KernelInputError("step", "a step with scratch rows", "a prefill's step (scratch=False)", "call step(inputs, shape)")
    if weights.shape != step.shape or weights.block_size != step.struct.bs:
        raise KernelInputError("weights", f"a layer of shape {step.shape}, block size {step.struct.bs}",
                               f"{weights.shape}, block size {weights.block_size}", "make one step per layer shape and cache")  # fmt: skip
    if (embeds is not None) != (weights.shape.inputs == 2):
        raise KernelInputError("embeds", "token embeddings for a draft layer, None for a Llama layer",
                               "None" if embeds is None else "a tensor", "pass embeds exactly to a draft layer")  # fmt: skip
    if embeds is not None:
        _f32(embeds, tuple(step.h_shape), "embeds")
    out = torch.empty_like(h)  # [T, H]
    e = None if embeds is None else embeds.data_ptr()  # NULL: a Llama layer
    rc = cpu_decode.library().decoder_layer_f32(step.address, weights.address, h.data_ptr(), e, out.data_ptr())
    _require(rc == 0, "weights", "a shape the native layer handles", weights.shape, "check supported() first")
    return out


def decoder_layer_reference(h: torch.Tensor, inputs: StepInputs, p: LayerParams) -> torch.Tensor:
    """The same layer in PyTorch (the model's ops; tests): h [T, H] -> [T, H]; writes the K/V into the cache."""
    x = torch.nn.functional.rms_norm(h, (p.shape().hidden,), p.in_norm, p.in_eps)  # [T, H]
    return _attention_mlp_reference(x, h, inputs, p)


def draft_layer_reference(embeds: torch.Tensor, h: torch.Tensor, inputs: StepInputs, p: LayerParams) -> torch.Tensor:
    """The EAGLE-3 draft's layer in PyTorch (``eagle3.Eagle3Layer``'s ops; tests): token embeddings, fc-combined
    hidden [T, H] -> [T, H] (pre-norm); writes the K/V into the cache."""
    n = (p.shape().hidden,)
    normed = torch.nn.functional.rms_norm(h, n, p.hidden_norm, p.hidden_eps)  # [T, H]
    x = torch.cat([torch.nn.functional.rms_norm(embeds, n, p.in_norm, p.in_eps), normed], dim=-1)  # [T, 2H]
    return _attention_mlp_reference(x, normed if p.norm_residual else h, inputs, p)


def _attention_mlp_reference(x: torch.Tensor, residual: torch.Tensor, inputs: StepInputs, p: LayerParams) -> torch.Tensor:
    """x [T, Kin] (the normed q/k/v input), residual [T, H] -> attention + residual, then + MLP: [T, H]."""
    s, t = p.shape(), x.shape[0]
    q, k, v = torch.nn.functional.linear(x, p.qkv).split([s.heads * s.head_dim, *[s.kv_heads * s.head_dim] * 2], -1)
    cos, sin = inputs.cos[:, None], inputs.sin[:, None]  # [T, 1, D]
    q = q.reshape(t, s.heads, s.head_dim)  # [T, Hq, D]
    k = k.reshape(t, s.kv_heads, s.head_dim)  # [T, Hkv, D]
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    write_kv(p.k_cache, p.v_cache, k, v.reshape(t, s.kv_heads, s.head_dim), inputs.slots)
    att = cpu_decode.paged_attention_reference(q, p.k_cache, p.v_cache, inputs.block_tables, inputs.keys, p.scale)
    h1 = residual + torch.nn.functional.linear(att.reshape(t, -1), p.o)  # [T, H]
    x = torch.nn.functional.rms_norm(h1, (s.hidden,), p.post_norm, p.post_eps)  # [T, H]
    gate, up = torch.nn.functional.linear(x, p.gate_up).chunk(2, -1)  # [T, I] each
    return h1 + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, p.down)  # [T, H]
