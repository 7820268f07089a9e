"""Real Ray Serve on 127.0.0.1: OpenAI client, SSE, 4xx bodies, a small load test with a hot-swap, a refused draft.

Every error body this module receives (JSON and SSE ``error`` events) goes through :func:`clean`: no
traceback, Ray task error, file path, pid or ANSI escape may reach a client.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.serve.serving_config import ServingConfig
from eagleray.tests.support.http import AUTH, ERROR_BODIES, KEY, clean, get, post, sse_events

CTX = 128


@pytest.fixture(scope="module")
def drafts(tiny_target, tmp_path_factory):
    spec = TargetSpec.from_dir(tiny_target)
    root = tmp_path_factory.mktemp("drafts")
    return {
        "d1": make_random_draft(spec, root / "d1", seed=1),
        "d2": make_random_draft(spec, root / "d2", seed=2),
        "bad": make_random_draft(spec, root / "bad-aux", aux_layer_ids=[1, 4, 99], seed=3),
        "other-aux": make_random_draft(spec, root / "other-aux", aux_layer_ids=[1, 3, 6], seed=4),
    }


@pytest.fixture(scope="module")
def server(tiny_target, drafts):
    from eagleray.serve.local import start_local
    from eagleray.tests.support.cluster import stop_local_ray

    cfg = ServingConfig.model_validate(
        {
            "target": {"model": str(tiny_target), "device": "cpu", "max_model_len": CTX},
            "draft": {
                "source": str(drafts["d1"]),
                "num_speculative_tokens": 3,
                "policy": {"adaptive": False},
            },  # the tests count drafts
            "model_name": "tiny",
            "api_key": KEY,
            "max_num_seqs": 8,
        }
    )
    url = start_local(cfg, num_cpus=2)
    yield url, cfg
    stop_local_ray()


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
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
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
    health = get(url, "/health")
    assert health.status_code == 200 and health.json()["draft_version"] in ("d1", "d2")
    assert not any(k in health.json() for k in ("draft_path", "target", "history")), "server paths stay off /health"


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMP = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
LONG = "word " * (CTX * 2)
SURROGATE = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}'


@pytest.mark.parametrize(
    "path, body, headers, status, param",
    [
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
        # the probes of issue 17: each was a 500 with a traceback (or worse) before
        ("/v1/chat/completions", SURROGATE, AUTH, 400, "messages.0.content"),
        (
            "/v1/chat/completions",
            SURROGATE.replace(b'"max_tokens": 4', b'"max_tokens": 4, "stream": true'),
            AUTH,
            400,
            "messages.0.content",
        ),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a\\udfffb"}', AUTH, 400, "prompt"),
        ("/v1/chat/completions", {**CHAT, "seed": 2**64}, AUTH, 400, "seed"),
        ("/v1/chat/completions", {**CHAT, "seed": 2**64, "stream": True}, AUTH, 400, "seed"),
        ("/v1/chat/completions", {**CHAT, "top_k": 2**63}, AUTH, 400, "top_k"),
        ("/v1/completions", {**COMP, "top_k": 2**63, "stream": True}, AUTH, 400, "top_k"),
        ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, AUTH, 400, "temperature"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 2**64}, AUTH, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 2**40}, AUTH, 400, "max_tokens"),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": NaN}',
            AUTH,
            400,
            None,
        ),
        ("/v1/chat/completions", b"[" * 50_000 + b"]" * 50_000, AUTH, 400, None),
        ("/v1/chat/completions", b"\xff\xfe\x00\xd8", AUTH, 400, None),
        ("/v1/completions", {**COMP, "prompt": [1, 2, 10**12]}, AUTH, 400, "prompt"),
        ("/v1/completions", {**COMP, "prompt": [1, -1]}, AUTH, 400, "prompt"),
        ("/v1/completions", {**COMP, "stop_token_ids": [10**6]}, AUTH, 400, "stop_token_ids"),
        ("/v1/completions", {**COMP, "repetition_penalty": 1.3}, AUTH, 400, "repetition_penalty"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True}, AUTH, 400, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "store": True}, AUTH, 400, "store"),  # capture is off here
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, AUTH, 400, "messages.0.content"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, AUTH, 400, "messages.0.role"),
    ],
)
def test_bad_input_is_4xx_and_server_keeps_serving(server, path, body, headers, status, param):
    url, _ = server
    r = post(url, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    if param is not None:
        assert param in err["message"], err
    ok = post(url, "/v1/chat/completions", CHAT)
    assert ok.status_code == 200, ok.text


def _at_defaults(table: dict) -> dict:
    """Every field of the table at a non-null default (null is tested in tests/unit/serve/test_protocol.py)."""
    return {name: next((d for d in defaults if d is not None), None) for name, (defaults, _) in table.items()}


def test_every_openai_field_at_its_default_is_served(server):
    """vLLM's load generator failed 32/32 on `repetition_penalty: 1.0` and `logprobs: null`: every field at its default is a 200."""
    from eagleray.serve.local import client
    from eagleray.serve.protocol import CHAT_DEFAULT_ONLY, COMPLETION_DEFAULT_ONLY

    url, cfg = server
    extra = {
        "n": 1,
        "user": "u1",
        "metadata": {"k": "v"},
        "seed": 7,
        "top_k": -1,
        "stop_token_ids": [],
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    }
    r = post(
        url,
        "/v1/chat/completions",
        {
            **CHAT,
            **_at_defaults(CHAT_DEFAULT_ONLY),
            **extra,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": None, "refusal": None},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
            ],
        },
    )
    assert r.status_code == 200, r.text
    r = post(url, "/v1/completions", {**COMP, **_at_defaults(COMPLETION_DEFAULT_ONLY), **extra})
    assert r.status_code == 200, r.text
    c = client(url, cfg)
    out = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        frequency_penalty=0,
        presence_penalty=0,
        logprobs=False,
        top_logprobs=0,
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        store=False,
        seed=3,
        stop=None,
        temperature=None,
        top_p=None,
        extra_body={"repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [0]},
    )
    assert out.choices[0].finish_reason in ("length", "stop")


