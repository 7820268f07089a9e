"""Native fp32 kernels for decode-sized steps on x86-64 CPUs (AVX-512, or AVX2 with FMA): decode, verification, drafting.

    from eagleray.kernels import cpu_decode
    y = cpu_decode.linear(x, w, b)          # x [M, K], w [N, K], b [N] or None -> [M, N]; M small
    o = cpu_decode.paged_attention(q, k_cache, v_cache, block_tables, rows, scale)   # rows: RowKeys
    i = cpu_decode.argmax(logits)           # [M, V] -> [M] int64, as torch.argmax
    cpu_decode.configure("auto")            # the engine's choice: "auto" | "native" | "torch"
    cpu_decode.status()                     # "native" or "torch (<why>)"

MKL's GEMV reaches about 10 GB/s of weight streaming on the 2-core CI machine, a third of its memory
bandwidth, and its GEMM loses efficiency at the 5-64 rows of verification; a decode step is little but
streaming the weights once. ``linear`` keeps each weight in a packed layout (panels of 48 output
columns, 16 on AVX2, made on first use and kept on the tensor, :mod:`~eagleray.kernels.cpu_panels`) and computes 8 rows
x 48 columns (AVX2: up to 6 x 16) per register tile as outer products (one weight vector load, one broadcast per row and k): near the
memory bound at M = 1-8 and ~85% of the FMA peak per core from M = 16 (BENCHMARKS.md). Every output is
one FMA chain over k in order, so a token's logits do not depend on how many rows share the call
(batch-invariant: greedy speculative output stays bitwise equal to plain output). The packed copy
costs the weight's memory again (0.54 GB for SmolLM2 in fp32; half of it for a weight packed in bf16, see there).

``paged_attention`` reads K/V in place from the paged cache through the block table (no gather, no
padding), one query row at a time with an online softmax over tiles of 16 keys, so a row's output does
not depend on the rest of the batch either; a row sees its sequence's cached keys and the new keys its
bit mask allows (a draft tree, up to 64 new tokens per sequence); a causal row is simply its cached
keys up to itself (prefill of any length, unpadded).

The C source is compiled once per machine with the system C compiler (``cc -O3 -mavx512f -mfma``, or ``-mavx2
-mfma`` on a CPU without AVX-512: :mod:`~eagleray.kernels.cpu_decode_build`) into ``$EAGLERAY_HOME/kernels/`` and
loaded with ctypes; no build step at install time. The reference
of the linear is :func:`torch.nn.functional.linear` (``linear_reference``), of the attention
``paged_attention_reference``, of the argmax ``torch.argmax`` (``argmax_reference``); tests compare each pair.
"""

from __future__ import annotations

import ctypes
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from eagleray.kernels import cpu_gemm, cpu_panels
from eagleray.kernels.cpu_decode_build import library_path, open_library
from eagleray.kernels.errors import KernelBuildError, KernelInputError

logger = logging.getLogger(__name__)
MODES = ("auto", "native", "torch")
MAX_ROWS = 128  # larger M (prefill chunks) goes to MKL's blocked GEMM, which wins there

_lib: ctypes.CDLL | None = None
_mode = "auto"
_why_not: str | None = None  # reason the native kernel is not in use (None: in use, or not decided yet)
_threads: int | None = None  # kernel threads (None: torch.get_num_threads())
_blas_only = False  # inside blas_gemms(): every linear is torch's (MKL), whatever its row count


def linear_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], w [N, K], b [N] -> [M, N] (PyTorch)."""
    return torch.nn.functional.linear(x, w, b)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 rows with unit stride, w [N, K] fp32 contiguous, b [N] fp32 or None -> y [M, N] (native kernel).
    w is used in its packed layout (:func:`cpu_panels.packed`), made on first use and kept on the tensor."""
    _check(x, w, b)
    lib = _load()
    m, k = x.shape
    n = w.shape[0]
    p = cpu_panels.packed(w)  # [N / P, K, P] (P = 48, AVX2 16) fp32, or bf16 where w's values are all bf16 values
    y = torch.empty((m, n), dtype=torch.float32)  # [M, N]
    lib.linear_packed_f32(
        x.data_ptr(),
        p.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        x.stride(0),
        n,
        _threads or torch.get_num_threads(),
        int(p.dtype == torch.bfloat16),
    )
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] fp32 CPU, unit column stride -> [M] int64: the first index of each row's maximum (a NaN's, if
    the row has one), as :func:`argmax_reference`; rows in parallel on the kernel threads."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        raise KernelInputError(
            "x",
            "a 2-D fp32 CPU tensor with unit column stride and N > 0",
            f"{tuple(x.shape)} {x.dtype} on {x.device}",
            "use torch.argmax",
        )
    out = torch.empty(x.shape[0], dtype=torch.int64)  # [M]
    _load().argmax_rows_f32(
        x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0), _threads or torch.get_num_threads()
    )
    return out


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] -> [...] (PyTorch)."""
    return x.argmax(-1)


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """The engine's argmax over the last dim: the native kernel for fp32 CPU logits, else torch.argmax."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] > 0 and x.numel() > 0 and _active():
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(1) == 1:
            return argmax(flat).view(x.shape[:-1])
    return x.argmax(-1)


