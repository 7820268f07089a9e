"""Training on real local Ray (TorchTrainer, 2 DDP workers on CPU) with MLflow on sqlite in tmp_path.

A worker SIGKILLs itself after step 3 (checkpoints every 2 steps); FailureConfig(max_failures=1)
restarts the group, which resumes from step 2. The registered version is fetched back through
models:/name@alias and passes the compatibility guard.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from eagleray.tests.support.synth import write_synthetic

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_ray_train_resumes_after_killed_worker_and_registers(tmp_path, ray_local):
    import mlflow

    from eagleray.platform.checkpoints.guard import check_compatibility
    from eagleray.platform.checkpoints.target import TargetSpec
    from eagleray.platform.registry import download_draft, get_alias
    from eagleray.tests.support.tiny import make_tiny_llama
    from eagleray.tests.support.training import small_training_config
    from eagleray.training.trainer import train

    target = make_tiny_llama(tmp_path / "target", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
    data = write_synthetic(target, tmp_path / "data", rows=16, gen_len=18)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = small_training_config(
        data,
        target,
        tmp_path / "out",
        warmup_steps=1,
        max_steps=6,
        ttt_steps=3,
        log_every=2,
        checkpoint_every=2,
        eval_fraction=0.2,
        eval_batches=2,
        backend="ray",
        num_workers=2,
        max_failures=1,
        alias="candidate",
        mlflow={"tracking_uri": uri, "experiment": "train-it", "registered_model": "it-draft"},
        testing={"kill_worker_at_step": 3},
    )
    import tempfile
    import time

    copies = set(Path(tempfile.gettempdir()).glob("eagleray-resume-*"))
    t0 = time.perf_counter()
    result = train(cfg, emit=lambda s: print(f"[{time.perf_counter() - t0:.1f}s] {s}", flush=True))

    assert (tmp_path / "out" / ".test-worker-killed").is_file()  # the failure really happened
    assert set(Path(tempfile.gettempdir()).glob("eagleray-resume-*")) == copies, "resumed from local storage: no copy"
    assert result.metrics["step"] == 6 and result.metrics["resumed_from_step"] == 2
    assert 0.0 <= result.metrics["eval/acc_0"] <= 1.0 and result.metrics["eval/sim_tau"] >= 1.0

    client = mlflow.MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.data.params["ttt_steps"] == "3" and run.info.status == "FINISHED"
    assert {"loss", "acc_0", "acc_2", "ploss_1", "lr", "eval/sim_tau"} <= set(run.data.metrics)
    assert len(client.get_metric_history(result.run_id, "lr")) >= 3
    arts = {a.path for a in client.list_artifacts(result.run_id)} | {
        a.path for a in client.list_artifacts(result.run_id, "plots")
    }
    assert {"draft", "plots/acceptance.png"} <= arts

    version = get_alias("it-draft", "candidate")
    spec = TargetSpec.from_dir(target)
    assert version.tags["target_fingerprint"] == spec.fingerprint and version.tags["aux_layer_ids"] == "1,2"
    assert version.tags["dataset_id"] == "synthetic-0" and "eval/sim_tau" in version.tags
    local = download_draft("models:/it-draft@candidate", tmp_path / "fetched")
    report = check_compatibility(spec, local, algorithm="eagle3")
    assert report.ok, [p.render() for p in report.problems]
