"""Real Ray Serve + a real MLflow registry (sqlite, local artifacts) + Ray's Prometheus export on 127.0.0.1.

One Ray instance for the module, started with a metrics export port and a 1 s metrics report interval:

* the vLLM-named speculative-decoding counters, τ and the draft-version gauge are scraped from
  ``http://127.0.0.1:<port>/metrics`` (the names Ray exports: ``ray_`` prefix, ``_total`` on counters)
  and equal the engine's own counts;
* the alias poller follows ``models:/<name>@champion`` when MlflowClient moves it (no request fails);
* an alias moved to an incompatible draft is refused by the guard and counted; the old draft keeps serving.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from eagleray.platform import registry
from eagleray.platform.draft_factory import make_random_draft
from eagleray.platform.schemas import ServingConfig
from eagleray.platform.target import TargetSpec

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 128
NAME = "tiny-draft"
URI = f"models:/{NAME}@champion"
# The vLLM names (``vllm:spec_decode_*``) as Ray exports them: ':' is not allowed, Ray adds ``ray_``,
# and the Prometheus exporter adds ``_total`` to counters.
VLLM_COUNTERS = ("ray_spec_decode_num_drafts_total", "ray_spec_decode_num_draft_tokens_total",
                 "ray_spec_decode_num_accepted_tokens_total")
PER_POS = "ray_spec_decode_num_accepted_tokens_per_pos_total"
TAU = "ray_eagleray_mean_acceptance_length"
DRAFT_INFO = "ray_eagleray_draft_info"
WATCHDOG = "ray_eagleray_watchdog_state"
TOKENS_PER_S = "ray_eagleray_generation_tokens_per_second"
REQUESTS = "ray_eagleray_requests_total"


def _restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def reg(tiny_target, tmp_path_factory):
    """A sqlite MLflow registry with NAME/1, NAME/2 (random drafts) and NAME/3 (aux layer 99: incompatible)."""
    import mlflow

    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "EAGLERAY_HOME")}
    root = tmp_path_factory.mktemp("registry")
    uri = registry.configure(f"sqlite:///{root / 'mlflow.db'}", experiment="serve-alias")
    spec = TargetSpec.from_dir(tiny_target)
    drafts = [make_random_draft(spec, root / "d1", seed=1), make_random_draft(spec, root / "d2", seed=2),
              make_random_draft(spec, root / "bad", aux_layer_ids=[1, 4, 99], seed=3)]
    versions = []
    for d in drafts:
        with mlflow.start_run() as run:
            mlflow.log_artifacts(str(d), "draft")
        versions.append(registry.register_draft(NAME, run.info.run_id, "draft").version)
    assert versions == ["1", "2", "3"]
    registry.set_alias(NAME, "champion", "1")
    yield uri, root
    _restore_env(saved)


@pytest.fixture(scope="module")
def server(tiny_target, reg):
    """Ray with a Prometheus export port; the app serves models:/NAME@champion and polls the alias every 1 s."""
    import ray

    from eagleray.serve.local import free_port, start_local, stop_local

    tracking_uri, root = reg
    assert not ray.is_initialized()
    # The replica inherits the driver's environment: downloaded drafts go under this module's tmp dir.
    os.environ["EAGLERAY_HOME"] = str(root / "home")
    metrics_port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    cfg = ServingConfig.model_validate({
        "target": {"model": str(tiny_target), "device": "cpu", "max_model_len": CTX},
        "draft": {"source": URI, "num_speculative_tokens": 3},
        "alias_poll_seconds": 1, "mlflow": {"tracking_uri": tracking_uri},
        "model_name": "tiny", "api_key": KEY, "max_num_seqs": 8})
    try:
        url = start_local(cfg, num_cpus=2, timeout_s=180)
        yield url, cfg, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        stop_local()


def chat(url: str, content: str, max_tokens: int = 16) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def health(url: str) -> dict:
    r = httpx.get(url + "/health", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def scrape(metrics_url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """{exported sample name: [(labels, value), ...]} of the app's series."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for s in family.samples:
            if s.labels.get("model_name") == "tiny":
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def total(samples: dict, name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


def until(fn, timeout_s: float, what: str, every: float = 0.5):
    """Poll ``fn`` until it returns a truthy value; fail with ``what`` and the last value."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"{what} within {timeout_s:.0f}s; last: {last!r}")


def test_prometheus_export_has_vllm_spec_decode_counters(server):
    url, _, metrics_url = server
    exts = []
    for i, prompt in enumerate(("Explain speculative decoding", "hello world", "write code", "the quick brown fox")):
        r = chat(url, prompt, max_tokens=24)
        assert r.status_code == 200, r.text
        exts.append(r.json()["eagleray"])
    assert sum(e["num_drafts"] for e in exts) > 0 and sum(e["num_draft_tokens"] for e in exts) > 0
    own = health(url)["metrics"]  # the replica's own totals (every request of this module so far)
    want = {name: own.get(name.removeprefix("ray_").removesuffix("_total"), 0) for name in VLLM_COUNTERS}

    def exported():
        s = scrape(metrics_url)
        return s if all(total(s, n) == v for n, v in want.items()) and total(s, REQUESTS) >= len(exts) else None

    s = until(exported, 60, f"Prometheus counters equal to the engine's own {want}")
    drafts, proposed, accepted = (total(s, n) for n in VLLM_COUNTERS)
    print(f"\nexported: {sorted(s)}\ndrafts={drafts} draft_tokens={proposed} accepted={accepted}")
    assert drafts > 0 and proposed >= drafts and proposed > 0 and accepted > 0
    assert accepted <= proposed and proposed <= 3 * drafts  # k=3 draft tokens per verification at most
    if PER_POS in s:  # per position: only positions that accepted something have a series
        assert total(s, PER_POS) == accepted
        assert {lbl["position"] for lbl, _ in s[PER_POS]} <= {"0", "1", "2"}
    else:
        assert accepted == 0
    labels = s[VLLM_COUNTERS[0]][0][0]
    assert labels["application"] == "eagleray" and labels["deployment"] == "EagleRayEngine"
    (tau_labels, tau), = s[TAU]
    assert 1.0 <= tau <= 4.0 and tau == pytest.approx(own["tau"])  # the gauge is the replica's own τ
    assert total(s, TOKENS_PER_S) > 0 and s[WATCHDOG][0][1] in (0, 1, 2, 3)
    serving = {lbl["draft_version"] for lbl, v in s[DRAFT_INFO] if v == 1}
    assert serving == {exts[-1]["draft_version"]} == {f"{NAME}/1"}


def _background_requests(url: str, stop: threading.Event, results: list) -> threading.Thread:
    def loop() -> None:
        i = 0
        while not stop.is_set():
            r = chat(url, f"request {i} hello", max_tokens=8)
            results.append((r.status_code, r.json()["eagleray"]["draft_version"] if r.status_code == 200 else r.text))
            i += 1

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def test_alias_poller_hot_swaps_when_the_alias_moves(server):
    from mlflow import MlflowClient

    url, cfg, metrics_url = server
    registry.set_alias(NAME, "champion", "1")
    until(lambda: health(url)["draft_version"] == f"{NAME}/1", 30, "serving version 1")
    results: list = []
    stop = threading.Event()
    worker = _background_requests(url, stop, results)
    try:
        until(lambda: len(results) >= 2, 60, "requests before the move")
        MlflowClient(tracking_uri=cfg.mlflow.tracking_uri).set_registered_model_alias(NAME, "champion", "2")
        h = until(lambda: (lambda h: h if h["draft_version"] == f"{NAME}/2" else None)(health(url)), 30,
                  "the poller moving to version 2")
        n = len(results)
        until(lambda: len(results) >= n + 2, 60, "requests after the move")
    finally:
        stop.set()
        worker.join(60)
    codes = [c for c, _ in results]
    versions = [v for c, v in results if c == 200]
    assert all(c == 200 for c in codes), [r for r in results if r[0] != 200][:3]
    assert versions[0] == f"{NAME}/1" and versions[-1] == f"{NAME}/2"
    first_v2 = versions.index(f"{NAME}/2")
    assert set(versions[first_v2:]) == {f"{NAME}/2"}  # sequential requests: once swapped, never back
    swap = [r for r in h["history"] if r["outcome"] == "swapped"][-1]
    assert swap["source"] == URI and swap["version"] == f"{NAME}/2"
    assert chat(url, "after the swap").json()["eagleray"]["draft_version"] == f"{NAME}/2"
    models = httpx.get(url + "/v1/models", headers=AUTH, timeout=30).json()
    assert models["data"][0]["draft_version"] == f"{NAME}/2"

    def gauge_moved():
        s = scrape(metrics_url)
        info = {lbl["draft_version"]: v for lbl, v in s.get(DRAFT_INFO, [])}
        return info if info.get(f"{NAME}/2") == 1 and info.get(f"{NAME}/1", 0) == 0 else None

    until(gauge_moved, 30, f"{DRAFT_INFO} reporting version 2")


def test_alias_moved_to_incompatible_draft_is_refused_and_counted(server):
    from mlflow import MlflowClient

    url, cfg, _ = server
    before = health(url)
    serving = before["draft_version"]
    assert serving in (f"{NAME}/1", f"{NAME}/2")
    refused_before = before["metrics"].get("swaps_refused_guard", 0)
    MlflowClient(tracking_uri=cfg.mlflow.tracking_uri).set_registered_model_alias(NAME, "champion", "3")
    h = until(lambda: (lambda h: h if h["metrics"].get("swaps_refused_guard", 0) > refused_before else None)(health(url)),
              30, "the guard refusing version 3")
    rec = [r for r in h["history"] if r["outcome"] == "refused_guard"][-1]
    assert rec["source"] == URI and "aux_hidden_state_layer_ids" in rec["message"]
    assert h["draft_version"] == serving
    r = chat(url, "still there?")
    assert r.status_code == 200 and r.json()["eagleray"]["draft_version"] == serving
    time.sleep(3)  # three more polls: a refused version is not retried until the alias moves again
    after = health(url)
    assert after["metrics"]["swaps_refused_guard"] == refused_before + 1 and after["draft_version"] == serving
