"""Serving capture end to end: real Ray Serve on a real HTTP port, the writer actor, shards on disk, /metrics.

The tiny random target with a random draft; capture at rate 1.0 into a tmp dir, shards written 1 s
after their first row, and a writer that takes 0.3 s per row (``testing.write_delay_s``) with room for
2 captures in flight, so that a burst of requests overflows the capture buffer.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from eagleray.platform import capture_store
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.serve.serving_config import ServingConfig

CTX = 128
TICK = (  # one character a run: 'x', or 's' when the run got the replica's own GOMP_SPINCOUNT
    "import os, pathlib, sys; p = pathlib.Path(sys.argv[1]); "
    "p.write_text((p.read_text() if p.exists() else '') + ('s' if 'GOMP_SPINCOUNT' in os.environ else 'x'))"
)


@pytest.fixture(scope="module")
def capture_server(tiny_target, tmp_path_factory):
    from eagleray.serve.local import start_local
    from eagleray.tests.support.cluster import init_ray_with_metrics, stop_local_ray

    root = tmp_path_factory.mktemp("capture")
    draft = make_random_draft(TargetSpec.from_dir(tiny_target), root / "draft", seed=1)
    metrics_port = init_ray_with_metrics()
    cfg = ServingConfig.model_validate(
        {
            "target": {"model": str(tiny_target), "device": "cpu", "max_model_len": CTX},
            "draft": {"source": str(draft), "num_speculative_tokens": 3, "policy": {"adaptive": False}},
            "model_name": "tiny",
            "max_num_seqs": 8,
            "capture": {
                "path": str(root / "traffic"),
                "rate": 1.0,
                "flush_seconds": 1,
                "buffer_requests": 2,
                "testing": {"write_delay_s": 0.3},
            },
            "adapt_schedule": {"command": [sys.executable, "-c", TICK, str(root / "ticks")], "every_s": 1},
        }
    )
    try:
        url = start_local(cfg, num_cpus=2, timeout_s=180)
        yield url, cfg, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        stop_local_ray()


def chat(url: str, content: str, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def counts(url: str) -> dict:
    m = httpx.get(url + "/health", timeout=30).json()["metrics"]
    return {k: v for k, v in m.items() if k.startswith("capture_")}


def until(fn, timeout_s: float, what: str):
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.3)
    pytest.fail(f"{what} within {timeout_s:.0f}s; last: {last!r}")


def rows_on_disk(path: str | Path) -> list[dict]:
    return [r for s in capture_store.list_shards(path) for r in pq.read_table(s.path).to_pylist()]


def test_captured_request_is_a_training_row_and_store_false_is_not(capture_server):
    url, cfg, _ = capture_server
    private = chat(url, "my private question", store=False)
    shared = chat(url, "a question anyone may learn from")
    assert private.status_code == shared.status_code == 200, (private.text, shared.text)
    until(lambda: counts(url).get("capture_requests") == 1, 30, "one capture acknowledged")
    rows = until(lambda: rows_on_disk(cfg.capture.path), 30, "the shard written")
    assert len(rows) == 1 and counts(url).get("capture_requests") == 1  # store: false left no row
    row, usage = rows[0], shared.json()["usage"]
    n = usage["prompt_tokens"] + usage["completion_tokens"] - 1  # the last token never ran through the target
    assert row["num_tokens"] == n == len(row["input_ids"]) == len(row["loss_mask"])
    assert (
        sum(row["loss_mask"]) == usage["completion_tokens"] - 1
        and row["response"] == shared.json()["choices"][0]["message"]["content"]
    )
    h = TargetSpec.from_dir(cfg.target.model).hidden_size
    assert len(row["aux_hidden"]) == 2 * n * 3 * h and len(row["final_hidden"]) == 2 * n * h  # bf16 [T, 3H], [T, H]
    meta = capture_store.shard_meta(capture_store.list_shards(cfg.capture.path)[0].path)
    assert meta["target_fingerprint"] == TargetSpec.from_dir(cfg.target.model).fingerprint
    assert "private" not in str(rows)


def test_a_full_capture_buffer_drops_captures_never_requests(capture_server):
    url, _, _ = capture_server
    before = counts(url)
    results: list[int] = []

    def one(i: int) -> None:
        results.append(chat(url, f"burst request number {i}").status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 8
    after = until(
        lambda: (c := counts(url))
        and c.get("capture_requests", 0)
        + c.get("capture_dropped", 0)
        - before.get("capture_requests", 0)
        - before.get("capture_dropped", 0)
        == 8
        and c,
        30,
        "every capture stored or dropped",
    )
    assert after.get("capture_dropped_buffer_full", 0) > 0, after
    assert after["capture_requests"] > before["capture_requests"], after


def test_metrics_export_capture_counts_and_the_last_adaptation(capture_server):
    from prometheus_client.parser import text_string_to_metric_families

    url, cfg, metrics_url = capture_server
    capture_store.write_adapt_status(
        cfg.capture.path,
        {
            "at": 1700000000.0,
            "promoted": True,
            "tau": {"traffic": {"before": 1.5, "after": 2.25}, "control": {"before": 2.0, "after": 1.99}},
        },
    )
    chat(url, "one more so the status file is read")

    def samples():
        out = {}
        for fam in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
            for s in fam.samples:
                if s.labels.get("model_name") == "tiny":
                    out[(s.name, s.labels.get("reason"), s.labels.get("domain"), s.labels.get("draft"))] = s.value
        return out

    got = until(
        lambda: (s := samples()).get(("ray_eagleray_adapt_tau", None, "traffic", "candidate")) and s, 60, "adapt τ exported"
    )
    assert got[("ray_eagleray_adapt_tau", None, "traffic", "champion")] == 1.5
    assert got[("ray_eagleray_adapt_promoted", None, None, None)] == 1.0
    assert got[("ray_eagleray_capture_requests_total", None, None, None)] >= 2
    assert got[("ray_eagleray_capture_dropped_total", "buffer_full", None, None)] >= 1
    assert got[("ray_eagleray_capture_bytes_total", None, None, None)] > 0
    assert os.path.isdir(cfg.capture.path)


def test_the_adaptation_command_runs_on_its_schedule(capture_server):
    url, cfg, _ = capture_server
    ticks = Path(cfg.adapt_schedule.command[-1])
    until(lambda: ticks.exists() and len(ticks.read_text()) >= 2, 60, "two scheduled runs")
    assert set(ticks.read_text()) == {"x"}, "the scheduled command got the replica's passive OpenMP setting"
    until(lambda: httpx.get(url + "/health", timeout=30).json()["metrics"].get("adapt_runs_ok", 0) >= 2, 30, "runs counted")


@pytest.mark.parametrize("writer", ["thread", "actor"])
def test_a_replica_whose_writer_cannot_write_refuses_to_start(capture_server, tmp_path, writer):
    from eagleray.platform.errors import EaglerayError
    from eagleray.serve.capture import CaptureClient
    from eagleray.serve.capture_config import CaptureConfig
    from eagleray.serve.prometheus import ServeMetrics

    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(EaglerayError, match=r"^serving\.capture\.path: cannot write captured shards under .*\n    fix:"):
        CaptureClient(CaptureConfig(path=str(afile / "traffic"), writer=writer), {}, ServeMetrics("tiny"))


def _wait_dead(actor, seconds: float = 30.0) -> None:
    """Until a call on ``actor`` fails with RayActorError (the CI's 2 loaded cores once served one call after the kill)."""
    import time

    import ray

    deadline = time.monotonic() + seconds
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass  # dying: ask again
        assert time.monotonic() < deadline, f"the killed capture writer actor still answers after {seconds:.0f} s"
        time.sleep(0.1)


def test_the_actor_writer_stores_rows_and_a_dead_one_fails_the_capture_not_serving(capture_server, tmp_path):
    import asyncio

    import ray

    from eagleray.serve.capture_config import CaptureConfig
    from eagleray.serve.capture_writer import ActorHost, CaptureWriteFailed
    from eagleray.tests.support.capture import META, captured

    host = ActorHost(CaptureConfig(path=str(tmp_path), writer="actor"), META)
    assert host.ready() is None

    async def store():
        assert await host.add(captured(0), "v1") == {"stored": True}
        assert (await host.flush())["rows"] == 1

    async def store_after_death():
        with pytest.raises(CaptureWriteFailed, match="capture writer actor"):
            await host.add(captured(1), "v1")

    asyncio.run(store())
    ray.kill(host.actor)
    _wait_dead(host.actor)  # ray.kill is asynchronous: a call sent before the actor is gone can still be served
    asyncio.run(store_after_death())
    assert [r["prompt_id"] for r in rows_on_disk(tmp_path)] == ["req-0"]
