"""What an engine decides once at start: the decode path, the KV cache size, the CPU threads of a step."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from eagleray.kernels import cpu_decode
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.llama import LlamaModel
from eagleray.serve.engine.config import EngineConfig

logger = logging.getLogger(__name__)

PREFILL_REPLAY_ROWS = 256  # prompt rows one replay of the row step scores (engine.prefill_rows, capped)


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
