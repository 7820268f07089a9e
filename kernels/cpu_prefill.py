"""A prompt's prefill through a Llama decoder layer on a CPU: oneDNN's packed GEMMs for the four products
(:mod:`eagleray.kernels.cpu_gemm`, the residual adds fused into the o and down products) and native kernels for
everything between them: ``kernels/cpu_layer.c``'s row kernels (RMSNorm, RoPE + the K/V write, SiLU x up) and the
causal attention of ``kernels/cpu_prefill.c`` (blocks of one sequence's rows as the lanes of a vector;
:func:`causal_blocks`), or the decode kernel's row-by-row attention.

    from eagleray.kernels import cpu_layer, cpu_prefill
    step = cpu_layer.step(inputs, shape, scratch=False)              # once a forward (the rows' keys, cos/sin, slots)
    blocks = cpu_prefill.causal_blocks(inputs.keys, heads // kv_heads)  # once a forward
    out = cpu_prefill.decoder_layer(h, step, weights, products, blocks)  # per layer; weights: cpu_layer.layer_weights
    ref = cpu_layer.decoder_layer_reference(h, inputs, params)      # the same layer in PyTorch

A prefill is GEMM-bound, but the PyTorch layer between its GEMMs runs ~15 torch ops a layer whose time grows with the
rows: a 161-token prompt spent 255 ms in SmolLM2's forward on the 2-core CPU, 183 ms of it in the GEMMs (BENCHMARKS.md).
The phases here are the fused decode layer's own (each row alone, on the kernels' thread pool), so a row's value
does not depend on the other rows; the products are oneDNN's, as the PyTorch prefill's are. Prefill of the plain and
the speculative engine both take this path, so greedy speculation stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleray.kernels import cpu_decode, cpu_gemm, cpu_layer
from eagleray.kernels.errors import KernelInputError


@dataclass(frozen=True)
class Products:
    """One layer's product weights, unpacked as the model holds them (oneDNN's packed copies are kept on them)."""

    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    o: torch.Tensor  # [H, Hq D]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


def available() -> str | None:
    """Why a prefill cannot take this layer here (None: it can): needs the native kernels and oneDNN."""
    if cpu_decode.status() != "native":
        return f"native CPU kernels off: {cpu_decode.status()}"
    if not cpu_gemm.available():
        return "PyTorch without oneDNN's packed linear"
    return None


def decoder_layer(
    h: torch.Tensor,
    step: cpu_layer.LayerStep,
    weights: cpu_layer.LayerWeights,
    products: Products,
    blocks: CausalBlocks | None = None,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [T, H] fp32 -> the Llama layer's output [T, H]; writes the rows' K/V into the layer's cache. ``blocks``:
    :func:`causal_blocks` of the step's rows (attention by the causal kernel), or None (row by row). ``out_rows``
    [S] int64: past attention only these rows go on (a model's last layer, whose other rows only leave their K/V)
    -> [S, H]."""
    s = step.shape
    _check(h, step, weights, products)
    w = weights.struct
    x = rms_norm(h, weights.sources[0], w.in_eps)  # [T, H]
    qkv = _product(x, products.qkv)  # [T, (Hq + 2 Hkv) D]
    att = rope_attention(qkv, step, weights, blocks)  # [T, Hq D]
    if out_rows is not None:
        _rows(out_rows, step.rows)
        att, h = att[out_rows], h[out_rows]  # [S, Hq D], [S, H]
    h1 = _product(att, products.o, h)  # [T or S, H]
    gu = _product(rms_norm(h1, weights.sources[1], w.post_eps), products.gate_up)  # [T or S, 2 I]
    return _product(silu_mul(gu, s.intermediate), products.down, h1)  # [T or S, H]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] fp32 -> RMSNorm(x) * weight [T, H] (each row as the fused layer's norm)."""
    _f32(x, (*x.shape[:1], weight.shape[0]), "x")  # [T, H]
    t, hid = x.shape
    _f32(weight, (hid,), "weight")
    y = torch.empty_like(x)
    rc = cpu_decode.library().rms_norm_rows_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), t, hid, eps, _threads())
    _ok(rc, "x", "[T, H] with H > 0")
    return y