def test_vllm_benchmark_client(server, monkeypatch):
    """vLLM's own load generator (its default backend is completions; chat too) against eagleray."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_chat_completions,
        async_request_openai_completions,
    )

    url, _ = server
    monkeypatch.setenv("OPENAI_API_KEY", KEY)

    def request(prompt: str, route: str) -> RequestFuncInput:
        return RequestFuncInput(prompt=prompt, api_url=url + route, prompt_len=3, output_len=6, model="tiny", ignore_eos=True)

    async def run():
        async with aiohttp.ClientSession() as session:
            comp = [async_request_openai_completions(request(f"hello {i}", "/v1/completions"), session) for i in range(4)]
            chat = async_request_openai_chat_completions(request("hello", "/v1/chat/completions"), session)
            return await asyncio.gather(*comp, chat)

    outs = asyncio.run(run())
    assert all(o.success for o in outs), [o.error for o in outs if not o.success]
    assert all(o.output_tokens == 6 and o.ttft > 0 for o in outs), [(o.output_tokens, o.ttft) for o in outs]


def _load(url: str, total: int, clients: int, on_halfway) -> dict:
    results, lock, done = [], threading.Lock(), threading.Event()

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": f"request {i} hello", "max_tokens": 6 + i % 7, "temperature": 0.7 * (i % 2), "seed": i}
        t0 = time.perf_counter()
        r = post(url, "/v1/completions", body, timeout=120)
        with lock:
            results.append(
                (
                    r.status_code,
                    time.perf_counter() - t0,
                    r.json().get("eagleray", {}).get("draft_version") if r.status_code == 200 else r.text,
                )
            )
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
    out = _load(
        url,
        total=128,
        clients=16,
        on_halfway=lambda: swap.update(post(url, "/admin/draft", {"source": str(drafts["d2"])}, timeout=120).json()),
    )
    codes = [c for c, _, _ in out["results"]]
    lat = sorted(t for _, t, _ in out["results"])
    versions = [v for c, _, v in out["results"] if c == 200]
    print(
        f"\nload: {len(codes)} requests, 5xx={sum(c >= 500 for c in codes)}, non-200={sum(c != 200 for c in codes)}, "
        f"p50={statistics.median(lat):.3f}s p95={lat[int(0.95 * len(lat)) - 1]:.3f}s max={lat[-1]:.3f}s; swap={swap}"
    )
    assert len(codes) == 128 and all(c == 200 for c in codes), [r for r in out["results"] if r[0] != 200][:3]
    assert swap["outcome"] == "swapped" and swap["version"] == "d2"
    assert "d1" in versions and versions.count("d2") > 0
    status = get(url, "/admin/draft").json()
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


def _admin(url: str) -> dict:
    return get(url, "/admin/draft").json()


def _aux_of(draft) -> list[int]:
    return json.loads((draft / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def test_rollback_restores_the_previous_drafts_aux_layers(server, drafts):
    """Two drafts that read different target layers: a rollback must capture the previous draft's layers again."""
    url, _ = server
    assert _aux_of(drafts["d1"]) != _aux_of(drafts["other-aux"])
    assert post(url, "/admin/draft", {"source": str(drafts["d1"])}, timeout=120).json()["outcome"] in ("swapped", "unchanged")
    greedy = {**COMP, "prompt": "the aux layers", "max_tokens": 12, "temperature": 0}
    before = post(url, "/v1/completions", greedy).json()["choices"][0]["text"]
    r = post(url, "/admin/draft", {"source": str(drafts["other-aux"])}, timeout=120)
    assert r.status_code == 200 and r.json()["outcome"] == "swapped", r.text
    assert _admin(url)["aux_layer_ids"] == _aux_of(drafts["other-aux"])
    r = post(url, "/admin/rollback", {})
    assert r.status_code == 200 and r.json()["outcome"] == "rolled_back", r.text
    status = _admin(url)
    assert status["draft_version"] == "d1" and status["aux_layer_ids"] == _aux_of(drafts["d1"]), status
    after = post(url, "/v1/completions", greedy).json()
    assert after["choices"][0]["text"] == before and after["eagleray"]["draft_version"] == "d1"


