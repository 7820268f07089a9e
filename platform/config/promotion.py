"""Config schemas of the jobs that decide which draft serves: promotion (``eagleray promote``) and the
adaptation loop (``eagleray adapt``). Shared pieces (target, MLflow, training) are in
:mod:`eagleray.platform.config.schemas`; the same rules hold (unknown fields forbidden, every field described).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from eagleray.platform.config.load import StrictModel
from eagleray.platform.config.schemas import MlflowConfig, TargetConfig, TrainingConfig


class PromotionConfig(StrictModel):
    candidate: str = Field(description="Candidate draft: 'models:/<name>/<version>' or a directory.")
    alias: str = Field("champion", description="Alias set on the candidate when it wins.")
    target: TargetConfig = Field(default_factory=TargetConfig, description="Target used for the measurement.")
    prompts: list[str] = Field(default_factory=lambda: ["mtbench", "humaneval"], description="Held-out prompt sets.")
    limit: int = Field(16, ge=1, description="Prompts per set.")
    max_tokens: int = Field(64, ge=1, description="Tokens generated per prompt.")
    min_tau_gain: float = Field(0.05, ge=0.0, description="Candidate τ must beat the champion's by this fraction.")
    min_speedup: float = Field(1.0, gt=0.0, description="Candidate must be at least this much faster than plain decoding.")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Chain length k used to measure both drafts.")
    max_num_seqs: int = Field(
        1, ge=1, description="Requests batched while measuring (1 = latency-bound tokens/s, like the motivating story)."
    )
    dry_run: bool = Field(False, description="Measure and print the decision, but neither set the alias nor write tags.")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="Registry holding the versions and alias.")


class AdaptConfig(StrictModel):
    """The adaptation loop (``python -m eagleray.jobs.adapt``): captured traffic -> fine-tune the champion -> gate -> alias."""

    capture_path: str = Field(description="The serving deployment's capture.path (its shards and adapt/last.json).")
    work_dir: str = Field(
        description="Where each decision's snapshot, training output and report go (<work_dir>/<decision id>/)."
    )
    target: TargetConfig = Field(default_factory=TargetConfig, description="The served target.")
    alias: str = Field(
        "champion", description="Alias the Serve app follows (draft.source models:/<name>@<alias>); moved on a pass."
    )
    min_new_requests: int = Field(
        200, ge=1, description="Train only when at least this many requests were captured after the last adaptation's window."
    )
    held_out_fraction: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="Captured requests held out by a hash of their request id: never trained on, they are the gate's shifted-domain prompts.",
    )
    max_held_out: int = Field(64, ge=1, description="At most this many held-out captured prompts are measured by the gate.")
    control: list[str] = Field(
        default_factory=lambda: ["mtbench"], description="The fixed control set(s) the candidate must not regress on."
    )
    control_limit: int = Field(16, ge=1, description="Prompts per control set.")
    max_tokens: int = Field(64, ge=1, description="Tokens generated per gate prompt (greedy).")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Chain length k of the gate's measurements.")
    min_tau_gain: float = Field(
        0.05, ge=0.0, description="Candidate τ on held-out traffic must beat the champion's by this fraction."
    )
    max_control_regression: float = Field(
        0.02, ge=0.0, description="Candidate τ on the control set may be at most this fraction below the champion's."
    )
    min_speedup: float | None = Field(
        None,
        gt=0.0,
        description="Also require candidate tokens/s on held-out traffic >= plain decoding x this (plain is measured only when set).",
    )
    train: dict[str, Any] = Field(
        default_factory=dict,
        description="TrainingConfig fields of the fine-tuning run (max_steps, learning_rate, batch_size, replay, backend, ...); data_dir, init_from, output_dir, target, eval_fraction and mlflow are set by the loop.",
    )
    every_s: float | None = Field(
        None, gt=0.0, description="Run a pass this often, forever (a long-running `ray job submit` job); null: one pass."
    )
    mlflow: MlflowConfig = Field(
        default_factory=lambda: MlflowConfig(experiment="eagleray-adapt"),
        description="Tracking (every decision is a run of mlflow.experiment) and the registry holding the alias.",
    )

    @model_validator(mode="after")
    def _train_fields(self) -> "AdaptConfig":
        """The fine-tuning fields are checked now, not after a pass has snapshotted and trained."""
        owned = sorted(set(self.train) & set(ADAPT_OWNED_TRAIN_FIELDS))
        if owned:
            raise ValueError(
                f"train.{owned[0]} is set by the loop; remove it (the loop sets {', '.join(ADAPT_OWNED_TRAIN_FIELDS)})"
            )
        try:
            TrainingConfig.model_validate({**self.train, "data_dir": "-", "output_dir": "-"})
        except ValidationError as err:
            e = err.errors()[0]
            raise ValueError(f"train.{'.'.join(str(x) for x in e['loc'])}: {e['msg']}") from None
        return self


ADAPT_OWNED_TRAIN_FIELDS = ("data_dir", "init_from", "output_dir", "target", "eval_fraction", "mlflow", "alias", "register_model")