@dataclass
class RowKeys:
    """Which keys each query row sees: its sequence (row of the block table), the sequence's cached
    length, its number of new tokens and a bit mask over them (bit i: new token i is visible)."""

    seq: torch.Tensor  # [T] int64
    ctx: torch.Tensor  # [T] int64
    nnew: torch.Tensor  # [T] int64 (<= MAX_NEW)
    mask: torch.Tensor  # [T] int64 bits (two's complement of the uint64 mask)


MAX_NEW = 64  # new tokens per sequence a row mask can describe


def row_tensors(rows: RowKeys) -> tuple[torch.Tensor, ...]:
    """seq, ctx, nnew, mask: the order the kernels take them in."""
    return rows.seq, rows.ctx, rows.nnew, rows.mask


def check_rows(rows: RowKeys, t: int) -> None:
    """Each of ``rows``' tensors must be [t] int64 contiguous."""
    for name, v in zip(("seq", "ctx", "nnew", "mask"), row_tensors(rows)):
        if v.dtype != torch.int64 or tuple(v.shape) != (t,) or not v.is_contiguous():
            raise KernelInputError(
                f"rows.{name}", f"[{t}] int64 contiguous", f"{tuple(v.shape)} {v.dtype}", "build RowKeys with int64 tensors"
            )


