"""The adaptation loop against real parts: Ray Serve with capture on and an alias poller, MLflow on sqlite,
the engine measuring τ, Ray-free local training.

The target is the tiny Llama with its final norm zeroed (greedy decoding always emits token 0); draft
'good' has its norm zeroed too (it always proposes token 0: every draft accepted, τ = k + 1) and draft
'bad' is random (τ ≈ 1). The gate must refuse 'bad' against 'good' and leave the alias; it must pass
'good' against 'bad', move the alias, and the running Serve app must hot-swap to it with no failed request.
A whole pass (capture -> snapshot -> fine-tune -> gate -> decide) runs on the traffic the app captured.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from eagleray.platform import capture_store, registry
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.config.promotion import AdaptConfig
from eagleray.serve.serving_config import ServingConfig
from eagleray.tests.support.tiny import zero_tensor

NAME, K, CTX = "adapt-draft", 3, 128
KEY = "adapt-key"  # the admin route (the swap history of a failure message) needs a key
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def world(tiny_target, tmp_path_factory):
    """Registry (v1 good, v2 bad; champion -> v2), a Serve app following @champion with capture on."""
    import mlflow
    import ray

    from eagleray.serve.local import start_local
    from eagleray.tests.support.cluster import stop_local_ray

    root = tmp_path_factory.mktemp("adapt")
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "EAGLERAY_HOME")}
    os.environ["EAGLERAY_HOME"] = str(root / "home")
    target = root / "target"
    shutil.copytree(tiny_target, target)
    zero_tensor(target, "model.norm.weight")
    spec = TargetSpec.from_dir(target)
    good, bad = make_random_draft(spec, root / "good", seed=1), make_random_draft(spec, root / "bad", seed=2)
    zero_tensor(good, "norm.weight")
    uri = registry.configure(f"sqlite:///{root / 'mlflow.db'}", experiment="adapt-test")
    for d in (good, bad):
        with mlflow.start_run() as run:
            mlflow.log_artifacts(str(d), "draft")
        registry.register_draft(NAME, run.info.run_id, "draft")
    registry.set_alias(NAME, "champion", "2")
    prompts = root / "control.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello world", "explain a fox", "write code")))
    serving = ServingConfig.model_validate(
        {
            "target": {"model": str(target), "device": "cpu", "max_model_len": CTX},
            "draft": {"source": f"models:/{NAME}@champion", "num_speculative_tokens": K, "policy": {"adaptive": False}},
            "alias_poll_seconds": 1,
            "mlflow": {"tracking_uri": uri},
            "model_name": "tiny",
            "api_key": KEY,
            "max_num_seqs": 8,
            "capture": {"path": str(root / "traffic"), "flush_seconds": 1},
        }
    )
    adapt = AdaptConfig.model_validate(
        {
            "capture_path": str(root / "traffic"),
            "work_dir": str(root / "work"),
            "target": {"model": str(target), "device": "cpu"},
            "min_new_requests": 8,
            "held_out_fraction": 0.3,
            "control": [str(prompts)],
            "control_limit": 3,
            "max_tokens": 8,
            "num_speculative_tokens": K,
            "train": {"max_steps": 2, "batch_size": 2, "backend": "local", "warmup_steps": 0, "eval_batches": 1, "ttt_steps": 2},
            "mlflow": {"tracking_uri": uri, "experiment": "adapt-test", "registered_model": NAME},
        }
    )
    assert not ray.is_initialized()
    try:
        url = start_local(serving, num_cpus=2, timeout_s=180)
        yield {"url": url, "adapt": adapt, "spec": spec, "uri": uri, "good": good, "bad": bad}
    finally:
        stop_local_ray()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def chat(url: str, i: int) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"request {i} about code"}],
        "max_tokens": 10,
        "temperature": 0,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def serving_version(url: str) -> str:
    return httpx.get(url + "/health", headers=AUTH, timeout=30).json()["draft_version"]


def caught_up(url: str) -> str | None:
    """The serving draft version once the replica has caught up with the alias, else None: its poller's last poll
    found the alias on the serving draft (the poller finishes a swap before it polls again, so none is under way)."""
    h = httpx.get(url + "/health", headers=AUTH, timeout=30).json()
    return h["draft_version"] if h["alias"]["version"] == h["draft_version"] else None


def swap_history(url: str) -> list[tuple]:
    """The replica's last swaps (outcome, version, message), for failure messages."""
    history = httpx.get(url + "/admin/draft", headers=AUTH, timeout=30).json()["history"]
    return [(h["outcome"], h["version"], h["message"][:80]) for h in history]