def _admin_routes() -> list[tuple[str, str]]:
    from eagleray.serve.ingress import app

    routes = sorted((m, r.path) for r in app.routes if getattr(r, "path", "").startswith("/admin") for m in r.methods)
    assert {("GET", "/admin/draft"), ("POST", "/admin/draft"), ("POST", "/admin/rollback")} <= set(routes), routes
    return routes


@pytest.fixture(scope="module")
def open_url(server):
    """A second ingress with no api_key, in front of the same engine deployment (route prefix /open)."""
    from ray import serve

    from eagleray.serve.app import ingress_deployment
    from eagleray.serve.local import wait_ready

    url, cfg = server
    open_cfg = cfg.model_copy(update={"api_key": None})
    engine = serve.get_deployment_handle("EagleRayEngine", app_name="eagleray")
    serve.run(
        ingress_deployment(open_cfg).bind(engine, open_cfg.model_dump(mode="json")),
        name="eagleray-open",
        route_prefix="/open",
        blocking=False,
    )
    wait_ready(url + "/open", None, 120)
    return url + "/open"  # no serve.delete (a 2 s graceful stop): it ends with the module's Ray (server)


@pytest.mark.parametrize("method, path", _admin_routes())
def test_every_admin_route_is_closed(server, open_url, method, path):
    """Without an api_key the admin routes are off (403); with one they need it (401 without, 401 wrong)."""
    url, _ = server
    body = {"source": "/nowhere"} if method == "POST" else None
    for base, headers, status in (
        (open_url, {}, 403),
        (open_url, AUTH, 403),
        (url, {}, 401),
        (url, {"Authorization": "Bearer wrong"}, 401),
    ):
        r = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
        assert r.status_code == status, (base, path, r.text)
        clean(r.text)
    assert get(open_url, "/v1/models", headers={}).status_code == 200  # the open API itself serves


