"""The compatibility guard: every reason a draft cannot serve a target, reported at once.

The checks are in :mod:`~eagleray.platform.checkpoints.guard_config` (the draft's config) and
:mod:`~eagleray.platform.checkpoints.guard_tensors` (its weights); this module runs them all.

The speculative algorithm is derived from the draft checkpoint; a configured algorithm that
disagrees (EAGLE vs EAGLE3, either way) is refused, because with the wrong one the target never
captures the hidden states the draft needs and acceptance silently stays at 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from eagleray.platform.checkpoints import guard_config as config
from eagleray.platform.checkpoints import guard_tensors as tensors
from eagleray.platform.checkpoints.draft import DraftCheckpoint
from eagleray.platform.checkpoints.guard_config import GuardContext
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import CompatibilityError, EaglerayError, Problem

# every check, in report order: config (guard_config) and weights (guard_tensors)
CHECKS: tuple[Callable[[GuardContext], list[Problem]], ...] = (
    config.check_algorithm,
    config.check_aux,
    tensors.check_fc,
    config.check_dims,
    tensors.check_attention_shapes,
    config.check_rope_positions,
    tensors.check_tensors,
    tensors.check_vocab,
    config.check_fingerprints,
)


@dataclass
class GuardReport:
    """Outcome of a guard run: problems (empty when compatible) and facts for the summary."""

    problems: list[Problem] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self, target: str = "", draft: str = "") -> None:
        if self.problems:
            raise CompatibilityError(self.problems, target=target, draft=draft)


def check_compatibility(
    target: TargetSpec, draft_dir: str | Path, *, algorithm: str | None = None, max_model_len: int | None = None
) -> GuardReport:
    """Run every check of the compatibility guard (docs/architecture.md); never raises for a user error, returns the problems."""
    report = GuardReport()
    try:
        draft = DraftCheckpoint.open(draft_dir)
    except EaglerayError as err:
        report.problems.append(
            Problem(
                "draft.files",
                str(err).split("\n    fix: ")[0],
                _fix_of(err, "point --draft at a complete draft checkpoint directory"),
            )
        )
        return report
    ctx = GuardContext(target, draft, algorithm, max_model_len or target.max_positions)
    for check in CHECKS:
        report.problems.extend(check(ctx))
    report.facts = ctx.facts()
    return report


def ensure_compatible(target: TargetSpec, draft_dir: str | Path, **kw: Any) -> GuardReport:
    """Like :func:`check_compatibility` but raises :class:`CompatibilityError` on any problem."""
    report = check_compatibility(target, draft_dir, **kw)
    report.raise_if_failed(target=str(target.path), draft=str(draft_dir))
    return report


def _fix_of(err: Exception, default: str) -> str:
    text = str(err)
    return text.split("\n    fix: ", 1)[1] if "\n    fix: " in text else default


def assert_aux_shape(aux: torch.Tensor, num_aux: int, hidden_size: int) -> None:
    """Run-time check of the first speculative step: aux states must be [T, num_aux * H]."""
    if aux is None or aux.dim() != 2 or aux.shape[-1] != num_aux * hidden_size:
        got = None if aux is None else list(aux.shape)
        raise CompatibilityError(
            [
                Problem(
                    "engine.aux_hidden_states",
                    f"captured aux states have shape {got}, the draft needs "
                    f"[T, {num_aux} x {hidden_size} = {num_aux * hidden_size}]",
                    "capture the draft's eagle_aux_hidden_state_layer_ids in the target (algorithm eagle3)",
                )
            ]
        )