def rope_attention(
    qkv: torch.Tensor, step: cpu_layer.LayerStep, weights: cpu_layer.LayerWeights, blocks: CausalBlocks | None = None
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] -> attention [T, Hq D]: RoPE on q and k in place, k and v written into the layer's
    cache at the step's slots, then each row's paged attention over the keys the step gives it: by the causal
    ``blocks`` (:func:`causal_blocks` of the step's row keys; ``cpu_prefill.c``) or, None, row by row (the decode
    kernel's)."""
    s = step.shape
    _f32(qkv, (step.rows, (s.heads + 2 * s.kv_heads) * s.head_dim), "qkv")
    if blocks is not None and (blocks.seq is not step.keep[4] or blocks.group != s.heads // s.kv_heads):
        raise KernelInputError("blocks", "causal_blocks(keys, group) of this step's row keys and head group",
                               f"blocks of other rows or group {blocks.group}", "make them from the step's StepInputs.keys")  # fmt: skip
    att = torch.empty(step.rows, s.heads * s.head_dim, dtype=torch.float32)  # [T, Hq D]
    ptr, n = (None, 0) if blocks is None else (blocks.spans.data_ptr(), blocks.spans.shape[0])
    rc = cpu_decode.library().rope_attention_f32(step.address, weights.address, qkv.data_ptr(), att.data_ptr(), ptr, n)
    _ok(rc, "step", "heads a whole group of at most 16 per kv head, head_dim a multiple of 16 up to 256")
    return att


LANES = 16  # query vectors a block of the causal kernel (cpu_prefill.c): its rows times the query heads of a kv head


@dataclass(frozen=True)
class CausalBlocks:
    """The rows of a step cut into blocks for the causal kernel (made only by :func:`causal_blocks`)."""

    spans: torch.Tensor  # [n, 2] int64: first row, rows
    seq: torch.Tensor  # the RowKeys.seq they were cut from (a step checks it holds the same tensor)
    group: int  # query heads per kv head they were cut for


def causal_blocks(keys: cpu_decode.RowKeys, group: int) -> CausalBlocks | None:
    """The rows cut into blocks for the causal kernel: runs of rows of one sequence, each seeing one key more than the
    one before and no new-token mask, in pieces of at most ``LANES // group`` rows from each run's start (so a row's
    block follows from its own sequence's rows alone); None if any row has a draft-tree mask or a kv head has more
    than ``LANES`` query heads (those take the row kernel)."""
    t = keys.seq.shape[0]
    if t == 0 or group > LANES or bool((keys.nnew != 0).any()):
        return None
    new_run = torch.ones(t, dtype=torch.bool)  # [T] a row that starts a run
    new_run[1:] = (keys.seq[1:] != keys.seq[:-1]) | (keys.ctx[1:] != keys.ctx[:-1] + 1)
    run_start = torch.nonzero(new_run).flatten()  # [R]
    in_run = torch.arange(t) - run_start[new_run.cumsum(0) - 1]  # [T] index of a row in its run
    starts = torch.nonzero(in_run % (LANES // group) == 0).flatten()  # [n]
    spans = torch.stack([starts, torch.diff(starts, append=torch.tensor([t]))], 1).contiguous()  # [n, 2]
    return CausalBlocks(spans, keys.seq, group)


def silu_mul(gu: torch.Tensor, intermediate: int) -> torch.Tensor:
    """gu [T, 2 I] = (gate, up) -> silu(gate) * up [T, I]."""
    _f32(gu, (gu.shape[0], 2 * intermediate), "gu")
    act = torch.empty(gu.shape[0], intermediate, dtype=torch.float32)  # [T, I]
    rc = cpu_decode.library().silu_mul_rows_f32(gu.data_ptr(), act.data_ptr(), gu.shape[0], intermediate, _threads())
    _ok(rc, "gu", "[T, 2 I] with I > 0")
    return act


def silu_mul_reference(gu: torch.Tensor, intermediate: int) -> torch.Tensor:
    gate, up = gu.split(intermediate, -1)  # [T, I] each
    return torch.nn.functional.silu(gate) * up


def _product(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ w^T (+ residual [T, N]): a prefill's linear as the model's dispatch takes it (oneDNN past a few rows,
    the native kernel for those), the residual added in oneDNN's post-op there."""
    if residual is not None and x.shape[0] > cpu_decode.PREFILL_NATIVE_ROWS:
        return cpu_gemm.linear_add(x, w, residual)
    with cpu_decode.blas_gemms():
        y = cpu_decode.dispatch(x, w)  # [T, N]
    return y if residual is None else y + residual


def _check(h: torch.Tensor, step: cpu_layer.LayerStep, weights: cpu_layer.LayerWeights, products: Products) -> None:
    s = step.shape
    if s.inputs != 1 or weights.shape != s or weights.block_size != step.struct.bs:
        raise KernelInputError("weights", f"a Llama layer of shape {s}, block size {step.struct.bs}",
                               f"{weights.shape}, block size {weights.block_size}", "make the step from this layer's shape")  # fmt: skip
    _f32(h, (step.rows, s.hidden), "h")
    nqkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    for name, w, want in (("qkv", products.qkv, (nqkv, s.hidden)), ("o", products.o, (s.hidden, s.heads * s.head_dim)),
                          ("gate_up", products.gate_up, (2 * s.intermediate, s.hidden)),
                          ("down", products.down, (s.hidden, s.intermediate))):  # fmt: skip
        _f32(w, want, f"products.{name}")


def _rows(rows: torch.Tensor, t: int) -> None:
    if rows.device.type != "cpu" or rows.dtype != torch.int64 or rows.dim() != 1 or (rows.numel() and not (
            0 <= int(rows.min()) and int(rows.max()) < t)):  # fmt: skip
        raise KernelInputError("out_rows", f"a 1-D int64 CPU tensor of row indices in [0, {t})",
                               f"{rows.dtype} {list(rows.shape)} on {rows.device}", "pass each sequence's last row")  # fmt: skip


def _f32(t: torch.Tensor, shape: tuple, arg: str) -> None:
    if t.device.type != "cpu" or t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
        raise KernelInputError(arg, f"a contiguous fp32 CPU tensor {list(shape)}", f"{list(t.shape)} {t.dtype}",
                               "use the PyTorch layer")  # fmt: skip


def _ok(rc: int, arg: str, expected: str) -> None:
    if rc != 0:
        raise KernelInputError(arg, expected, f"rc {rc}", "use the PyTorch layer")


def _threads() -> int:
    return cpu_decode.threads() or torch.get_num_threads()
