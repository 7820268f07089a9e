"""Promotion with the real engine and an MLflow sqlite registry: promote, then refuse a no-better candidate."""

from __future__ import annotations

import json

import pytest

from eagleray.platform import registry
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.config.promotion import PromotionConfig


@pytest.fixture()
def versions(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLERAY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = registry.configure(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="promote-test")
    import mlflow

    spec = TargetSpec.from_dir(tiny_target)
    out = []
    for seed in (1, 2):
        d = make_random_draft(spec, tmp_path / f"draft{seed}", seed=seed)
        with mlflow.start_run() as run:
            mlflow.log_artifacts(str(d), "draft")
        out.append(registry.register_draft("tiny-draft", run.info.run_id, "draft").version)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("hello world", "explain code", "write a fox")) + "\n")
    yield uri, out, str(prompts)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _cfg(tiny_target, uri, candidate, prompts, **kw) -> PromotionConfig:
    return PromotionConfig.model_validate(
        {
            "candidate": candidate,
            "target": {"model": str(tiny_target), "device": "cpu"},
            "prompts": [prompts],
            "limit": 3,
            "max_tokens": 8,
            "num_speculative_tokens": 2,
            "mlflow": {"tracking_uri": uri, "registered_model": "tiny-draft"},
            **kw,
        }
    )


@pytest.mark.slow
def test_promote_then_refuse(tiny_target, versions):
    from mlflow import MlflowClient

    from eagleray.jobs.promote import promote

    uri, (v1, v2), prompts = versions
    first = promote(_cfg(tiny_target, uri, f"models:/tiny-draft/{v1}", prompts, min_speedup=0.01))
    assert first["decision"]["promote"] and first["alias_set"] and first["champion"] is None
    assert first["candidate"]["tau"] >= 1.0 and len(first["candidate"]["accept_rate_per_pos"]) == 2
    # plain is measured before and after the drafts; the gate compares against the faster run
    runs = first["plain_runs_tokens_per_s"]
    assert len(runs) == 2 and first["plain"]["tokens_per_s"] == max(runs)
    assert registry.get_alias("tiny-draft", "champion").version == v1
    second = promote(_cfg(tiny_target, uri, f"models:/tiny-draft/{v2}", prompts, min_speedup=0.01, min_tau_gain=0.5))
    assert not second["decision"]["promote"] and "champion" in second["decision"]["reason"]
    assert second["champion"]["version"] == v1
    assert registry.get_alias("tiny-draft", "champion").version == v1
    tags = MlflowClient().get_model_version("tiny-draft", v2).tags
    assert tags["promotion.decision"] == "reject" and float(tags["promotion.plain_tokens_per_s"]) > 0
    assert MlflowClient().get_model_version("tiny-draft", v1).tags["promotion.decision"] == "promote"
