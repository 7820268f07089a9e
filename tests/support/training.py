"""A small TrainingConfig for the training tests (synthetic shards, tiny targets)."""

from __future__ import annotations

from pathlib import Path

from eagleray.platform.config.schemas import TrainingConfig


def small_training_config(data_dir: str | Path, target: str | Path, out: str | Path, **fields) -> TrainingConfig:
    """Offline training on ``data_dir`` for ``target`` into ``out``: a 128-token draft vocabulary, 4 sequences a
    step, one local worker; ``fields`` (steps, logging, checkpoints, evaluation, backend) override."""
    base = dict(
        data_dir=str(data_dir),
        target={"model": str(target)},
        output_dir=str(out),
        draft_vocab_size=128,
        learning_rate=3e-3,
        batch_size=4,
        backend="local",
        seed=0,
    )
    return TrainingConfig(**{**base, **fields})
