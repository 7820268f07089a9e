"""Continual training: start from a draft, fine-tune on captured traffic mixed with replayed original data,
tracked in MLflow (sqlite) with the traffic window it used."""

from __future__ import annotations

import random
from collections import Counter

import pyarrow.parquet as pq
import pytest
import torch

from eagleray.platform import capture_store
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.config.schemas import TrainingConfig
from eagleray.platform.errors import ConfigError
from eagleray.tests.support.training import small_training_config
from eagleray.training import data


@pytest.fixture(scope="module")
def traffic(train_target, tmp_path_factory):
    """Synthetic rows (another seed) written the way the serving capture writes them, then snapshotted."""
    from eagleray.tests.support.synth import write_synthetic

    root = tmp_path_factory.mktemp("traffic")
    src = write_synthetic(train_target, root / "gen", rows=16, seed=1)
    spec = TargetSpec.from_dir(train_target)
    meta = {
        "target_fingerprint": spec.fingerprint,
        "tokenizer_fingerprint": spec.tokenizer_fingerprint,
        "hidden_size": spec.hidden_size,
        "aux_layer_ids": sorted(spec.default_aux_layer_ids),
    }
    for i, f in enumerate(data.shard_files(src)):
        rows = pq.read_table(f).to_pylist()
        capture_store.write_shard(root / "capture", rows, {**meta, "first_ms": 1000 * i + 1, "last_ms": 1000 * (i + 1)})
    capture_store.snapshot(capture_store.list_shards(root / "capture"), root / "snap", spec.vocab_size)
    return root / "snap"


def _cfg(data_dir, target, out, **kw) -> TrainingConfig:
    steps = dict(warmup_steps=1, max_steps=4, log_every=2, checkpoint_every=4, eval_fraction=0.25, eval_batches=1, ttt_steps=2)
    return small_training_config(data_dir, target, out, **{**steps, **kw})


def test_replay_mixes_the_configured_share_of_rows(traffic, synthetic_data):
    kw = dict(rank=0, world=1, seed=0, eval_fraction=0.0)
    rows = data.mix(
        data.endless_rows(data.shard_files(traffic), **kw),
        data.endless_rows(data.shard_files(synthetic_data), **kw),
        0.3,
        random.Random(0),
    )
    got = Counter(next(rows)["prompt_id"].split("-")[0] for _ in range(2000))
    assert got["p0"] / 2000 == pytest.approx(0.3, abs=0.04) and got["p1"] > 0  # p0-: replay, p1-: traffic


def test_continual_run_starts_from_the_champion_and_records_its_window(traffic, synthetic_data, train_target, tmp_path):
    import mlflow

    from eagleray.platform.checkpoints.draft_factory import make_random_draft
    from eagleray.training.trainer import train

    torch.set_num_threads(1)
    spec = TargetSpec.from_dir(train_target)
    champion = make_random_draft(spec, tmp_path / "champion", aux_layer_ids=sorted(spec.default_aux_layer_ids), seed=5)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = _cfg(
        traffic,
        train_target,
        tmp_path / "out",
        init_from=str(champion),
        replay={"data_dir": str(synthetic_data), "fraction": 0.5},
        run_tags={"adapt.decision": "d1"},
        mlflow={"tracking_uri": uri, "experiment": "continual", "registered_model": "cont"},
    )
    result = train(cfg, emit=lambda s: None)
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(result.run_id)
    p = run.data.params
    assert p["init_from"] == str(champion) and p["replay.fraction"] == "0.5" and p["replay_shards"] == "3"
    assert (p["traffic_window_first_ms"], p["traffic_window_last_ms"], p["traffic_rows"]) == ("1", "2000", "16")
    assert run.data.tags["adapt.decision"] == "d1"
    from safetensors.torch import load_file

    start, end = load_file(str(champion / "model.safetensors")), load_file(str(result.draft_dir / "model.safetensors"))
    assert start.keys() == end.keys() and start["lm_head.weight"].shape == end["lm_head.weight"].shape  # its vocabulary
    assert not torch.equal(start["fc.weight"], end["fc.weight"])  # and its weights were trained


def test_replay_of_other_aux_layers_is_refused(traffic, train_target, tmp_path):
    from eagleray.tests.support.synth import write_synthetic
    from eagleray.training.plan import make_plan

    other = write_synthetic(train_target, tmp_path / "other", rows=8, seed=2)
    m = data.read_manifest(other)
    m["aux_layer_ids"] = [0, 1]
    (other / "manifest.json").write_text(__import__("json").dumps(m))
    with pytest.raises(ConfigError, match=r"training\.replay\.data_dir: holds aux layers \[0, 1\]"):
        make_plan(_cfg(traffic, train_target, tmp_path, replay={"data_dir": str(other)}))


def test_replay_needs_offline_data(train_target, tmp_path):
    with pytest.raises(ValueError, match="replay mixes offline shards"):
        _cfg("online", train_target, tmp_path, online={"prompts": ["sharegpt"]}, replay={"data_dir": "x"})
