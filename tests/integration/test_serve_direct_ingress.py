"""``serving.direct_port`` through ``eagleray serve`` on real Ray Serve: the engine's replica answers HTTP on its own
port (Ray Serve's direct ingress) with everything the proxy's port gives: the routes, their 4xx bodies and auth,
SSE streaming, a draft hot-swap and rollback through the admin routes, and a client leaving mid-stream freeing its
sequence, a request captured as a training row, and the replica's metrics (what Ray exports as /metrics) counting
what it served. ``python -m eagleray.jobs.serve`` runs in a subprocess: Ray's processes start with the environment it
sets, as a user's would (this test process's Ray, if any, is untouched)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from eagleray.platform.host import free_port
from eagleray.tests.support.http import (
    check_abandoned_stream_stops,
    check_serving_then_rollback,
    engine_ingress_serving,
    get,
    post,
    sse_events,
)

CTX = 496  # the tiny target's 512 positions less a margin: an abandoned stream has room to be noticed


@pytest.fixture(scope="module")
def server(tiny_target, tiny_drafts, tmp_path_factory):
    work = tmp_path_factory.mktemp("direct")
    port, direct = free_port(), free_port()
    serving = engine_ingress_serving(tiny_target, tiny_drafts["d1"], CTX) | {
        "port": port,
        "direct_port": direct,
        "capture": {"path": str(work / "traffic"), "rate": 1.0, "flush_seconds": 1},
    }
    (work / "serving.yaml").write_text(yaml.safe_dump(serving))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = open(work / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagleray.jobs.serve", "--config", str(work / "serving.yaml")],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url, deadline = f"http://127.0.0.1:{direct}", time.monotonic() + 180
    try:
        while "serving 'tiny' at " + url not in (work / "serve.log").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"eagleray serve did not come up on {url}:\n{(work / 'serve.log').read_text()[-4000:]}")
            time.sleep(1)
        yield url, f"http://127.0.0.1:{port}", work / "traffic"
    finally:
        proc.send_signal(signal.SIGTERM)  # eagleray serve stops Serve and Ray on SIGTERM
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_the_replicas_own_port_serves_the_routes_and_streams(server):
    url, proxy, _ = server
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Explain speculative decoding"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = post(url, "/v1/chat/completions", body)
    assert whole.status_code == 200 and whole.json()["eagleray"]["draft_version"] == "d1"
    code, events = sse_events(url, "/v1/chat/completions", {**body, "stream": True})
    assert code == 200 and events[-1] == "[DONE]"
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert streamed == whole.json()["choices"][0]["message"]["content"]
    long = post(url, "/v1/completions", {"model": "tiny", "prompt": "word " * CTX, "max_tokens": 4})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(url + "/admin/draft", timeout=30).status_code == 401, "admin routes need the key here too"
    assert get(url, "/v1/models").json()["data"][0]["id"] == "tiny" and get(url, "/health").json()["status"] == "ok"
    assert get(proxy, "/v1/models").status_code == 200, "Serve's proxy still answers on serving.port"


def test_hot_swap_and_rollback_through_the_replicas_own_port(server, tiny_drafts):
    url, _, _ = server
    assert post(url, "/admin/draft", {"source": str(tiny_drafts["d2"])}, timeout=120).json()["outcome"] == "swapped"
    check_serving_then_rollback(url, "d2", "d1")


def test_a_client_that_leaves_mid_stream_frees_its_sequence(server):
    url, _, _ = server
    check_abandoned_stream_stops(url, CTX - 16)


def test_a_request_through_the_replicas_own_port_is_captured_and_counted(server):
    import pyarrow.parquet as pq

    from eagleray.platform import capture_store

    url, _, traffic = server
    before = get(url, "/health").json()["metrics"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "capture me"}], "max_tokens": 6, "temperature": 0}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200
    answer, deadline, found = r.json()["choices"][0]["message"]["content"], time.monotonic() + 60, False
    while not found and time.monotonic() < deadline:  # the module's earlier requests are captured too: wait for this one
        time.sleep(0.5)
        rows = [row for s in capture_store.list_shards(traffic) for row in pq.read_table(s.path).to_pylist()]
        found = any(row["response"] == answer for row in rows)
    assert found, [row["response"] for row in rows]
    after = get(url, "/health").json()["metrics"]
    assert after["requests"] > before.get("requests", 0) and after["capture_requests"] > before.get("capture_requests", 0)
