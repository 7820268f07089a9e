"""Real Ray Serve + a real MLflow registry (sqlite, local artifacts) + Ray's Prometheus export on 127.0.0.1.

One Ray instance for the module, started with a metrics export port and a 1 s metrics report interval:

The target is the tiny random Llama with its final norm zeroed (all logits 0, so greedy decoding always
emits token 0) and version 1 is a draft with its final norm zeroed (it always proposes token 0): every
draft token is accepted (τ = k + 1), so the acceptance counters are non-zero. Version 2 is an untrained
random draft (τ ≈ 1), so a hot-swap shows in τ, not only in the version label.

* the vLLM-named speculative-decoding counters, τ and the draft-version gauge are scraped from
  ``http://127.0.0.1:<port>/metrics`` (the names Ray exports: ``ray_`` prefix, ``_total`` on counters)
  and equal the engine's own counts;
* the alias poller follows ``models:/<name>@champion`` when MlflowClient moves it (no request fails);
* an alias moved to an incompatible draft is refused by the guard and counted; the old draft keeps serving.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from eagleray.platform import registry
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.serve.serving_config import ServingConfig
from eagleray.tests.support.tiny import zero_tensor

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 128
K = 3  # draft tokens per verification step
NAME = "tiny-draft"
URI = f"models:/{NAME}@champion"
# The vLLM names (``vllm:spec_decode_*``) as Ray exports them: ':' is not allowed, Ray adds ``ray_``,
# and the Prometheus exporter adds ``_total`` to counters.
VLLM_COUNTERS = (
    "ray_spec_decode_num_drafts_total",
    "ray_spec_decode_num_draft_tokens_total",
    "ray_spec_decode_num_accepted_tokens_total",
)
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
def constant_target(tiny_target, tmp_path_factory) -> Path:
    """The tiny target with ``model.norm.weight`` = 0: every logit is 0, greedy decoding emits token 0."""
    out = tmp_path_factory.mktemp("constant") / "target"
    shutil.copytree(tiny_target, out)
    zero_tensor(out, "model.norm.weight")
    return out


@pytest.fixture(scope="module")
def reg(constant_target, tmp_path_factory):
    """A sqlite MLflow registry: NAME/1 always proposes token 0 (τ = 4), NAME/2 is random (τ ≈ 1),
    NAME/3 reads target layer 99 (incompatible); champion -> 1."""
    import mlflow

    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "EAGLERAY_HOME")}
    root = tmp_path_factory.mktemp("registry")
    uri = registry.configure(f"sqlite:///{root / 'mlflow.db'}", experiment="serve-alias")
    spec = TargetSpec.from_dir(constant_target)
    drafts = [
        make_random_draft(spec, root / "d1", seed=1),
        make_random_draft(spec, root / "d2", seed=2),
        make_random_draft(spec, root / "bad", aux_layer_ids=[1, 4, 99], seed=3),
    ]
    zero_tensor(drafts[0], "norm.weight")
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
def server(constant_target, reg):
    """Ray with a Prometheus export port; the app serves models:/NAME@champion and polls the alias every 1 s."""
    from eagleray.serve.local import start_local
    from eagleray.tests.support.cluster import init_ray_with_metrics, stop_local_ray

    tracking_uri, root = reg
    # The replica inherits the driver's environment: downloaded drafts go under this module's tmp dir.
    os.environ["EAGLERAY_HOME"] = str(root / "home")
    metrics_port = init_ray_with_metrics()
    cfg = ServingConfig.model_validate(
        {
            "target": {"model": str(constant_target), "device": "cpu", "max_model_len": CTX},
            "draft": {"source": URI, "num_speculative_tokens": K, "policy": {"adaptive": False}},
            "alias_poll_seconds": 1,
            "mlflow": {"tracking_uri": tracking_uri},
            "model_name": "tiny",
            "api_key": KEY,
            "max_num_seqs": 8,
        }
    )
    try:
        url = start_local(cfg, num_cpus=2, timeout_s=180)
        yield url, cfg, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        stop_local_ray()


def chat(url: str, content: str, max_tokens: int = 16) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def health(url: str) -> dict:
    r = httpx.get(url + "/health", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def swap_history(url: str) -> list[dict]:
    """The swap records (admin route: they name sources and server paths, which stay off /health)."""
    r = httpx.get(url + "/admin/draft", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["history"]


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


def move_alias(cfg: ServingConfig, version: str) -> None:
    """MlflowClient on the served registry (not the process-wide tracking URI another test may have moved)."""
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=cfg.mlflow.tracking_uri).set_registered_model_alias(NAME, "champion", version)


def serving_version(url: str, cfg: ServingConfig, version: str) -> None:
    move_alias(cfg, version)  # whatever an earlier test left: the poller follows
    until(lambda: health(url)["draft_version"] == f"{NAME}/{version}", 30, f"serving version {version}")


def test_prometheus_export_has_vllm_spec_decode_counters(server):
    url, cfg, metrics_url = server
    serving_version(url, cfg, "1")
    exts = []
    for prompt in ("Explain speculative decoding", "hello world", "write code", "the quick brown fox"):
        r = chat(url, prompt, max_tokens=24)
        assert r.status_code == 200, r.text
        exts.append(r.json()["eagleray"])
    assert all(
        e["num_drafts"] > 0
        and e["num_accepted_tokens"] == e["num_draft_tokens"] == K * e["num_drafts"]
        and e["tau"] == K + 1
        and e["draft_version"] == f"{NAME}/1"
        for e in exts
    ), exts
    own = health(url)["metrics"]  # the replica's own totals (every request of this module so far)
    want = {name: own.get(name.removeprefix("ray_").removesuffix("_total"), 0) for name in VLLM_COUNTERS}

    def exported():  # Ray exports every second here (metrics_report_interval_ms=1000)
        s = scrape(metrics_url)
        return s if all(total(s, n) == v for n, v in want.items()) and total(s, REQUESTS) == own["requests"] else None

    s = until(exported, 60, f"Prometheus counters equal to the engine's own {want}")
    drafts, proposed, accepted = (total(s, n) for n in VLLM_COUNTERS)
    print(
        f"\nexported: {sorted(s)}\nlabels: {sorted(s[VLLM_COUNTERS[0]][0][0])}\n"
        f"drafts={drafts} draft_tokens={proposed} accepted={accepted}"
    )
    assert drafts >= sum(e["num_drafts"] for e in exts) and accepted >= sum(e["num_accepted_tokens"] for e in exts)
    assert 0 < accepted <= proposed <= K * drafts
    per_pos = {lbl["position"]: v for lbl, v in s[PER_POS]}
    assert set(per_pos) <= {str(i) for i in range(K)} and per_pos["0"] > 0 and sum(per_pos.values()) == accepted
    labels = s[VLLM_COUNTERS[0]][0][0]
    assert labels["application"] == "eagleray" and labels["deployment"] == "EagleRayEngine"
    ((_, tau),) = s[TAU]
    assert tau == pytest.approx(own["tau"]) and 1.0 < tau <= K + 1  # the replica's τ over its recent window
    assert total(s, TOKENS_PER_S) > 0 and s[WATCHDOG][0][1] == 0  # watchdog ok
    assert {lbl["draft_version"] for lbl, v in s[DRAFT_INFO] if v == 1} == {f"{NAME}/1"}


def _background_requests(url: str, stop: threading.Event, results: list) -> threading.Thread:
    def loop() -> None:
        i = 0
        while not stop.is_set():
            r = chat(url, f"request {i} hello", max_tokens=8)
            ext = r.json()["eagleray"] if r.status_code == 200 else {}
            results.append((r.status_code, ext.get("draft_version", r.text), ext.get("tau")))
            i += 1

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def test_alias_poller_hot_swaps_when_the_alias_moves(server):
    url, cfg, metrics_url = server
    serving_version(url, cfg, "1")
    results: list = []
    stop = threading.Event()
    worker = _background_requests(url, stop, results)
    try:
        until(lambda: len(results) >= 2, 60, "requests before the move")
        move_alias(cfg, "2")
        until(
            lambda: (lambda h: h if h["draft_version"] == f"{NAME}/2" else None)(health(url)),
            30,
            "the poller moving to version 2",
        )
        n = len(results)
        until(lambda: len(results) >= n + 2, 60, "requests after the move")
    finally:
        stop.set()
        worker.join(60)
    print(f"\n{len(results)} requests during the move: {[(v, t) for _, v, t in results]}")
    assert all(c == 200 for c, _, _ in results), [r for r in results if r[0] != 200][:3]
    versions = [v for _, v, _ in results]
    assert versions[0] == f"{NAME}/1" and versions[-1] == f"{NAME}/2"
    first_v2 = versions.index(f"{NAME}/2")
    assert set(versions[first_v2:]) == {f"{NAME}/2"}  # sequential requests: once swapped, never back
    # the new weights are really used: version 1 accepts every draft token, version 2 (random) almost none
    assert all(t == K + 1 for _, v, t in results[: first_v2 - 1])  # (the last v1 request may span the swap)
    assert all(t is None or t < K + 1 for _, _, t in results[first_v2 + 1 :])
    swap = [r for r in swap_history(url) if r["outcome"] == "swapped"][-1]
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
    url, cfg, _ = server
    before = health(url)
    serving = before["draft_version"]
    assert serving in (f"{NAME}/1", f"{NAME}/2")
    refused_before = before["metrics"].get("swaps_refused_guard", 0)
    move_alias(cfg, "3")
    h = until(
        lambda: (lambda h: h if h["metrics"].get("swaps_refused_guard", 0) > refused_before else None)(health(url)),
        30,
        "the guard refusing version 3",
    )
    rec = [r for r in swap_history(url) if r["outcome"] == "refused_guard"][-1]
    assert rec["source"] == URI and "aux_hidden_state_layer_ids" in rec["message"]
    assert h["draft_version"] == serving
    r = chat(url, "still there?")
    assert r.status_code == 200 and r.json()["eagleray"]["draft_version"] == serving
    time.sleep(3)  # three more polls: a refused version is not retried until the alias moves again
    after = health(url)
    assert after["metrics"]["swaps_refused_guard"] == refused_before + 1 and after["draft_version"] == serving


def test_alias_deleted_poll_errors_are_counted_and_the_poller_recovers(server):
    """A failing registry lookup (here: the alias is gone) is logged and counted; the draft keeps serving."""
    from mlflow import MlflowClient

    url, cfg, _ = server
    serving_version(url, cfg, "1")
    errors_before = health(url)["metrics"].get("swaps_poll_error", 0)
    MlflowClient(tracking_uri=cfg.mlflow.tracking_uri).delete_registered_model_alias(NAME, "champion")
    until(lambda: health(url)["metrics"].get("swaps_poll_error", 0) >= errors_before + 2, 30, "two failed polls")
    r = chat(url, "registry trouble?")
    assert r.status_code == 200 and r.json()["eagleray"]["draft_version"] == f"{NAME}/1"
    move_alias(cfg, "2")  # the poller survived: it follows the alias once it is back
    until(lambda: health(url)["draft_version"] == f"{NAME}/2", 30, "serving version 2 after the alias is back")


def test_registry_download_cache_is_per_source_and_never_empty(tiny_target, tmp_path, monkeypatch):
    """In-process (no Ray): two registries' 'd/1' are two cache entries; a version whose artifacts are gone is
    refused without caching an empty directory, and resolves once they are back."""
    import mlflow

    from eagleray.platform.errors import EaglerayError
    from eagleray.platform.registry import resolve_draft

    monkeypatch.setenv("EAGLERAY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = TargetSpec.from_dir(tiny_target)
    got = []
    for i in (1, 2):  # two registries, each with its own version 1 of "d"
        uri = registry.configure(f"sqlite:///{tmp_path / f'reg{i}' / 'mlflow.db'}", experiment="cache")
        d = make_random_draft(spec, tmp_path / f"draft{i}", seed=i)
        with mlflow.start_run() as run:
            mlflow.log_artifacts(str(d), "draft")
        registry.register_draft("d", run.info.run_id, "draft")
        r = resolve_draft("models:/d/1", tracking_uri=uri)
        assert r.version == "d/1" and (r.path / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()
        got.append(r.path)
    assert got[0] != got[1]
    with mlflow.start_run() as run:  # registry 2, version 2: its artifacts disappear before anyone downloads them
        mlflow.log_artifacts(str(tmp_path / "draft1"), "draft")
    registry.register_draft("d", run.info.run_id, "draft")
    artifacts = Path(run.info.artifact_uri.removeprefix("file://")) / "draft"
    artifacts.rename(artifacts.with_name("moved"))
    with pytest.raises(EaglerayError, match="expected one draft checkpoint"):
        resolve_draft("models:/d/2", tracking_uri=uri)
    assert not list((tmp_path / "home" / "drafts" / "d").glob("2-*"))
    artifacts.with_name("moved").rename(artifacts)
    assert resolve_draft("models:/d/2", tracking_uri=uri).version == "d/2"
