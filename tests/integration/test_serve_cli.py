"""The shipped Serve config runs under Ray Serve's own CLI: ``serve run jobs/configs/serve-smollm2-cpu.yaml``.

The venv's ``serve`` executable runs a copy of the shipped YAML in a subprocess (its own local Ray
instance: ``--address local``, so it never joins another Ray on this machine) with only the HTTP port
changed: SmolLM2-135M-Instruct from $EAGLERAY_HOME with a random draft on CPU. The test waits for
``GET /health`` and ``GET /v1/models`` on the configured port, sends one chat completion, then stops
``serve run`` with SIGINT (what Ctrl-C does): Serve shuts down, the process exits 0, Ray's processes
are gone and the port is closed. The shipped file itself is also validated as-is (ServeDeploySchema).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "jobs" / "configs" / "serve-smollm2-cpu.yaml"
SERVE = Path(sys.executable).parent / "serve"


def _wait(fn, timeout_s: float, what: str, proc: subprocess.Popen, log: Path):
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"`serve run` exited with {proc.returncode} while waiting for {what}:\n{log.read_text()[-4000:]}")
        try:
            last = fn()
            if last:
                return last
        except httpx.HTTPError as err:
            last = f"{type(err).__name__}: {err}"
        time.sleep(1)
    pytest.fail(f"{what} not within {timeout_s:.0f}s (last: {last!r}):\n{log.read_text()[-4000:]}")


def _session_pids(sid: int) -> list[int]:
    """Live processes of the session ``serve run`` leads (Ray's actors get their own process groups, not sessions)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if (
                d.name.isdigit()
                and os.getsid(int(d.name)) == sid
                and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            ):
                pids.append(int(d.name))
        except (OSError, IndexError):
            continue  # exited meanwhile
    return pids


def test_shipped_serve_yaml_is_a_valid_ray_serve_config():
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(data)
    (app,) = schema.applications
    assert app.import_path == "eagleray.serve.app:build_app" and app.route_prefix == "/"
    assert schema.http_options.host == "127.0.0.1" and SERVE.is_file()


def _default_sigint() -> None:
    """Ctrl-C must reach `serve run` as KeyboardInterrupt. A test run started in the background by a
    non-interactive shell (`cmd &`, as CI scripts do) inherits SIGINT *ignored*, exec keeps that, and
    Python then never raises KeyboardInterrupt: `serve run` would ignore the test's SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_serve_run_shipped_yaml(smollm2_fp32, tmp_path):
    """The shipped file as is (SmolLM2-135M, random draft, CPU) but for the port; smollm2_fp32 converts the
    model into $EAGLERAY_HOME beforehand when a fresh cache lacks it."""
    from eagleray.platform.host import free_port

    data = yaml.safe_load(CONFIG.read_text())
    port = free_port()
    data["http_options"]["port"] = port
    serving = data["applications"][0]["args"]["serving"]
    assert serving["target"]["model"] == "smollm2" and serving["target"]["dtype"] == "fp32"
    cfg_path = tmp_path / "serve.yaml"
    cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))
    log = tmp_path / "serve-run.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")  # the log shows the shutdown
    url, model = f"http://127.0.0.1:{port}", serving["model_name"]
    with open(log, "wb") as out:
        # cwd: a scratch directory, so `serve run`'s default --app-dir "." puts nothing of the repo on sys.path
        proc = subprocess.Popen(
            [str(SERVE), "run", str(cfg_path), "--address", "local"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )
    try:
        health = _wait(
            lambda: (lambda r: r.json() if r.status_code == 200 else None)(httpx.get(f"{url}/health", timeout=10)),
            240,
            "GET /health",
            proc,
            log,
        )
        assert health["status"] == "ok" and health["model"] == model and health["draft_version"] == "random"
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [model]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] > 0
        assert answer["eagleray"]["draft_version"] == "random" and answer["eagleray"]["num_drafts"] > 0
        assert "Paris" in answer["choices"][0]["message"]["content"]  # greedy speculation is lossless: SmolLM2's answer
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # Ctrl-C: serve.shutdown(), then the driver's local Ray stops
        try:
            code = proc.wait(timeout=180)  # serve.shutdown() drains replicas, then the local Ray stops
        except subprocess.TimeoutExpired:
            code = None
        deadline = time.monotonic() + 30
        while _session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        leftover = _session_pids(proc.pid)
        for pid in leftover + ([proc.pid] if code is None else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if code is None:
            proc.wait(30)
    assert code == 0, f"`serve run` exited with {code} after SIGINT:\n{log.read_text()[-4000:]}"
    assert not leftover, f"processes of `serve run` still running 30 s after it exited: {leftover}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)
