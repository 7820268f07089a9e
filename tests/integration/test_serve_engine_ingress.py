"""``serving.ingress: engine`` on real Ray Serve over HTTP: the OpenAI routes run in the engine's replica.

One deployment serves the routes (auth, 4xx bodies, SSE) and takes the engine's Serve hooks: a
``reconfigure`` (what a ``serve deploy`` with a new draft does) hot-swaps the draft, and a client that
leaves mid-stream frees its sequence (the engine stops generating for it).
"""

from __future__ import annotations

import json

import httpx
import pytest

from eagleray.serve.serving_config import ServingConfig
from eagleray.tests.support.http import (
    check_abandoned_stream_stops,
    check_serving_then_rollback,
    engine_ingress_serving,
    get,
    post,
    sse_events,
)

CTX = 256


@pytest.fixture(scope="module")
def server(tiny_target, tiny_drafts):
    from eagleray.serve.local import start_local
    from eagleray.tests.support.cluster import stop_local_ray

    cfg = ServingConfig.model_validate(engine_ingress_serving(tiny_target, tiny_drafts["d1"], CTX))
    url = start_local(cfg, num_cpus=2)
    yield url, cfg
    stop_local_ray()


def test_one_replica_serves_the_routes_and_the_engine(server):
    import ray

    from eagleray.serve.local import chat

    url, cfg = server
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    assert len(names) == 1 and "EagleRayEngine" in names[0], names
    text, ext = chat(url, "Explain speculative decoding", cfg, max_tokens=12)
    streamed, sext = chat(url, "Explain speculative decoding", cfg, max_tokens=12, stream=True)
    assert text == streamed and ext["draft_version"] == sext["draft_version"] == "d1" and sext["tau"] >= 1.0
    code, events = sse_events(url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True})
    assert code == 200 and events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    long = post(url, "/v1/completions", {"model": "tiny", "prompt": "word " * CTX, "max_tokens": 4})
    assert long.status_code == 400 and json.loads(long.text)["error"]["code"] == "context_length_exceeded"
    assert httpx.get(url + "/admin/draft", timeout=30).status_code == 401, "admin routes need the key here too"
    assert get(url, "/v1/models").json()["data"][0]["id"] == "tiny" and get(url, "/health").json()["status"] == "ok"


def test_reconfigure_reaches_the_engine(server, tiny_drafts):
    from ray import serve

    url, _ = server
    handle = serve.get_deployment_handle("EagleRayEngine", app_name="eagleray")
    handle.reconfigure.remote({"draft": str(tiny_drafts["d2"])}).result(timeout_s=120)
    assert get(url, "/admin/draft").json()["draft_version"] == "d2"
    check_serving_then_rollback(url, "d2", "d1")


def test_a_client_that_leaves_mid_stream_frees_its_sequence(server):
    url, _ = server
    check_abandoned_stream_stops(url, CTX - 16)
