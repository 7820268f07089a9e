"""Engine configuration (pydantic, extra=forbid, every field described)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eagleray.platform.config.load import StrictModel
from eagleray.platform.config.schemas import DraftConfig, TargetConfig


class EngineConfig(StrictModel):
    target: TargetConfig = Field(default_factory=TargetConfig, description="The target model (directory or 'smollm2').")
    draft: DraftConfig | None = Field(None, description="The EAGLE-3 draft; None serves plain decoding.")
    max_num_seqs: int = Field(16, ge=1, description="Maximum sequences in one engine step (continuous batching).")
    max_num_batched_tokens: int = Field(
        8192,
        ge=16,
        description="Token budget of one prefill step (a prompt that does not fit prefills in chunks with engine.chunked_prefill, else whole: one longer than the budget alone). On a 2-core CPU with chunked prefill (vLLM serve under its own load generator, BENCHMARKS.md 2026-12-07): 8192 is ahead of vLLM on every median at 4 clients x 512-token prompts and 8 x 128; at 8 x 512 it is behind on TTFT (waves of prompts prefill together) and 2048 behind on TPOT (prefills overlap every decode), so the default stays 8192.",
    )
    chunked_prefill: bool | None = Field(
        None,
        description="Split a prompt that does not fit the step's token budget (max_num_batched_tokens, less the prompts admitted before it): its first tokens fill the step, the rest continue in later steps, and between two of its chunks the running sequences take a decode step, so a long prompt never stalls them for more than one budget's prefill. Off: a step admits whole prompts only (one longer than the budget prefills alone). None: on on CPU; off on CUDA, where a prompt's chunk boundaries would depend on the prompts beside it and greedy speculation's bitwise equality with plain decoding (bf16) depends on a sequence's prefill path alone.",
    )
    wave_prefill_tokens: int | None = Field(
        None,
        ge=0,
        description="When the prompts waiting for the free slots hold more than this many tokens to prefill together, they prefill one prompt a step (each answers as soon as its own prompt is in; no decode rows beside them) until every prompt of that wave has joined, and the running sequences then take a decode step; at or under it they prefill together, within max_num_batched_tokens. On a CPU a prompt's prefill costs its tokens alone or batched, so batching a large wave only delays the first answers: on the 2-core CPU under vLLM's load generator with 8 clients and 512-token prompts the median TTFT went from 8.0 to 4.7 s for a TPOT of 118 against 62 ms (vLLM serve: 5.1-5.4 s, 129-130 ms; BENCHMARKS.md 2026-12-08), while 4 clients' waves keep one step and their TPOT (the first prompt of a wave prefills as it comes; the 3 that follow it hold 1,620 tokens, 7 hold 3,780). 0: off. None: 2048 on CPU; off on CUDA, where a short prefill costs about a step whatever its size.",
    )
    join_wait_steps: int | None = Field(
        None,
        ge=0,
        description="At saturation (more requests waiting than free slots), free slots wait up to this many decode steps for max(1, max_num_seqs // 8) of them, so that finished sequences' replacements prefill in one step, not one step each (speculation finishes sequences at different steps). None: 8 on CUDA, where a short prefill's cost is mostly per step; 0 on CPU, where it is per token. 0: admit at once.",
    )
    block_size: int = Field(16, ge=1, description="Tokens per paged KV block.")
    prefix_caching: bool | None = Field(
        None,
        description="Reuse the target's KV blocks of earlier requests whose tokens begin as this one's do (a chat template's system prompt, a conversation's earlier turns; whole blocks, hashed with every token before them): the prompt prefills from the first block not cached. With a draft, a block is reused once the draft has caught up past it and where the token after it matches too (the draft's K/V at a position pair it with the next token); a request that captures hidden states (serving capture) reuses a block only where an earlier captured request left the block's hidden states beside it (kept while the block is cached: A + H values a position, about a fifth of SmolLM2's fp32 K/V); installing a draft empties the cache. None: on on CPU; off on CUDA, where greedy speculation's bitwise equality with plain decoding is not yet checked against cached blocks.",
    )
    num_kv_blocks: int | None = Field(
        None,
        ge=1,
        description="KV blocks (shared by target and draft); default: as many as kv_cache_gib holds, at most enough for max_num_seqs full-length sequences.",
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="Memory for the target + draft KV caches when num_kv_blocks is unset.")
    verify_backend: Literal["auto", "kernel", "reference"] = Field(
        "auto", description="Verification implementation: Triton kernel on CUDA and PyTorch reference on CPU ('auto'), or forced."
    )
    seed: int = Field(0, description="Seed of the engine generator that seeds requests without their own seed.")
    plain_probe_interval: int = Field(
        32,
        ge=2,
        description="Adaptive policy: while speculation does not pay, probe it after this many plain steps (the interval doubles after each probe that does not pay, up to 1024).",
    )
    cpu_kernels: Literal["auto", "native", "torch"] = Field(
        "auto",
        description="CPU fp32 linear layers and paged attention of decode/verify/draft steps: the native kernels (kernels/cpu_decode.c, AVX-512 or AVX2) where it builds ('auto'), forced ('native'), or PyTorch/MKL ('torch').",
    )
    cpu_heap: Literal["auto", "retain", "default"] = Field(
        "auto",
        description="CPU: glibc malloc keeps freed memory for reuse ('retain': mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD raised, process-wide) instead of handing each large step temporary back to the kernel and faulting it in again (a 16-prompt prefill spent a quarter of its time in page faults); 'auto': retain where the C library has mallopt, 'default': leave malloc as it is.",
    )
    decode_path: Literal["auto", "rows", "varlen"] = Field(
        "auto",
        description="How plain decode and chain verification run the target. 'rows': the batch-invariant fused step over fixed-shape row buffers, replayed from CUDA graphs on CUDA (lossless greedy speculation in bf16; on CPU the same step runs eagerly); 'varlen': the eager varlen forward; 'auto': rows on CUDA for one-rank targets without q/k norms, varlen elsewhere.",
    )
    prefill_rows: int = Field(
        1024,
        ge=0,
        description="With decode_path rows: a prefill step of at most this many prompt tokens runs as rows through the row step's CUDA graphs (replays of up to 256 rows; a short prompt costs about a decode step instead of the eager forward's ~1,700 launches); a longer one runs the eager varlen forward, whose large GEMMs amortize its launches. 0: every prefill eager.",
    )
    profile_steps: bool = Field(
        False, description="Time every phase of every step (bench spec turns it on; on CUDA it adds a sync per phase)."
    )
