"""The issue-16 shift benchmark's driver (jobs/bench/adapt_shift): what the adaptation loop is told to train."""

from eagleray.jobs.bench import adapt_shift as bench
from eagleray.platform.config.load import parse_config
from eagleray.platform.config.schemas import TrainingConfig


def _cfg(tmp_path, *argv: str):
    args = bench.parse(["--work", str(tmp_path), *argv])
    return bench.adapt_config(args, tmp_path / "traffic", tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}")


def _training(cfg, tmp_path) -> TrainingConfig:
    """The fine-tuning config the loop builds from cfg.train (as jobs/adapt.train_step does)."""
    fields = {**cfg.train, "data_dir": str(tmp_path / "data"), "output_dir": str(tmp_path / "out")}
    return parse_config(TrainingConfig, fields, source="test", prefix="train")


def test_replay_share_unrolled_steps_and_autocast_reach_the_fine_tuning(tmp_path):
    cfg = _cfg(
        tmp_path,
        "--replay", str(tmp_path / "replay"), "--replay-fraction", "0.5",
        "--ttt-steps", "3", "--autocast", "bf16", "--learning-rate", "2e-4", "--train-steps", "150",
    )  # fmt: skip
    t = _training(cfg, tmp_path)
    assert t.replay is not None and t.replay.data_dir == str(tmp_path / "replay") and t.replay.fraction == 0.5
    assert t.ttt_steps == 3 and t.autocast == "bf16"
    assert t.learning_rate == 2e-4 and t.max_steps == 150 and t.backend == "local"


def test_unrolled_steps_follow_the_served_chain_length_by_default_and_no_replay_without_data(tmp_path):
    t = _training(_cfg(tmp_path, "--k", "3", "--traffic", "40"), tmp_path)
    assert t.ttt_steps == 3 and t.replay is None and t.autocast == "auto"
    assert _cfg(tmp_path, "--traffic", "40").min_new_requests == 20
