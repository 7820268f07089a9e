"""Promotion: measure a candidate draft and the current champion with the engine, decide, record.

    plain     = engine without a draft on the held-out prompts         -> tokens/s
    champion  = engine with models:/<name>@<alias> (if the alias exists) -> τ, per-position acceptance, tokens/s
    candidate = engine with the candidate                               -> τ, per-position acceptance, tokens/s
    promote  iff  candidate τ >= champion τ * (1 + min_tau_gain)  and  candidate tokens/s >= plain * min_speedup

The decision and every number are written as tags on the candidate's model version; the alias
moves only on "promote". All three runs share one loaded target (same weights, same prompts, greedy).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagleray.platform.checkpoints.guard import check_compatibility
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.config.promotion import PromotionConfig
from eagleray.platform.config.schemas import DraftConfig, PolicyConfig
from eagleray.platform.errors import CompatibilityError, EaglerayError
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.prompts import load_prompts
from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams, load_models
from eagleray.serve.measure import timed_generate

logger = logging.getLogger(__name__)


@dataclass
class Measurement:
    label: str
    version: str | None
    tokens: int
    seconds: float
    tau: float | None = None  # mean acceptance length; None for plain decoding
    accept_rate_per_pos: list[float] = field(default_factory=list)  # P(draft position i accepted) per verification

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 3)}


@dataclass
class Decision:
    promote: bool
    reason: str
    speedup: float
    tau_gain: float | None  # candidate τ / champion τ - 1; None without a champion


def decide(candidate: Measurement, champion: Measurement | None, plain: Measurement, cfg: PromotionConfig) -> Decision:
    """Promote only when the candidate beats the champion by the margin and is faster than no speculation."""
    speedup = candidate.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s > 0 else 0.0
    gain = None
    reasons = []
    if champion is not None and champion.tau:
        gain = (candidate.tau or 0.0) / champion.tau - 1.0
        if gain < cfg.min_tau_gain:
            reasons.append(f"τ {candidate.tau:.3f} is not {cfg.min_tau_gain:.0%} above the champion's {champion.tau:.3f}")
    if speedup < cfg.min_speedup:
        reasons.append(
            f"{candidate.tokens_per_s:.1f} tok/s is {speedup:.2f}x plain decoding ({plain.tokens_per_s:.1f} tok/s); "
            f"needs >= {cfg.min_speedup:.2f}x"
        )
    if reasons:
        return Decision(False, "; ".join(reasons), speedup, gain)
    vs = f"champion τ {champion.tau:.3f}" if champion is not None and champion.tau else "no champion"
    return Decision(True, f"τ {candidate.tau:.3f} vs {vs}; {speedup:.2f}x plain decoding", speedup, gain)


def held_out_prompts(cfg: PromotionConfig) -> list[list[dict[str, str]]]:
    out = []
    for source in cfg.prompts:
        out += [[m.to_dict() for m in rec.messages] for rec in load_prompts(source, limit=cfg.limit)]
    if not out:
        raise EaglerayError(
            f"promotion: no prompts loaded from {cfg.prompts}\n    fix: name held-out sets such as mtbench, humaneval"
        )
    return out


class DraftTrial:
    """One loaded target that runs the held-out prompts plain or with a draft directory (one trial each)."""

    def __init__(self, cfg: PromotionConfig):
        self.cfg = cfg
        self.target, _, self.tokenizer, self.device = load_models(cfg.target, None)
        self.spec = TargetSpec.from_dir(Path(self.target_dir))
        self.prompts = held_out_prompts(cfg)
        self.params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens)

    @property
    def target_dir(self) -> str:
        from eagleray.platform.checkpoints.target import resolve_target

        return str(resolve_target(self.cfg.target.model, self.cfg.target.dtype))

    def _engine(self, draft_dir: Path | None) -> LLMEngine:
        base = dict(target=self.cfg.target, max_num_seqs=self.cfg.max_num_seqs)
        if draft_dir is None:
            return LLMEngine(self.target, self.tokenizer, EngineConfig(**base))
        report = check_compatibility(self.spec, draft_dir, max_model_len=self.cfg.target.max_model_len)
        if not report.ok:
            raise CompatibilityError(report.problems, target=str(self.spec.path), draft=str(draft_dir))
        self.target.set_aux_layers(report.facts["aux_layer_ids"])
        draft = Eagle3Draft.from_checkpoint(draft_dir, self.target, dtype=self.target.arch.dtype, device=self.device)
        dcfg = DraftConfig(
            source=str(draft_dir),
            num_speculative_tokens=self.cfg.num_speculative_tokens,
            policy=PolicyConfig(adaptive=False, watchdog_window=1 << 20),
        )
        return LLMEngine(self.target, self.tokenizer, EngineConfig(**base, draft=dcfg), draft)

    def measure(self, label: str, draft_dir: Path | None, version: str | None, prompts: list | None = None) -> Measurement:
        """``prompts``: messages or token ids to run instead of the configured held-out sets."""
        engine = self._engine(draft_dir)
        outs, seconds = timed_generate(engine, self.prompts if prompts is None else prompts, self.params)
        m = Measurement(label, version, sum(len(o.token_ids) for o in outs), seconds)
        if draft_dir is not None:
            spec = engine.metrics.spec
            m.tau = round(spec.mean_acceptance_length, 4)
            m.accept_rate_per_pos = [round(n / spec.num_drafts, 4) if spec.num_drafts else 0.0 for n in spec.accepted_per_pos]
        logger.info("measured %s: %s", label, m.to_dict())
        return m
