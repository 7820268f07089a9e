"""Losing a whole Ray node: datagen, training and serving on a real two-node cluster (``two_nodes`` in
conftest.py: a head and a worker node as `ray start` processes on this machine), the worker node
SIGKILLed mid-run by its own process ids.

* datagen: a regenerate + hidden-state job (`ray job submit`) whose model-stage actors prefer the worker
  node; the node dies after a few shards; Ray Data redoes the lost chunks on the head. Every prompt ends
  up exactly once (answered or recorded as an error), and no shard file is written twice.
* training: Ray Train, one worker on the worker node; the node dies after a checkpoint; the run restarts
  from that checkpoint on the remaining node (``after_node_loss: anywhere``), the logged steps are
  continuous and the MLflow run records the restart.
* serving: the engine replica requires the worker node's resource, the ingress stays on the head; the
  node dies mid-stream; in-flight requests end with a clean retryable ``engine_unavailable``, /health
  says ``restarting`` while no replica can be placed, a replacement node joins, Serve places a new
  replica there, and new requests succeed.

Each test prints one ``node-loss <part>:`` line with its measured numbers (BENCHMARKS.md quotes them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import yaml

from eagleray.datagen import shards
from eagleray.datagen.manifest import MANIFEST
from eagleray.tests.support.cluster import BIN, WORKER_RESOURCE, ray_env
from eagleray.tests.support.datagen import FIXTURE, datagen_config
from eagleray.tests.support.synth import write_synthetic

pytestmark = pytest.mark.slow


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _actors(cluster, name_part: str) -> list[dict]:
    """Actors (alive and dead) whose class name contains ``name_part``: state, node_id, pid."""
    body = _get(f"{cluster.dashboard}/api/v0/actors?limit=1000&detail=1")
    return [a for a in body["data"]["result"]["result"] if name_part in (a.get("class_name") or "")]


def _pending_groups(cluster, resource: str) -> list[dict]:
    """Placement groups waiting for a node (state PENDING/RESCHEDULING) with a bundle that needs ``resource``."""
    body = _get(f"{cluster.dashboard}/api/v0/placement_groups?limit=1000&detail=1")
    return [
        g
        for g in body["data"]["result"]["result"]
        if g.get("state") in ("PENDING", "RESCHEDULING")
        and any(resource in (b.get("unit_resources") or {}) for b in g.get("bundles") or [])
    ]


def _worker_node_ids(cluster) -> set[str]:
    return {n["node_id"] for n in cluster.nodes() if WORKER_RESOURCE in (n.get("resources_total") or {})}


# ----------------------------------------------------------------------------------------------- datagen
def _datagen_config(target: Path, out: Path) -> dict:
    """20 prompts, 2 per shard (10 shards), 1 s per shard in the hidden-state stage so the kill lands mid-run."""
    return datagen_config(
        target, FIXTURE, out, rows_per_shard=2, batch_size=2, prefer_resource=WORKER_RESOURCE, testing={"chunk_delay_s": 1.0}
    )


def _job_status(cluster, job_id: str) -> dict:
    return _get(f"{cluster.dashboard}/api/jobs/{job_id}")


def _submit(cluster, cmd: list[str], job_id: str, agent_wait_s: float = 180.0) -> None:
    """`ray job submit --no-wait`, again while the head's job agent is still starting ("No available agent")."""
    end = time.monotonic() + agent_wait_s
    while True:
        res = subprocess.run(
            [
                str(BIN / "ray"),
                "job",
                "submit",
                "--address",
                cluster.dashboard,
                "--submission-id",
                job_id,
                "--no-wait",
                "--",
                *cmd,
            ],
            env=ray_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if res.returncode == 0:
            return
        if "No available agent" not in res.stderr + res.stdout or time.monotonic() > end:
            raise AssertionError(f"ray job submit failed: {res.stdout[-2000:]}{res.stderr[-2000:]}")
        time.sleep(2)


def _job_logs(cluster, job_id: str) -> str:
    return _get(f"{cluster.dashboard}/api/jobs/{job_id}/logs").get("logs", "")


def test_datagen_survives_losing_the_worker_node(two_nodes, tiny_target, tmp_path):
    from eagleray.datagen.chunks import select_prompts
    from eagleray.platform.config.schemas import DatagenConfig

    out = tmp_path / "out"
    cfg = _datagen_config(tiny_target, out)
    expected = {r.prompt_id for r in select_prompts(DatagenConfig(**cfg))[0]}
    cfg_path = tmp_path / "datagen.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    job_id = f"node-loss-datagen-{os.getpid()}"
    earlier = {a["actor_id"] for a in _actors(two_nodes, "ExtractStage")}
    t0 = time.monotonic()
    _submit(two_nodes, [sys.executable, "-m", "eagleray.jobs.datagen", "--config", str(cfg_path)], job_id)

    seen: dict[str, tuple[int, float]] = {}  # shard name -> (mtime_ns when first seen, monotonic time first seen)

    def poll() -> int:
        for p in shards.shard_files(out):
            if p.name not in seen:
                seen[p.name] = (p.stat().st_mtime_ns, time.monotonic())
        return len(seen)

    def job_failed() -> bool:
        return _job_status(two_nodes, job_id)["status"] in ("FAILED", "STOPPED")

    end = time.monotonic() + 240
    while poll() < 3:
        assert time.monotonic() < end and not job_failed(), (
            f"no 3 shards before the kill:\n{_job_logs(two_nodes, job_id)[-4000:]}"
        )
        time.sleep(0.1)
    workers = _worker_node_ids(two_nodes)
    placed = {a["node_id"] for a in _actors(two_nodes, "ExtractStage") if a["state"] == "ALIVE"}
    assert placed and placed <= workers, f"the hidden-state actor is not on the worker node: {placed} vs {workers}"
    first_shard_at = min(t for _, t in seen.values())
    before = len(seen)
    killed_at = two_nodes.kill_worker()
    dead_after = two_nodes.wait_worker_dead()

    status = {}
    while True:
        poll()
        status = _job_status(two_nodes, job_id)
        if status["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        assert time.monotonic() < killed_at + 240, (
            f"datagen did not finish after the node loss:\n{_job_logs(two_nodes, job_id)[-4000:]}"
        )
        time.sleep(0.2)
    finished_at = time.monotonic()
    poll()
    logs = _job_logs(two_nodes, job_id)
    assert status["status"] == "SUCCEEDED", logs[-4000:]
    assert "datagen summary" in logs, logs[-3000:]

    # Every prompt exactly once (a row in a shard or a recorded error); nothing half-written left behind.
    written = Counter(shards.written_ids(out))
    errors = Counter(e["prompt_id"] for e in shards.read_errors(out))
    both = written + errors
    assert set(both) == expected and max(both.values()) == 1, (set(both) ^ expected, both.most_common(3))
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["rows"] + manifest["errors"] == len(expected) == 20
    assert manifest["rows"] == sum(written.values()) and manifest["errors"] == sum(errors.values())
    assert not list((out / shards.SHARDS_DIR).glob(".tmp-*")), "a half-written shard was left behind"
    # No shard written twice: every file still has the mtime it had when the test first saw it.
    rewritten = [n for n, (mt, _) in seen.items() if (out / shards.SHARDS_DIR / n).stat().st_mtime_ns != mt]
    assert not rewritten, f"shards rewritten after they were complete: {rewritten}"
    # The redone work ran on the surviving node.
    after = [a for a in _actors(two_nodes, "ExtractStage") if a["node_id"] not in workers and a["actor_id"] not in earlier]
    assert after, "no hidden-state actor ran outside the lost node"

    after_kill = sorted(t for _, t in seen.values() if t > killed_at)
    rate_before = (before - 1) / max(1e-9, killed_at - first_shard_at) if before > 1 else float("nan")
    rate_after = len(after_kill) / max(1e-9, finished_at - killed_at)
    # Slowdown: the time from the first shard to the last, against the same shards at the pre-kill rate.
    span = max(t for _, t in seen.values()) - first_shard_at
    ideal = (len(seen) - 1) / rate_before if rate_before == rate_before and rate_before > 0 else float("nan")
    print(
        f"\nnode-loss datagen: first shard to last {span:.1f} s vs {ideal:.1f} s at the pre-kill rate "
        f"(+{span - ideal:.1f} s from the node loss); {len(expected)} prompts in, {manifest['rows']} rows + {manifest['errors']} errors out, "
        f"0 lost, 0 duplicated, {len(seen)} shards ({before} before the kill); node declared dead {dead_after:.1f} s "
        f"after the kill; first shard after the kill {after_kill[0] - killed_at if after_kill else float('nan'):.1f} s after it; "
        f"{rate_before:.2f} shards/s before, {rate_after:.2f} shards/s after (kill to end); "
        f"job {finished_at - t0:.1f} s",
        flush=True,
    )


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("after", ["anywhere", "wait"])
def test_training_resumes_from_its_checkpoint_after_losing_the_worker_node(two_nodes, tmp_path, after):
    """``anywhere``: the run goes on on the head; ``wait``: it waits for a replacement worker node (started
    by the test once the loss is detected) and goes on there."""
    import threading

    import mlflow
    import ray

    from eagleray.tests.support.tiny import make_tiny_llama
    from eagleray.tests.support.training import small_training_config
    from eagleray.training.trainer import train

    two_nodes.ensure_worker()
    target = make_tiny_llama(tmp_path / "target", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
    data = write_synthetic(target, tmp_path / "data", rows=16, gen_len=18)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    max_steps, every = 8, 2
    cfg = small_training_config(
        data,
        target,
        tmp_path / "out",
        warmup_steps=1,
        max_steps=max_steps,
        ttt_steps=3,
        log_every=1,
        checkpoint_every=every,
        eval_fraction=0.2,
        eval_batches=2,
        backend="ray",
        num_workers=1,
        cpus_per_worker=1,
        resources_per_worker={WORKER_RESOURCE: 1},
        after_node_loss=after,
        max_failures=1,
        alias="candidate",
        ray_address=two_nodes.gcs,
        mlflow={"tracking_uri": uri, "experiment": "node-loss", "registered_model": "nl-draft"},
        testing={"step_delay_s": 0.7},
    )
    ray.init(address=two_nodes.gcs, log_to_driver=False, configure_logging=False)
    lines: list[str] = []
    box: dict = {}

    def run() -> None:
        t = time.perf_counter()
        try:
            box["result"] = train(cfg, emit=lambda s: lines.append(f"[{time.perf_counter() - t:.1f}s] {s}"))
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread below
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    earlier = {a["actor_id"] for a in _actors(two_nodes, "RayTrainWorker")}  # of an earlier test in this module
    try:
        t0 = time.monotonic()
        thread.start()
        client = mlflow.MlflowClient(uri)

        def steps() -> list[int]:
            runs = client.search_runs([e.experiment_id for e in client.search_experiments()]) if "result" not in box else []
            return [m.step for r in runs for m in client.get_metric_history(r.info.run_id, "lr")]

        end = time.monotonic() + 240
        while max(steps(), default=0) < every + 1:  # a checkpoint (step 2) is in storage, step 3 is done
            assert thread.is_alive() and time.monotonic() < end, f"training did not reach step 3: {box} {lines}"
            time.sleep(0.2)
        workers = _worker_node_ids(two_nodes)
        on = {
            a["node_id"] for a in _actors(two_nodes, "RayTrainWorker") if a["state"] == "ALIVE" and a["actor_id"] not in earlier
        }
        assert on and on <= workers, f"the Ray Train worker is not on the worker node: {on} vs {workers}"
        at_kill = max(steps())
        killed_at = two_nodes.kill_worker()
        killed_wall = time.time()
        joined_s = None
        waited_s = None
        if after == "wait":
            # Ray Train restarts the group with the same resources: its new placement group waits, unplaceable,
            # for a node that has them. Only then does the replacement node join.
            end = time.monotonic() + 120
            while not _pending_groups(two_nodes, WORKER_RESOURCE):
                assert thread.is_alive() and time.monotonic() < end, f"Ray Train did not restart the group: {box} {lines}"
                time.sleep(0.5)
            waited_s = time.monotonic() - killed_at
            time.sleep(3.0)
            assert thread.is_alive() and not two_nodes.alive_workers(), (
                f"training ended without a node that has {WORKER_RESOURCE}: {box} {lines}"
            )
            two_nodes.start_worker()
            joined_s = time.monotonic() - killed_at
        thread.join(timeout=300)
        assert not thread.is_alive(), f"training did not finish after the node loss: {lines}"
        done_at = time.monotonic()
    finally:
        ray.shutdown()
    if "error" in box:
        raise AssertionError(f"training failed after the node loss: {lines}") from box["error"]
    result = box["result"]

    resumed = int(result.metrics["resumed_from_step"])
    assert result.metrics["step"] == max_steps
    assert resumed % every == 0 and at_kill - every <= resumed <= at_kill, (resumed, at_kill)  # <= one interval lost
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["eagleray.restarts"] == "1" and run.data.tags["eagleray.restart.1.resumed_from_step"] == str(resumed)
    if after == "anywhere":  # the driver refitted without the custom resources, and said why
        assert "after_node_loss=anywhere" in run.data.tags["eagleray.restart_reasons"], run.data.tags
    else:  # Ray Train restarted the group itself
        assert "eagleray.restart_reasons" not in run.data.tags, run.data.tags
    restarts = client.get_metric_history(result.run_id, "resumed_from_step")
    assert [(m.step, m.value) for m in restarts] == [(resumed, float(resumed))]
    logged = client.get_metric_history(result.run_id, "lr")
    assert sorted({m.step for m in logged}) == list(range(1, max_steps + 1)), "the step count is not continuous"
    # The restarted worker ran on the node that is left (anywhere) or on the replacement node (wait).
    later = {
        a["node_id"] for a in _actors(two_nodes, "RayTrainWorker") if a["node_id"] not in workers and a["actor_id"] not in earlier
    }
    replacement = _worker_node_ids(two_nodes) - workers
    assert later and (later <= replacement if after == "wait" else not later & replacement), (later, replacement)
    first_after = min((m.timestamp for m in logged if m.timestamp / 1000 > killed_wall and m.step > resumed), default=None)
    resume_s = restarts[0].timestamp / 1000 - killed_wall
    step_s = first_after / 1000 - killed_wall if first_after else float("nan")
    where = (
        "on the head"
        if after == "anywhere"
        else (
            f"on the replacement node (the group's placement group waited for a node with {WORKER_RESOURCE} from "
            f"{waited_s:.1f} s after the kill; the replacement, started 3 s later, joined {joined_s:.1f} s after the kill)"
        )
    )
    print(
        f"\nnode-loss training ({after}): killed after step {at_kill}; resumed from the step-{resumed} checkpoint {where} "
        f"{resume_s:.1f} s after the kill (first new step {step_s:.1f} s after it); {at_kill - resumed} step(s) redone; "
        f"steps 1..{max_steps} continuous; run {done_at - t0:.1f} s (kill to end {done_at - killed_at:.1f} s)\n"
        + "\n".join(lines),
        flush=True,
    )


# ----------------------------------------------------------------------------------------------- serving
INTERNALS = re.compile(
    r"Traceback|RayTaskError|RayActorError|ActorDiedError|NodeDiedError|/site-packages/|\x1b\[|"
    r"\bpid[=:]|File \"|actor_id|node_id|namespace|\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b"
)


def _clean_error(err: dict) -> dict:
    """An OpenAI error object that carries no internals, and says the request may be retried."""
    text = json.dumps(err)
    assert INTERNALS.search(text) is None, f"internal detail in an error: {text}"
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == "engine_unavailable" and err["type"] == "server_error" and "retry" in err["message"], err
    return err


def test_serving_survives_losing_the_engine_node(two_nodes, tiny_target):
    import threading

    import httpx
    import ray
    from ray import serve

    from eagleray.platform.host import free_port
    from eagleray.serve.app import build
    from eagleray.serve.local import APP_NAME, wait_ready
    from eagleray.serve.serving_config import ServingConfig

    two_nodes.ensure_worker()
    cfg = ServingConfig.model_validate(
        {
            "target": {"model": str(tiny_target), "device": "cpu", "max_model_len": 128},
            "model_name": "tiny",
            "max_num_seqs": 8,
            "engine_resources": {WORKER_RESOURCE: 1},
            "ingress_resources": {"node:__internal_head__": 0.01},
        }
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(address=two_nodes.gcs, log_to_driver=False, configure_logging=False)
    try:
        # One HTTP proxy, on the head (both nodes share this machine's 127.0.0.1).
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(cfg), name=APP_NAME, route_prefix="/", blocking=False)
        wait_ready(url, None, 240)
        workers = _worker_node_ids(two_nodes)
        engine = [a for a in _actors(two_nodes, "EagleRayEngine") if a["state"] == "ALIVE"]
        ingress = [a for a in _actors(two_nodes, "EagleRayIngress") if a["state"] == "ALIVE"]
        assert len(engine) == 1 and engine[0]["node_id"] in workers, (engine, workers)
        assert len(ingress) == 1 and ingress[0]["node_id"] not in workers, ingress

        body = {"model": "tiny", "prompt": "stream me", "max_tokens": 100, "ignore_eos": True, "stream": True}
        results: list = [None] * 6
        started = [threading.Event() for _ in results]

        def one(i: int) -> None:
            import httpx

            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as r:
                    buf = ""
                    for chunk in r.iter_text():
                        buf += chunk
                        started[i].set()
                    status = r.status_code
                events = (
                    [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in buf.split("\n\n") if e]
                    if status == 200
                    else [json.loads(buf)]
                )
                results[i] = (status, events)
            finally:
                started[i].set()

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(results))]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(60), "a stream did not start"
        killed_at = two_nodes.kill_worker()
        states: list[tuple[float, str]] = []

        def health() -> str:
            try:
                r = httpx.get(url + "/health", timeout=10)
            except httpx.HTTPError as err:
                return f"no answer ({type(err).__name__})"
            assert INTERNALS.search(r.text) is None, f"internal detail on /health: {r.text}"
            state = r.json().get("status", f"HTTP {r.status_code}")
            if not states or states[-1][1] != state:
                states.append((round(time.monotonic() - killed_at, 1), state))
            return state

        for t in threads:
            t.join(timeout=120)
        streams_done = time.monotonic() - killed_at
        assert all(r is not None for r in results), results
        errors = [e["error"] for _, ev in results for e in ev if isinstance(e, dict) and "error" in e]
        failed = sum(1 for status, ev in results if status != 200 or any(isinstance(e, dict) and "error" in e for e in ev))
        assert errors and failed == len(errors), results
        for err in errors:
            _clean_error(err)
        wait_for_restarting = time.monotonic() + 60
        while health() != "restarting":
            assert time.monotonic() < wait_for_restarting, states
            time.sleep(0.3)
        restarting_s = time.monotonic() - killed_at

        # While no node has the engine's resource, a new request waits or gets the same clean 503; a
        # replacement node joins and Serve places the new replica on it.
        during: dict = {}

        def early() -> None:
            t = time.monotonic()
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=240,
            )
            during.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - t)

        early_thread = threading.Thread(target=early, daemon=True)
        early_thread.start()
        time.sleep(1.0)
        health()
        joined_t0 = time.monotonic()
        two_nodes.start_worker()
        joined_s, join_took = time.monotonic() - killed_at, time.monotonic() - joined_t0
        first_ok = None
        deadline = time.monotonic() + 180
        while first_ok is None:
            assert time.monotonic() < deadline, states
            health()
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=120,
            )
            if r.status_code == 200:
                first_ok = time.monotonic() - killed_at
            else:
                _clean_error(r.json()["error"])
                time.sleep(0.5)
        health()
        early_thread.join(timeout=240)
        assert during, "the request sent during the outage got no answer"
        assert during["status"] == 200 or (during["status"] == 503 and _clean_error(during["body"]["error"])), during
        engine = [a for a in _actors(two_nodes, "EagleRayEngine") if a["state"] == "ALIVE"]
        assert len(engine) == 1 and engine[0]["node_id"] in _worker_node_ids(two_nodes) - workers, engine
        seen_states = [s for _, s in states]  # after the kill: 'restarting' until the new replica answers, then 'ok'
        assert seen_states[0] == "restarting" and seen_states[-1] == "ok" and set(seen_states) == {"restarting", "ok"}, states
        print(
            f"\nnode-loss serving: {len(results)} streams in flight at the kill, {failed} ended with a clean "
            f"engine_unavailable ({len(results) - failed} finished) within {streams_done:.1f} s; /health 'restarting' "
            f"{restarting_s:.1f} s after the kill; a request sent during the outage: HTTP {during['status']} after "
            f"{during['seconds']:.1f} s; replacement node joined {joined_s:.1f} s after the kill "
            f"(`ray start` to joined {join_took:.1f} s); first "
            f"successful request {first_ok:.1f} s after the kill; /health states {states}",
            flush=True,
        )
    finally:
        serve.shutdown()
        ray.shutdown()