def test_health_answers_fast_with_64_long_requests_queued(server):
    """/health stalled 16-30 s behind 64 long prompts (it queued on the engine handle); its token rate was 100x off."""
    url, _ = server
    body = {**COMP, "prompt": "a long answer please", "max_tokens": 96, "ignore_eos": True, "temperature": 0}
    results: list[httpx.Response] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(72) as pool:
        futures = [pool.submit(post, url, "/v1/completions", body, AUTH, 600) for _ in range(72)]
        time.sleep(3)  # every request is in: 72 in flight on an engine taking 64 at a time and 8 sequences per step
        waits = []
        for _ in range(5):
            t = time.perf_counter()
            r = get(url, "/health")
            waits.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
            time.sleep(0.3)
        results = [f.result() for f in futures]
    elapsed = time.perf_counter() - t0
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200][:2]
    print(f"\nhealth under load: waits {[round(w, 3) for w in waits]} s; 72 requests in {elapsed:.1f}s")
    assert max(waits) < 1.0, waits
    health = get(url, "/health").json()
    made = sum(r.json()["usage"]["completion_tokens"] for r in results)
    m = health["metrics"]  # the rate is over the last 30 s, which may hold the tests' traffic before this load
    assert m["window_tokens"] <= health["engine"]["generation_tokens"] and m["window_s"] >= 0.9 * min(elapsed, 30.0), m
    assert made <= m["window_tokens"] or elapsed > 29.0, (m, made)  # every token of the load counted once
    assert m["tokens_per_s"] == pytest.approx(m["window_tokens"] / m["window_s"]), m
    assert 0.5 * made / max(elapsed, 30.0) <= m["tokens_per_s"] <= 1.5 * made / elapsed, (m, made, elapsed)


def test_error_bodies_were_checked():
    """The checks above ran over this module's error bodies (400s, 401/403/404/409s, SSE error events)."""
    assert len(ERROR_BODIES) >= 40, len(ERROR_BODIES)


def _health_states(url: str, stop: threading.Event, states: list) -> None:
    """/health's status every 0.2 s until ``stop``, then until it answers ok again (3 minutes at most)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        r = get(url, "/health", timeout=10)
        states.append(r.json().get("status"))
        if stop.is_set() and r.status_code == 200:
            return
        time.sleep(0.2)


def test_the_cpu_replica_runs_with_passive_openmp_workers(server):
    """The replica's own process has GOMP_SPINCOUNT=0 (ServingConfig.cpu_omp_passive), set by Ray at its start."""
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EagleRayEngine" in a["name"]]
    replica = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    assert ray.get(replica.__ray_call__.remote(lambda self: os.environ.get("GOMP_SPINCOUNT"))) == "0"


def test_engine_replica_killed_mid_stream_gives_a_clean_retryable_error(server):
    """SIGKILL of the engine replica: in-flight streams get a clean 503-style error event (never a silently cut
    answer), /health says restarting meanwhile, Serve restarts the replica and the next request succeeds.
    Last in the module: it restarts the engine."""
    import ray

    url, _ = server
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EagleRayEngine" in a["name"]]
    assert len(names) == 1, names
    replica = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    pids = [ray.get(replica.__ray_call__.remote(lambda self: os.getpid()))]
    body = {**COMP, "prompt": "stream me", "max_tokens": 110, "ignore_eos": True, "stream": True}
    stop, states, started = threading.Event(), [], threading.Semaphore(0)
    with ThreadPoolExecutor(13) as pool:  # 12 streams of 110 tokens, 8 sequences per step
        streams = [pool.submit(sse_events, url, "/v1/completions", body, on_first=started.release) for _ in range(12)]
        assert all(started.acquire(timeout=120) for _ in range(8)), "the first 8 streams did not start"
        os.kill(pids[0], signal.SIGKILL)  # as soon as 8 are streaming: they have ~100 tokens to go, 4 wait to start
        health = pool.submit(_health_states, url, stop, states)  # from the kill until the replica is back
        outs = [f.result() for f in streams]
        stop.set()
        health.result()
    for code, events in outs:  # a 503 before the first token, or a stream ending with its last token or an error
        if code == 503:
            assert events[0]["error"]["code"] == "engine_unavailable", events
            continue
        assert code == 200 and events[-1] == "[DONE]", (code, events[-3:])
        assert "error" in events[-2] or events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
    errors = [e["error"] for _, events in outs for e in events if isinstance(e, dict) and "error" in e]
    print(f"\nkilled mid-stream: {[(code, len(ev)) for code, ev in outs]}; errors {errors[:2]}; health {states}")
    assert errors and all(e["code"] == "engine_unavailable" and e["type"] == "server_error" for e in errors), errors
    assert "restarting" in states and states[-1] == "ok", states
    ok = post(url, "/v1/chat/completions", CHAT, timeout=120)
    assert ok.status_code == 200, ok.text
