"""The target's own steps, without a draft: prefill and plain decode (varlen, or rows through CUDA graphs), each
ending in one token per sequence sampled with that sequence's parameters."""

from __future__ import annotations

import itertools

import torch

from eagleray.kernels import cpu_decode
from eagleray.platform.models.row_graphs import DecodeRows, StepStage
from eagleray.serve.engine.config import EngineConfig
from eagleray.serve.engine.model_runner import ForwardBatch, TargetRunner, block_table_tensor
from eagleray.serve.engine.profile import StepProfiler
from eagleray.serve.engine.sampling import filter_logits, sample_rows
from eagleray.serve.engine.sequence import AuxRows, Sequence, queue_step_rows
from eagleray.serve.engine.spec_context import SeqResult
from eagleray.serve.engine.startup import CpuThreads


def sample(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """logits [B, V] -> one token per sequence with its own sampling parameters."""
    if all(s.params.greedy for s in seqs):
        return cpu_decode.argmax_last(logits).tolist()
    dev = logits.device
    top_k = torch.tensor([s.params.top_k for s in seqs], device=dev)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=dev)
    temps = [s.params.temperature for s in seqs]
    return sample_rows(filter_logits(logits, top_k, top_p), temps, [s.generator for s in seqs]).tolist()


class TargetSteps:
    def __init__(
        self,
        target: TargetRunner,
        block_size: int,
        device: torch.device,
        prof: StepProfiler,
        threads: CpuThreads,
        use_rows: bool,
        config: EngineConfig,
    ):
        self.target, self.block_size, self.device = target, block_size, device
        self.prof, self.threads, self.use_rows = prof, threads, use_rows
        self.prefill_rows = config.prefill_rows if use_rows else 0
        # rows: last token, its position, the block table (entries past a sequence's blocks are never read)
        self.stage = (
            StepStage(target.rows.bucket_for(config.max_num_seqs), 2 + target.rows.max_blocks, device) if use_rows else None
        )
        self.measured = True  # False when the last plain step also captured a graph (its time is not the step's cost)

    def capture(self) -> None:
        """Capture the plain step's graph for every bucket of up to max_num_seqs rows now (CUDA; a no-op elsewhere),
        on rows at the pad block: a capture inside a step would cost that step, and the adaptive policy's t_plain,
        a capture's time."""
        runner = self.target.rows
        if runner is None or not runner.use_graphs:
            return
        top = self.stage.host.shape[0]
        self.stage.host[:, :2] = 0
        self.stage.host[:, 2:] = runner.pad_block
        self.stage.upload(top)
        for bucket in reversed([b for b in runner.buckets if b <= top]):
            runner.run_staged(self.stage.dev, bucket)
        torch.cuda.synchronize()  # the staging copy is done before a step writes the pinned rows again

    def prefill(self, seqs: list[Sequence], chunk: int = 0) -> list[SeqResult]:
        """Score every uncached prompt token, a token per sequence from its last one; ``chunk`` > 0: the last sequence
        scores only its next ``chunk`` prompt tokens and gets no token (a partial prompt: its result holds its aux
        rows alone). A sequence with at most
        ``engine.prefill_rows`` of them runs as rows of the row step (all such sequences of the step together: a
        row's result does not depend on the rows beside it); a longer one runs the eager varlen forward by itself
        (its forward has the same shapes whatever it was scheduled with). So the path, and the bits of the KV cache
        and of the first token, depend on the sequence alone: a speculative engine's sequences join one by one
        where a plain engine prefills eight or 32 at once, and a path chosen by the step's total made their
        outputs differ (bf16, H200). Without the row step (``prefill_rows`` 0: the varlen engine, whose decode is not
        batch-invariant either) the step's sequences run one eager forward together."""
        ends = {id(s): s.num_tokens for s in seqs}  # each sequence's positions to score end here
        if chunk:
            ends[id(seqs[-1])] = seqs[-1].num_cached + chunk
        if not self.prefill_rows:
            return self._prefill_eager(seqs, ends, chunk)
        short = [s for s in seqs if ends[id(s)] - s.num_cached <= self.prefill_rows]
        part = chunk if short and short[-1] is seqs[-1] else 0
        done = dict(zip(map(id, short), self._prefill_rows(short, ends, part))) if short else {}
        for s in seqs:  # the longer ones eagerly, each by itself
            if id(s) not in done:
                done[id(s)] = self._prefill_eager([s], ends, chunk if s is seqs[-1] else 0)[0]
        return [done[id(s)] for s in seqs]

    def _prefill_eager(self, seqs: list[Sequence], ends: dict[int, int], chunk: int) -> list[SeqResult]:
        """The eager varlen forward over the sequences' uncached tokens up to their ``ends``."""
        with self.prof.phase("prepare"), self.threads.for_gemm():
            tokens = [s.tokens[s.num_cached : ends[id(s)]] for s in seqs]
            positions = [list(range(s.num_cached, ends[id(s)])) for s in seqs]
            batch = ForwardBatch.build(
                tokens, positions, [s.num_cached for s in seqs], [s.block_table for s in seqs], self.block_size, self.device
            )
        with self.prof.phase("target"), self.threads.for_gemm():
            logits, aux = self.target.forward(batch, batch.last_index)  # [B, V], [T, A]
        with self.prof.phase("sample"):
            return _results(seqs, logits, aux, [len(t) for t in tokens], chunk)

    def _prefill_rows(self, seqs: list[Sequence], ends: dict[int, int], chunk: int) -> list[SeqResult]:
        """The prompt tokens as rows (each attends to its sequence's positions up to its own, K/V written by the
        rows before it in the same replay or by earlier replays), replays of the row step's largest bucket."""
        with self.prof.phase("prepare"):
            sizes = [ends[id(s)] - s.num_cached for s in seqs]
            ids = torch.tensor([t for s in seqs for t in s.tokens[s.num_cached : ends[id(s)]]], dtype=torch.int64)  # [R]
            pos = torch.cat([torch.arange(s.num_cached, ends[id(s)]) for s in seqs])  # [R]
            row_seq = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(sizes))  # [R]
            tables = block_table_tensor([s.block_table for s in seqs], self.device)  # [B, MB]
            rows = DecodeRows.of(ids.to(self.device), pos.to(self.device), tables, self.block_size, row_seq.to(self.device))
            last = list(itertools.accumulate(sizes, initial=-1))[1:]  # each sequence's last row
        with self.prof.phase("target"):
            logits, aux = self.target.prefill_rows(rows, last)  # [B, V], [R, A] | None
        with self.prof.phase("sample"):
            return _results(seqs, logits, aux, sizes, chunk)

    def decode(self, seqs: list[Sequence], for_draft: bool) -> list[SeqResult]:
        """One new token per sequence: rows through the target's graphs (CUDA), else the varlen forward.
        ``for_draft``: a draft is installed; each sequence's aux row is queued for it here (results carry none)."""
        self.measured = True
        tokens, aux = self._decode_rows(seqs) if self.use_rows else self._decode_varlen(seqs)  # [B], [B, A] | None
        if for_draft and aux is not None:
            queue_step_rows(seqs, aux)
        return [SeqResult([t], None, 0, 0) for t in tokens]

    def _decode_varlen(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
        with self.prof.phase("prepare"):
            batch = self._varlen(seqs)
        with self.prof.phase("target"):
            logits, aux = self.target.forward(batch)  # [B, V], [B, A]
        with self.prof.phase("sample"):
            return sample(seqs, logits), aux

    def _decode_rows(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
        """Rows staged by one copy, scored by one graph replay that also takes the greedy tokens; one read-back."""
        n, captures = len(seqs), self.target.rows.captures
        with self.prof.phase("prepare"):
            bucket = self._stage_rows(seqs)
        with self.prof.phase("target"):
            logits, greedy, aux = self.target.decode_staged(self.stage.dev, bucket, n)  # [n, V], [n], [n, A] | None
        self.measured = self.target.rows.captures == captures  # a new aux layer set captures again
        with self.prof.phase("sample"):
            return (greedy.tolist() if all(s.params.greedy for s in seqs) else sample(seqs, logits.float())), aux

    def _varlen(self, seqs: list[Sequence]) -> ForwardBatch:
        starts = [s.num_tokens - 1 for s in seqs]
        ids = torch.tensor([s.last_token for s in seqs], dtype=torch.int64, device=self.device)  # [B]
        pos = torch.tensor(starts, dtype=torch.int64, device=self.device)  # [B]
        return ForwardBatch.of(ids, pos, [1] * len(seqs), starts, [s.block_table for s in seqs], self.block_size)

    def _stage_rows(self, seqs: list[Sequence]) -> int:
        """Write each sequence's last token, its position and its block table into the pinned rows, pad them to the
        bucket with rows at the pad block's first slot, queue one non-blocking copy -> the bucket."""
        host, n = self.stage.host, len(seqs)  # [Bmax, 2 + MB]
        for b, s in enumerate(seqs):
            host[b, :2] = (s.last_token, s.num_tokens - 1)
            host[b, 2 : 2 + len(s.block_table)] = s.block_table
        bucket = self.target.rows.bucket_for(n)
        host[n:bucket, :2] = 0
        host[n:bucket, 2:] = self.target.rows.pad_block
        self.stage.upload(bucket)
        return bucket


def _results(
    seqs: list[Sequence], logits: torch.Tensor, aux: torch.Tensor | None, sizes: list[int], chunk: int = 0
) -> list[SeqResult]:
    """A token per sequence from logits [B, V], with that sequence's rows of ``aux`` [sum(sizes), A] (None without
    a draft); ``chunk`` > 0: the last sequence is a partial prompt, its logits unused and no token drawn (its sampling
    generator untouched)."""
    parts = [None] * len(seqs) if aux is None else AuxRows.split(aux, sizes)
    done = len(seqs) - 1 if chunk else len(seqs)
    tokens = [[t] for t in sample(seqs[:done], logits[:done])] if done else []
    return [SeqResult(t, a, 0, 0) for t, a in zip(tokens + [[]] * (len(seqs) - done), parts)]
