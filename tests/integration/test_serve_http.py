"""Real Ray Serve on 127.0.0.1: OpenAI client, SSE, 4xx bodies, a small load test with a hot-swap, a refused draft."""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from eagleray.platform.draft_factory import make_random_draft
from eagleray.platform.schemas import ServingConfig
from eagleray.platform.target import TargetSpec

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 128


@pytest.fixture(scope="module")
def drafts(tiny_target, tmp_path_factory):
    spec = TargetSpec.from_dir(tiny_target)
    root = tmp_path_factory.mktemp("drafts")
    return {"d1": make_random_draft(spec, root / "d1", seed=1), "d2": make_random_draft(spec, root / "d2", seed=2),
            "bad": make_random_draft(spec, root / "bad-aux", aux_layer_ids=[1, 4, 99], seed=3)}


@pytest.fixture(scope="module")
def server(tiny_target, drafts):
    from eagleray.serve.local import start_local, stop_local

    cfg = ServingConfig.model_validate({
        "target": {"model": str(tiny_target), "device": "cpu", "max_model_len": CTX},
        "draft": {"source": str(drafts["d1"]), "num_speculative_tokens": 3},
        "model_name": "tiny", "api_key": KEY, "max_num_seqs": 8})
    url = start_local(cfg, num_cpus=2)
    yield url, cfg
    stop_local()


def post(url, path, body, headers=AUTH, timeout=60):
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=raw, headers={**headers, "Content-Type": "application/json"}, timeout=timeout)


def test_openai_client_completion_and_stream(server):
    from eagleray.serve.local import chat, client

    url, cfg = server
    r = client(url, cfg).completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert r.model_extra["eagleray"]["draft_version"] == "d1" and r.model_extra["eagleray"]["num_drafts"] > 0
    plain_text, ext = chat(url, "Explain speculative decoding", cfg, max_tokens=12)
    streamed_text, sext = chat(url, "Explain speculative decoding", cfg, max_tokens=12, stream=True)
    assert streamed_text == plain_text and ext["draft_version"] == sext["draft_version"] == "d1"
    assert sext["tau"] >= 1.0


def test_sse_wire_format(server):
    url, _ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and chunks[-1]["choices"] == []


def test_models_and_health(server):
    url, _ = server
    models = httpx.get(url + "/v1/models", headers=AUTH, timeout=30).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    health = httpx.get(url + "/health", headers=AUTH, timeout=30)
    assert health.status_code == 200 and health.json()["draft_version"] in ("d1", "d2")


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LONG = "word " * (CTX * 2)


@pytest.mark.parametrize("path, body, headers, status, param", [
    ("/v1/chat/completions", b"{not json", AUTH, 400, None),
    ("/v1/chat/completions", {**CHAT, "max_token": 3}, AUTH, 400, "max_token"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "three"}, AUTH, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, AUTH, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": CTX * 10}, AUTH, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, AUTH, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG}]}, AUTH, 400, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": LONG}, AUTH, 400, "prompt"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-17"}, AUTH, 404, "model"),
    ("/v1/chat/completions", CHAT, {}, 401, None),
    ("/v1/chat/completions", CHAT, {"Authorization": "Bearer wrong"}, 401, None),
    ("/admin/draft", {"source": "/nowhere"}, {}, 401, None),
    ("/admin/draft", {"src": "/nowhere"}, AUTH, 400, "source"),
    ("/v1/nothing", CHAT, AUTH, 404, None),
])
def test_bad_input_is_4xx_and_server_keeps_serving(server, path, body, headers, status, param):
    url, _ = server
    r = post(url, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    ok = post(url, "/v1/chat/completions", CHAT)
    assert ok.status_code == 200, ok.text


def _load(url: str, total: int, clients: int, on_halfway) -> dict:
    results, lock, done = [], threading.Lock(), threading.Event()

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": f"request {i} hello", "max_tokens": 6 + i % 7, "temperature": 0.7 * (i % 2),
                "seed": i}
        t0 = time.perf_counter()
        r = post(url, "/v1/completions", body, timeout=120)
        with lock:
            results.append((r.status_code, time.perf_counter() - t0,
                            r.json().get("eagleray", {}).get("draft_version") if r.status_code == 200 else r.text))
            if len(results) == total // 2:
                done.set()

    swapper = threading.Thread(target=lambda: (done.wait(120), on_halfway()))
    swapper.start()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(total)))
    swapper.join()
    return {"results": results}


def test_load_with_hot_swap_loses_nothing(server, drafts):
    url, _ = server
    post(url, "/admin/draft", {"source": str(drafts["d1"])})  # start from d1 whatever ran before
    swap = {}
    out = _load(url, total=128, clients=16,
                on_halfway=lambda: swap.update(post(url, "/admin/draft", {"source": str(drafts["d2"])}, timeout=120).json()))
    codes = [c for c, _, _ in out["results"]]
    lat = sorted(t for _, t, _ in out["results"])
    versions = [v for c, _, v in out["results"] if c == 200]
    print(f"\nload: {len(codes)} requests, 5xx={sum(c >= 500 for c in codes)}, non-200={sum(c != 200 for c in codes)}, "
          f"p50={statistics.median(lat):.3f}s p95={lat[int(0.95 * len(lat)) - 1]:.3f}s max={lat[-1]:.3f}s; swap={swap}")
    assert len(codes) == 128 and all(c == 200 for c in codes), [r for r in out["results"] if r[0] != 200][:3]
    assert swap["outcome"] == "swapped" and swap["version"] == "d2"
    assert "d1" in versions and versions.count("d2") > 0
    status = httpx.get(url + "/admin/draft", headers=AUTH, timeout=30).json()
    assert status["draft_version"] == "d2"


def test_bad_draft_refused_while_serving(server, drafts):
    url, _ = server
    before = httpx.get(url + "/admin/draft", headers=AUTH, timeout=30).json()["draft_version"]
    r = post(url, "/admin/draft", {"source": str(drafts["bad"])}, timeout=120)
    assert r.status_code == 409 and r.json()["error"]["code"] == "refused_guard"
    assert "aux_hidden_state_layer_ids" in r.json()["error"]["message"] and r.json()["error"]["param"] == "source"
    ok = post(url, "/v1/completions", {"model": "tiny", "prompt": "still there?", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["eagleray"]["draft_version"] == before
    health = httpx.get(url + "/health", headers=AUTH, timeout=30).json()
    assert health["metrics"]["swaps_refused_guard"] >= 1


def test_reconfigure_and_rollback(server, drafts):
    from ray import serve

    url, _ = server
    handle = serve.get_deployment_handle("EagleRayEngine", app_name="eagleray")
    handle.reconfigure.remote({"draft": str(drafts["d1"])}).result(timeout_s=120)
    assert httpx.get(url + "/admin/draft", headers=AUTH, timeout=30).json()["draft_version"] == "d1"
    handle.reconfigure.remote({"draft": str(drafts["bad"])}).result(timeout_s=120)  # refused, not raised
    assert httpx.get(url + "/admin/draft", headers=AUTH, timeout=30).json()["draft_version"] == "d1"
    r = post(url, "/admin/rollback", {})
    assert r.status_code == 200 and r.json()["outcome"] == "rolled_back"
    assert post(url, "/v1/chat/completions", CHAT).status_code == 200
