"""The target's own steps, without a draft: prefill and plain decode (varlen, or rows through CUDA graphs), each
ending in one token per sequence sampled with that sequence's parameters."""

from __future__ import annotations

import torch

from eagleray.kernels import cpu_decode
from eagleray.platform.models.row_graphs import DecodeRows, StepStage
from eagleray.serve.engine.model_runner import ForwardBatch, TargetRunner
from eagleray.serve.engine.profile import StepProfiler
from eagleray.serve.engine.sampling import filter_logits, sample_rows
from eagleray.serve.engine.sequence import Sequence
from eagleray.serve.engine.spec_step import SeqResult
from eagleray.serve.engine.startup import CpuThreads


def sample(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """logits [B, V] -> one token per sequence with its own sampling parameters."""
    if all(s.params.greedy for s in seqs):
        return cpu_decode.argmax_last(logits).tolist()
    dev = logits.device
    top_k = torch.tensor([s.params.top_k for s in seqs], device=dev)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=dev)
    temp = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32, device=dev)
    return sample_rows(filter_logits(logits, top_k, top_p), temp, [s.generator for s in seqs]).tolist()


class TargetSteps:
    def __init__(
        self, target: TargetRunner, block_size: int, device: torch.device, prof: StepProfiler, threads: CpuThreads, use_rows: bool
    ):
        self.target, self.block_size, self.device = target, block_size, device
        self.prof, self.threads, self.use_rows = prof, threads, use_rows
        # rows: last token, its position, the block table (entries past a sequence's blocks are never read)
        self.stage = StepStage(target.rows.buckets[-1], 2 + target.rows.max_blocks, device) if use_rows else None

    def prefill(self, seqs: list[Sequence]) -> list[SeqResult]:
        with self.prof.phase("prepare"), self.threads.for_gemm():
            tokens = [s.tokens[s.num_cached :] for s in seqs]
            positions = [list(range(s.num_cached, s.num_tokens)) for s in seqs]
            batch = ForwardBatch.build(
                tokens, positions, [s.num_cached for s in seqs], [s.block_table for s in seqs], self.block_size, self.device
            )
        with self.prof.phase("target"), self.threads.for_gemm():
            logits, aux = self.target.forward(batch, batch.last_index)  # [B, V], [T, A]
        with self.prof.phase("sample"):
            return _results(seqs, logits, aux.split([len(t) for t in tokens]) if aux is not None else None)

    def decode(self, seqs: list[Sequence]) -> list[SeqResult]:
        """One new token per sequence: rows through the target's graphs (CUDA), else the varlen forward."""
        with self.prof.phase("prepare"):
            rows = self._rows(seqs) if self.use_rows else self._varlen(seqs)
        with self.prof.phase("target"):
            logits, aux = self.target.decode(rows) if self.use_rows else self.target.forward(rows)  # [B, V], [B, A]
        with self.prof.phase("sample"):
            return _results(seqs, logits, aux.split(1) if aux is not None else None)

    def _varlen(self, seqs: list[Sequence]) -> ForwardBatch:
        starts = [s.num_tokens - 1 for s in seqs]
        ids = torch.tensor([s.last_token for s in seqs], dtype=torch.int64, device=self.device)  # [B]
        pos = torch.tensor(starts, dtype=torch.int64, device=self.device)  # [B]
        return ForwardBatch.of(ids, pos, [1] * len(seqs), starts, [s.block_table for s in seqs], self.block_size)

    def _rows(self, seqs: list[Sequence]) -> DecodeRows:
        host = self.stage.host  # [Bmax, 2 + MB]
        for b, s in enumerate(seqs):
            host[b, :2] = (s.last_token, s.num_tokens - 1)
            host[b, 2 : 2 + len(s.block_table)] = s.block_table
        m = self.stage.upload(len(seqs))  # [B, 2 + MB]: one non-blocking host -> device copy
        return DecodeRows.of(m[:, 0], m[:, 1], m[:, 2:].to(torch.int32), self.block_size)


def _results(seqs: list[Sequence], logits: torch.Tensor, aux_parts) -> list[SeqResult]:
    """A token per sequence from logits [B, V], with that sequence's aux rows (None without a draft)."""
    parts = aux_parts if aux_parts is not None else [None] * len(seqs)
    return [SeqResult([t], a, 0, 0) for t, a in zip(sample(seqs, logits), parts)]