def attention_supported(q: torch.Tensor, cache_k: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether :func:`paged_attention` handles this layer (else the caller uses SDPA)."""
    hq, d, hkv = q.shape[1], q.shape[2], cache_k.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and cache_k.dtype == torch.float32
        and sliding_window is None
        and hkv > 0
        and hq % hkv == 0
        and hq // hkv <= 16
        and d % 16 == 0
        and d <= 256
        and _active()
    )


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, rows: RowKeys, scale: float
) -> torch.Tensor:
    """q [T, Hq, D] fp32, K/V cache [num_blocks, block_size, Hkv, D], block_tables [B, W] int32 -> [T, Hq, D]."""
    t, hq, d = q.shape
    if not (
        q.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and block_tables.is_contiguous()
        and block_tables.dtype == torch.int32
        and k_cache.shape == v_cache.shape
        and k_cache.shape[3] == d
    ):
        raise KernelInputError(
            "q/k_cache/v_cache/block_tables",
            "contiguous fp32 q [T, Hq, D], caches [N, bs, Hkv, D] and int32 tables",
            f"q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, tables {block_tables.dtype}",
            "call .contiguous() first",
        )
    check_rows(rows, t)
    out = torch.empty_like(q)  # [T, Hq, D]
    rc = _load().paged_attention_f32(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        rows.seq.data_ptr(),
        rows.ctx.data_ptr(),
        rows.nnew.data_ptr(),
        rows.mask.data_ptr(),
        t,
        hq,
        k_cache.shape[2],
        d,
        k_cache.shape[1],
        ctypes.c_float(scale),
        _threads or torch.get_num_threads(),
    )
    if rc != 0:
        raise KernelInputError(
            "q",
            "Hq a multiple of Hkv with Hq/Hkv <= 16, head_dim a multiple of 16 up to 256",
            f"Hq={hq}, Hkv={k_cache.shape[2]}, D={d}",
            "check attention_supported() first",
        )
    return out


def paged_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, rows: RowKeys, scale: float
) -> torch.Tensor:
    """The same in PyTorch, row by row (tests)."""
    out = torch.empty_like(q)
    bs, g = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for t in range(q.shape[0]):
        ctx, nnew, bits = int(rows.ctx[t]), int(rows.nnew[t]), int(rows.mask[t]) & ((1 << 64) - 1)
        keys = [j for j in range(ctx + nnew) if j < ctx or (bits >> (j - ctx)) & 1]
        table = block_tables[int(rows.seq[t])].long()
        slots = torch.tensor([int(table[j // bs]) * bs + j % bs for j in keys])
        k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].repeat_interleave(g, dim=1)  # [L, Hq, D]
        v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].repeat_interleave(g, dim=1)  # [L, Hq, D]
        att = torch.einsum("hd,lhd->hl", q[t], k) * scale  # [Hq, L]
        out[t] = torch.einsum("hl,lhd->hd", att.softmax(-1), v)
    return out


def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    for name, t, dims in (("x", x, 2), ("w", w, 2)):
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != dims:
            raise KernelInputError(
                name,
                f"a {dims}-D fp32 CPU tensor",
                f"{tuple(t.shape)} {t.dtype} on {t.device}",
                "call torch.nn.functional.linear for other dtypes and devices",
            )
    if x.shape[1] != w.shape[1]:
        raise KernelInputError("x", f"[M, {w.shape[1]}] (w is {tuple(w.shape)})", str(tuple(x.shape)), "pass matching widths")
    if x.stride(1) != 1 or not w.is_contiguous():
        raise KernelInputError(
            "x/w",
            "rows with unit stride and a contiguous w",
            f"x strides {x.stride()}, w strides {w.stride()}",
            "call .contiguous() first",
        )
    if b is not None and (b.dtype != torch.float32 or tuple(b.shape) != (w.shape[0],) or not b.is_contiguous()):
        raise KernelInputError(
            "b", f"[{w.shape[0]}] fp32 contiguous", f"{tuple(b.shape)} {b.dtype}", "pass the layer's bias or None"
        )


def threads() -> int | None:
    """The native kernels' thread count if one was set (:func:`set_threads`), else None."""
    return _threads


def set_threads(n: int | None) -> None:
    """Threads of the native kernel (the caller plus n-1 helpers); None follows torch.get_num_threads()."""
    global _threads
    if n is not None and not 1 <= n <= 16:
        raise KernelInputError("threads", "1..16 or None", repr(n), "pass the number of cores to use")
    _threads = n


def configure(mode: str) -> str:
    """Choose the implementation for :func:`dispatch`: "auto" (native where it builds, else torch, with the
    reason logged), "native" (raise if it cannot build) or "torch". Returns :func:`status`."""
    global _mode, _why_not
    if mode not in MODES:
        raise KernelInputError("mode", f"one of {MODES}", repr(mode), "use 'auto'")
    _mode, _why_not = mode, None
    if mode == "torch":
        _why_not = "configured"
    elif mode == "native":
        _load()
    return status()


def status() -> str:
    """'native' or 'torch (<why>)'; decides (and builds) on first call under 'auto'."""
    return "native" if _active() else f"torch ({_why_not})"


@contextmanager
def blas_gemms():
    """A prompt's prefill: linears inside take a GEMM library whatever their row count, oneDNN's packed linear
    (:mod:`eagleray.kernels.cpu_gemm`) where PyTorch has it, else MKL's; only a few rows (the last token of each
    prompt into the LM head) stay on the native kernel, which streams a weight faster than either. A 126-token
    prefill took 271-303 ms on MKL against 417-1,010 ms on the native kernel; oneDNN's packed GEMM then ran
    1.1-2.3x MKL's on the prefill's shapes (a 4 x 140-token prefill 1.09-1.19 s -> 0.74-0.86 s, BENCHMARKS.md)."""
    global _blas_only
    before, _blas_only = _blas_only, True
    spin = _lib.set_helper_spin(PREFILL_HELPER_SPIN) if _lib is not None and not before else None
    try:
        yield
    finally:
        _blas_only = before
        if spin is not None:
            _lib.set_helper_spin(spin)


# Pauses the native kernels' helper threads spin after a call inside a prefill before they sleep (20,000 elsewhere,
# ~0.4 ms): between a prefill's native phases run oneDNN's GEMMs on OpenMP threads, and a helper spinning on a core
# takes it from one of them. A 161-token prompt's prefill step through cpu_prefill: median 258 ms at 20,000, 211 ms
# at 2,000, 209 ms at 500, 206 ms at 0 (the PyTorch layer's: 233 ms at 20,000, 219 ms at 0).
PREFILL_HELPER_SPIN = 0


PREFILL_NATIVE_ROWS = 16  # inside blas_gemms, at most this many rows stay native (LM head: 4.2 vs 17.8 ms MKL at 4)


def dispatch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The model's linear: the native kernel for small fp32 CPU batches without autograd (outside
    :func:`blas_gemms`, or up to ``PREFILL_NATIVE_ROWS`` rows inside it), oneDNN's packed GEMM for a prefill's
    larger ones, else PyTorch."""
    eligible = (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] > 0
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )
    if not eligible:
        return torch.nn.functional.linear(x, w, b)
    rows = PREFILL_NATIVE_ROWS if _blas_only else MAX_ROWS
    if x.shape[0] <= rows and w.is_contiguous() and x.stride(1) == 1 and _active():
        return linear(x, w, b)
    if _blas_only and cpu_gemm.available():
        return cpu_gemm.linear(x, w, b)
    return torch.nn.functional.linear(x, w, b)


def in_prefill() -> bool:
    """Whether a prefill (:func:`blas_gemms`) is running."""
    return _blas_only


def decode_rows(m: int) -> bool:
    """Whether a forward of ``m`` rows is decode-sized and takes the native kernels now: the kernels are on, ``m`` is at
    most ``MAX_ROWS`` and no prefill (:func:`blas_gemms`) is running."""
    return 0 < m <= MAX_ROWS and not _blas_only and _active()


def library() -> ctypes.CDLL:
    """The loaded native library (built first if needed)."""
    return _load()


def _active() -> bool:
    global _why_not
    if _mode == "torch" or _why_not is not None:
        return False
    if _lib is not None:
        return True
    try:
        _load()
        logger.info("CPU linear: native kernel (%s)", library_path())
        return True
    except KernelBuildError as err:
        _why_not = str(err).splitlines()[0]
        logger.warning("CPU linear: using torch.nn.functional.linear: %s", err)
        return False


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = open_library()
    return _lib
