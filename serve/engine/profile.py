"""Where an engine step's time goes: wall time per phase, by step kind and batch size.

    prof = StepProfiler(device)            # the engine owns one; bench spec reads it
    with prof.phase("target"):             # inside a step
        logits, aux = runner.forward(batch)
    prof.end_step("plain", batch_size)     # after the step
    prof.table()                           # {kind: {batch: {phase: ms per step, ...}}}

Phases: ``schedule``, ``prepare`` (batch tensors from sequences), ``target`` (target forward +
logits), ``draft`` (draft forwards + draft logits), ``draft_sample`` (picking draft tokens),
``verify`` (filtering + the verification kernel), ``sample`` (plain sampling), ``commit``
(accepted tokens, KV and aux bookkeeping) and ``output`` (detokenizing, outputs, callbacks).
``target``, ``draft`` and ``verify`` are the compute; everything else is host overhead.
On CUDA a phase synchronises the device at its end when profiling is on (off by default), so
the numbers are real but the step is slower; on CPU the cost is two clock reads per phase.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PHASES = ("schedule", "prepare", "target", "draft", "draft_sample", "verify", "sample", "commit", "output")
COMPUTE = ("target", "draft", "verify")


class StepProfiler:
    def __init__(self, device: torch.device, enabled: bool = False):
        self.device = device
        self.enabled = enabled
        self._current: dict[str, float] = defaultdict(float)
        # (kind, batch) -> [steps, {phase: seconds}]
        self._totals: dict[tuple[str, int], list] = {}

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._current[name] += time.perf_counter() - t0

    def end_step(self, kind: str, batch: int) -> None:
        if not self.enabled:
            return
        entry = self._totals.setdefault((kind, batch), [0, defaultdict(float)])
        entry[0] += 1
        for name, seconds in self._current.items():
            entry[1][name] += seconds
        self._current.clear()

    def reset(self) -> None:
        self._current.clear()
        self._totals.clear()

    def table(self) -> dict:
        """{kind: {batch: {"steps", "step_ms", "<phase>_ms"..., "host_fraction"}}} averaged per step."""
        out: dict = {}
        for (kind, batch), (steps, phases) in sorted(self._totals.items()):
            row = {f"{p}_ms": round(phases[p] / steps * 1e3, 3) for p in PHASES if p in phases}
            total = sum(phases.values())
            compute = sum(phases.get(p, 0.0) for p in COMPUTE)
            row.update(
                steps=steps,
                step_ms=round(total / steps * 1e3, 3),
                host_fraction=round(1 - compute / total, 4) if total > 0 else 0.0,
            )
            out.setdefault(kind, {})[batch] = row
        return out