def traffic_prompts(spec: TargetSpec) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(spec.path))
    return [list(tok(f"held out prompt {i}")["input_ids"]) for i in range(3)]


def decision_run(uri: str, run_id: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri).get_run(run_id)


def gate_and_record(w, champion: str, candidate: str, champ_dir: Path, cand_dir: Path):
    from eagleray.jobs.adapt import Decision, decide, gate_step, record

    cfg = w["adapt"]
    registry.configure(cfg.mlflow.tracking_uri, cfg.mlflow.experiment)
    gate = gate_step(cfg, champ_dir, cand_dir, traffic_prompts(w["spec"]), emit=lambda s: None)
    ok, reason, numbers = decide(cfg, gate)
    d = Decision(
        "t-" + candidate[-1],
        "promote" if ok else "reject",
        reason,
        champion,
        candidate,
        numbers=numbers,
        tau={"traffic": gate["traffic"], "control": gate["control"]},
    )
    record(cfg, d)
    return d


def test_gate_refuses_a_worse_draft_and_the_alias_stays(world):
    registry.set_alias(NAME, "champion", "1")
    d = gate_and_record(world, f"models:/{NAME}/1", f"models:/{NAME}/2", world["good"], world["bad"])
    assert d.action == "reject" and "traffic τ" in d.reason
    assert d.tau["traffic"]["before"] == pytest.approx(K + 1) and d.tau["traffic"]["after"] < 2
    assert registry.get_alias(NAME, "champion").version == "1"
    run = decision_run(world["uri"], d.run_id)
    assert run.data.tags["adapt.action"] == "reject" and run.data.metrics["tau_traffic_before"] == pytest.approx(K + 1)
    assert capture_store.read_adapt_status(world["adapt"].capture_path)["promoted"] is False
    registry.set_alias(NAME, "champion", "2")


def test_alias_moves_on_a_pass_and_serving_hot_swaps_without_failures(world):
    url = world["url"]
    # The gate test moved the alias to 1 and back to 2: the poller may have seen 1 and be swapping to it now.
    deadline = time.monotonic() + 60
    while caught_up(url) != f"{NAME}/2" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert caught_up(url) == f"{NAME}/2", swap_history(url)
    d = gate_and_record(world, f"models:/{NAME}/2", f"models:/{NAME}/1", world["bad"], world["good"])
    assert d.action == "promote", d.reason
    assert registry.get_alias(NAME, "champion").version == "1"
    statuses = []
    deadline = time.monotonic() + 60
    while serving_version(url) != f"{NAME}/1" and time.monotonic() < deadline:
        statuses.append(chat(url, len(statuses)).status_code)
    assert serving_version(url) == f"{NAME}/1" and set(statuses) <= {200}, (statuses, swap_history(url))
    body = chat(url, 999).json()
    assert body["usage"]["completion_tokens"] == 10


def test_a_whole_pass_on_captured_traffic_is_recorded_and_consistent(world):
    from eagleray.jobs.adapt import adapt_once

    url, cfg = world["url"], world["adapt"]
    assert all(chat(url, 100 + i).status_code == 200 for i in range(24))
    deadline = time.monotonic() + 60
    while capture_store.count_rows(capture_store.list_shards(cfg.capture_path)) < 24 and time.monotonic() < deadline:
        time.sleep(0.5)
    before = registry.get_alias(NAME, "champion").version
    lines: list[str] = []
    d = adapt_once(cfg, emit=lines.append)
    assert d.action in ("promote", "reject") and d.window["rows"] >= 24 and d.window["held_out"] > 0, (d, lines)
    assert [ln[:5] for ln in lines if ln.startswith("[")] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    after = registry.get_alias(NAME, "champion").version
    assert (after == d.candidate.rsplit("/", 1)[1]) == (d.action == "promote") and (after == before) == (d.action == "reject")
    run = decision_run(world["uri"], d.run_id)
    assert run.data.params["window.rows"] == str(d.window["rows"]) and "tau_control_after" in run.data.metrics
    again = adapt_once(cfg, emit=lines.append)  # nothing new since that window: a recorded skip
    assert again.action == "skip" and "min_new_requests" in again.reason
    assert decision_run(world["uri"], again.run_id).data.tags["adapt.action"] == "skip"
