"""jobs/bench/scaling: drafts of different data sizes against one plain baseline (table, JSON, PNG, MLflow run)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _draft(target_dir, out, seed, loss_tokens=None):
    from eagleray.platform.checkpoints.draft_factory import make_random_draft
    from eagleray.platform.checkpoints.target import TargetSpec

    path = make_random_draft(TargetSpec.from_dir(target_dir), out, seed=seed)
    if loss_tokens is not None:  # what `eagleray train` records (training/plan.py)
        cfg = json.loads((path / "config.json").read_text())
        cfg["eagleray"]["notes"].update(
            data_shards=1, data_rows=loss_tokens // 10, data_loss_tokens=loss_tokens, step=5, **{"eval/sim_tau": 1.0}
        )
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_two_drafts_one_baseline_table_json_png_and_mlflow(tmp_path, monkeypatch, capsys):
    import mlflow

    from eagleray.jobs.bench import main
    from eagleray.tests.support.tiny import make_tiny_llama

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    target = make_tiny_llama(tmp_path / "target", num_layers=4, max_positions=4096)
    big, small = _draft(target, tmp_path / "big", 1, 2000), _draft(target, tmp_path / "small", 2, 1000)
    out, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    assert (
        main(
            [
                "scaling",
                "--drafts",
                f"{big},{small}",
                "--target",
                str(target),
                "--device",
                "cpu",
                "--limit",
                "2",
                "--max-tokens",
                "8",
                "--batch",
                "2",
                "--json",
                str(out),
                "--plot",
                str(png),
                "--mlflow-experiment",
                "scaling-test",
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert [d["data_loss_tokens"] for d in r["drafts"]] == [1000, 2000]  # sorted by data size
    assert r["lossless"] is True and all(d["tau"] >= 1.0 for d in r["drafts"])
    assert all(d["plain"] == r["plain"] for d in r["drafts"])  # one plain run for every draft
    assert isinstance(r["tau_rises_with_data"], bool)
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"
    history = mlflow.MlflowClient().get_metric_history(r["mlflow_run_id"], "tau")
    assert sorted(m.step for m in history) == [1000, 2000]
    assert "τ rises with data" in capsys.readouterr().out


def test_a_draft_without_its_data_size_is_refused(tmp_path):
    from eagleray.jobs.bench.scaling import draft_facts
    from eagleray.platform.errors import EaglerayError
    from eagleray.tests.support.tiny import make_tiny_llama

    target = make_tiny_llama(tmp_path / "target", num_layers=4, max_positions=4096)
    with pytest.raises(
        EaglerayError, match=r"(?s)--drafts: .* records no training data size.*fix: pass drafts written by `eagleray train`"
    ):
        draft_facts(_draft(target, tmp_path / "plain", 3))
