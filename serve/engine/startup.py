"""What an engine decides once at start: the decode path, the KV cache size, the CPU threads of a step."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from contextlib import contextmanager, nullcontext

import torch

from eagleray.kernels import cpu_decode
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.llama import LlamaModel
from eagleray.serve.engine.config import EngineConfig

logger = logging.getLogger(__name__)

PREFILL_REPLAY_ROWS = 256  # prompt rows one replay of the row step scores (engine.prefill_rows, capped)
JOIN_WAIT_STEPS_CUDA = 8  # engine.join_wait_steps on CUDA (see there)
WAVE_PREFILL_TOKENS_CPU = 2048  # engine.wave_prefill_tokens on CPU (see there)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
# mmap threshold: the first of these the C library takes (some glibc cap it at 32 MiB); a KV cache stays mapped
HEAP_MMAP_THRESHOLDS = (256 << 20, 32 << 20)
HEAP_TRIM_THRESHOLD = 512 << 20  # freed memory kept at the top of the heap before it goes back to the kernel


def join_wait_steps(config: EngineConfig, device: torch.device) -> int:
    """``engine.join_wait_steps`` resolved: as set, else 8 on CUDA (a short prefill costs about a step there) and 0
    elsewhere (a CPU prefill costs its tokens)."""
    if config.join_wait_steps is not None:
        return config.join_wait_steps
    return JOIN_WAIT_STEPS_CUDA if device.type == "cuda" else 0


def wave_prefill_tokens(config: EngineConfig, device: torch.device) -> int:
    """``engine.wave_prefill_tokens`` resolved: as set, else 2048 on CPU and 0 (off) on CUDA."""
    if config.wave_prefill_tokens is not None:
        return config.wave_prefill_tokens
    return 0 if device.type == "cuda" else WAVE_PREFILL_TOKENS_CPU


def prefix_caching(config: EngineConfig, device: torch.device) -> bool:
    """``engine.prefix_caching`` resolved: as set, else on for a CPU engine and off on CUDA (see there)."""
    return config.prefix_caching if config.prefix_caching is not None else device.type != "cuda"


def chunked_prefill(config: EngineConfig, device: torch.device) -> bool:
    """``engine.chunked_prefill`` resolved: as set, else on for a CPU engine and off on CUDA (see there)."""
    return config.chunked_prefill if config.chunked_prefill is not None else device.type != "cuda"


def use_rows(config: EngineConfig, target: LlamaModel, device: torch.device) -> bool:
    """Whether decode and verification run the fixed-shape row step (``engine.decode_path``)."""
    if config.decode_path == "varlen" or (config.decode_path == "auto" and device.type != "cuda"):
        return False
    why = (
        f"the target has q/k norms ({target.arch.model_type})"
        if target.arch.qk_norm
        else "the target is tensor-parallel"
        if target.tp.world != 1
        else None
    )
    if why is None:
        return True
    if config.decode_path == "rows":
        raise EaglerayError(f"engine.decode_path='rows' but {why}\n    fix: set engine.decode_path to 'auto' or 'varlen'")
    logger.info("engine: decode runs the eager varlen path (%s)", why)
    return False


def configure_heap(config: EngineConfig, device: torch.device) -> int | None:
    """``engine.cpu_heap`` on a CPU engine -> the mmap threshold set (bytes), or None where malloc is left as it is.

    A prefill's activations are tens of MB; glibc maps each from the kernel and unmaps it when freed (or trims the
    heap), so every step faults its temporaries in again: a 16-prompt SmolLM2 prefill spent 0.5 of 2.0 s in the
    kernel, and 2.5 s of 4.4 s once other engines held memory. With the thresholds raised freed memory is reused."""
    if device.type != "cpu" or config.cpu_heap == "default":
        return None
    mallopt = _mallopt()
    if mallopt is None:
        if config.cpu_heap == "retain":
            raise EaglerayError(
                "engine.cpu_heap='retain' but the C library has no mallopt (not glibc)\n"
                "    fix: set engine.cpu_heap to 'auto' or 'default'"
            )
        logger.info("engine.cpu_heap: the C library has no mallopt; malloc is left as it is")
        return None
    threshold = next((t for t in HEAP_MMAP_THRESHOLDS if mallopt(M_MMAP_THRESHOLD, t) == 1), None)
    if threshold is None or mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD) != 1:
        raise EaglerayError(
            f"engine.cpu_heap={config.cpu_heap!r}: mallopt refused the thresholds\n    fix: set engine.cpu_heap to 'default'"
        )
    return threshold


def _mallopt():
    """The C library's ``mallopt(int, int) -> int``, or None where it has none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def default_num_blocks(config: EngineConfig, target: LlamaModel, draft: Eagle3Draft | None, max_model_len: int) -> int:
    """Blocks that fit ``kv_cache_gib`` (target layers + the draft layer), capped at max_num_seqs full sequences."""
    attn = target.layers[0].self_attn
    per_token_layer = 2 * attn.kv_heads * attn.head_dim * torch.finfo(target.arch.dtype).bits // 8
    layers = target.arch.num_layers + (1 if draft is not None else 0)
    per_block = per_token_layer * layers * config.block_size
    fits = int(config.kv_cache_gib * (1 << 30)) // per_block
    full = config.max_num_seqs * ((max_model_len + config.block_size - 1) // config.block_size + 2)
    return max(1, min(fits, full))


class CpuThreads:
    """The CPU engine's threads during a step: with the native kernels, decode-sized work runs torch's small
    ops on one thread and the kernels on all of them (two pools spinning on two cores stall each other's
    barriers); prefill's large GEMMs, which MKL does best, get torch's threads back. Outside a step the
    process's settings are untouched."""

    def __init__(self, native: bool):
        self.native = native
        # an engine made inside another engine's step (a hot-swap smoke test) sees torch at one thread
        self.count = cpu_decode.threads() or torch.get_num_threads()

    @contextmanager
    def stepping(self):
        if not self.native:
            yield
            return
        before, kernels = torch.get_num_threads(), cpu_decode.threads()
        cpu_decode.set_threads(self.count)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)
            cpu_decode.set_threads(kernels)

    def for_rows(self, rows: int):
        """A forward of ``rows`` rows inside a step: past the native kernels' ``MAX_ROWS`` its GEMMs are MKL's, so they
        get torch's threads back as a prefill's do (a draft's catch-up over 16 joined prompts and a 32-sequence k=4
        verification ran them on one thread inside the step)."""
        return self.for_gemm() if rows > cpu_decode.MAX_ROWS else nullcontext()

    @contextmanager
    def for_gemm(self):
        """A prefill: MKL's GEMMs (whatever the prompt's length) on torch's threads."""
        if not self.native:
            yield
            return
        with cpu_decode.blas_gemms():
            if torch.get_num_threads() == self.count:
                yield
                return
            torch.set_num_threads(self.count)
            try:
                yield
            finally:
                torch.set_num_threads(1)
