"""Placement on chosen nodes and what happens after a node loss (the config side of
tests/integration/test_node_loss.py): custom-resource fields are checked, reach Ray, and
``after_node_loss: anywhere`` refits without them; each resume is recorded in MLflow."""

from __future__ import annotations

import pytest

from eagleray.platform.config.load import parse_config
from eagleray.platform.config.schemas import DatagenConfig, TrainingConfig
from eagleray.platform.errors import ConfigError, EaglerayError
from eagleray.serve.serving_config import ServingConfig

TRAIN = {"data_dir": "/data", "output_dir": "/out"}


@pytest.mark.parametrize(
    "model, field, value, words",
    [
        (TrainingConfig, "resources_per_worker", {"CPU": 2}, ["resources_per_worker", "CPU", "cpus_per_worker"]),
        (TrainingConfig, "resources_per_worker", {"trainer": 0}, ["resources_per_worker", "> 0"]),
        (ServingConfig, "engine_resources", {"GPU": 1}, ["engine_resources", "GPU", "target.device"]),
        (ServingConfig, "engine_resources", {"engine": -1}, ["engine_resources", "> 0"]),
        (ServingConfig, "ingress_resources", {"memory": 1e9}, ["ingress_resources", "memory"]),
    ],
)
def test_custom_resource_fields_refuse_builtin_resources_and_bad_amounts(model, field, value, words):
    data = {**(TRAIN if model is TrainingConfig else {}), field: value}
    with pytest.raises(ConfigError) as err:
        parse_config(model, data, source="test")
    assert all(w in str(err.value) for w in words), str(err.value)


def test_resources_per_worker_needs_the_ray_backend():
    with pytest.raises(ConfigError, match="backend is 'local'"):
        parse_config(TrainingConfig, {**TRAIN, "backend": "local", "resources_per_worker": {"trainer": 1}}, source="test")


def test_unknown_placement_fields_are_refused():
    with pytest.raises(ConfigError, match="after_node_los"):
        parse_config(TrainingConfig, {**TRAIN, "after_node_los": "anywhere"}, source="test")
    with pytest.raises(ConfigError, match="after_node_loss"):
        parse_config(TrainingConfig, {**TRAIN, "after_node_loss": "somewhere"}, source="test")


def test_serving_resources_reach_the_deployments():
    from eagleray.serve.app import engine_options, ingress_deployment

    cfg = ServingConfig.model_validate({"engine_resources": {"engine": 1}, "ingress_resources": {"node:__internal_head__": 0.01}})
    assert engine_options(cfg)["ray_actor_options"]["resources"] == {"engine": 1.0}
    assert ingress_deployment(cfg).ray_actor_options["resources"] == {"node:__internal_head__": 0.01}
    tp = engine_options(
        ServingConfig.model_validate({"target": {"tensor_parallel_size": 2, "device": "cuda"}, "engine_resources": {"engine": 1}})
    )
    assert tp["placement_group_bundles"] == [{"CPU": 1, "GPU": 1, "engine": 1.0}, {"CPU": 1, "GPU": 1}]
    assert "resources" not in engine_options(ServingConfig())["ray_actor_options"]


def _nodes(*resources):
    return [{"NodeID": f"{i + 1:02x}" * 28, "Alive": alive, "Resources": res} for i, (alive, res) in enumerate(resources)]


def test_datagen_prefers_the_node_with_the_resource_softly(monkeypatch):
    import ray

    from eagleray.datagen.pipeline import _model_stage_args

    monkeypatch.setattr(ray, "nodes", lambda: _nodes((True, {"CPU": 2}), (False, {"gen": 1}), (True, {"CPU": 2, "gen": 1})))
    cfg = DatagenConfig(prompts=["x.jsonl"], output_dir="/out", prefer_resource="gen")
    strategy = _model_stage_args(cfg)["scheduling_strategy"]
    assert strategy.node_id == "03" * 28 and strategy.soft is True  # soft: a lost node's actors restart elsewhere
    assert "scheduling_strategy" not in _model_stage_args(DatagenConfig(prompts=["x.jsonl"], output_dir="/out"))


def test_datagen_prefer_resource_missing_from_the_cluster_is_a_clear_error(monkeypatch):
    import ray

    from eagleray.datagen.pipeline import preferred_node

    monkeypatch.setattr(ray, "nodes", lambda: _nodes((True, {"CPU": 2, "other": 1})))
    with pytest.raises(EaglerayError) as err:
        preferred_node("gen")
    text = str(err.value)
    assert "prefer_resource" in text and "'gen'" in text and "['CPU', 'other']" in text and "ray start --resources" in text


@pytest.fixture
def fits(monkeypatch):
    """_fit_ray with trainer.fit replaced: records (custom resources, max_failures) per fit; the first fails."""
    import ray
    from ray.train import TrainingFailedError

    from eagleray.training import tracking, trainer

    calls, reasons = [], []

    def once(cfg, run_id, custom, max_failures):
        calls.append((dict(custom), max_failures))
        if len(calls) == 1:
            raise TrainingFailedError("worker group lost")
        return "ckpt", {"step": 8}

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(trainer, "_fit_ray_once", once)
    monkeypatch.setattr(tracking, "record_restart_reason", lambda cfg, run_id, why: reasons.append(why))
    return trainer, calls, reasons


def test_after_node_loss_anywhere_refits_without_the_custom_resources(fits):
    trainer, calls, reasons = fits
    cfg = TrainingConfig(**TRAIN, resources_per_worker={"trainer": 1}, after_node_loss="anywhere", max_failures=2)
    assert trainer._fit_ray(cfg, "run", emit=lambda s: None) == ("ckpt", {"step": 8})
    assert calls == [({"trainer": 1.0}, 0), ({}, 1)]
    assert len(reasons) == 1 and "after_node_loss=anywhere" in reasons[0]


def test_after_node_loss_wait_leaves_restarts_to_ray_train_with_the_same_resources(fits):
    trainer, calls, reasons = fits
    cfg = TrainingConfig(**TRAIN, resources_per_worker={"trainer": 1}, max_failures=2)
    from ray.train import TrainingFailedError

    with pytest.raises(TrainingFailedError):
        trainer._fit_ray(cfg, "run", emit=lambda s: None)
    assert calls == [({"trainer": 1.0}, 2)] and reasons == []


def test_after_node_loss_anywhere_without_failures_left_fails(fits):
    trainer, calls, _ = fits
    cfg = TrainingConfig(**TRAIN, resources_per_worker={"trainer": 1}, after_node_loss="anywhere", max_failures=0)
    from ray.train import TrainingFailedError

    with pytest.raises(TrainingFailedError):
        trainer._fit_ray(cfg, "run", emit=lambda s: None)
    assert calls == [({"trainer": 1.0}, 0)]


def test_each_resume_is_recorded_in_the_mlflow_run(tmp_path):
    import mlflow

    from eagleray.training.tracking import StepLogger, record_restart_reason

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("placement")).info.run_id
    logger = StepLogger(uri, run_id)
    assert logger.restarted(4) == 1 and logger.restarted(6) == 2
    cfg = TrainingConfig(**TRAIN, mlflow={"tracking_uri": uri})
    record_restart_reason(cfg, run_id, "node lost")
    record_restart_reason(cfg, run_id, "again")
    tags = client.get_run(run_id).data.tags
    assert tags["eagleray.restarts"] == "2" and tags["eagleray.restart.2.resumed_from_step"] == "6"
    assert tags["eagleray.restart_reasons"] == "node lost; again"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "resumed_from_step")] == [(4, 4.0), (6, 6.0)]
