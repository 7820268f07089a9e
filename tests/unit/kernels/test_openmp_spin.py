"""eagleray's import sets GNU OpenMP's GOMP_SPINCOUNT to 0 before torch loads libgomp (its workers sleep when a region
ends instead of spinning on the cores the native kernels need), marks it as its own, and leaves a value the user set;
the Serve benchmark starts a vLLM peer without eagleray's value. Fresh interpreters: the variable is read at import."""

from __future__ import annotations

import os
import subprocess
import sys

from eagleray.jobs.bench import serve_load

SHOW = "import eagleray, os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('EAGLERAY_SET_GOMP_SPINCOUNT'))"


def _run(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_the_import_sets_zero_and_keeps_the_users_value():
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "EAGLERAY_SET_GOMP_SPINCOUNT")}
    assert _run(env) == "0 1"
    assert _run({**env, "GOMP_SPINCOUNT": "5000"}) == "5000 None"


def test_a_vllm_peer_starts_without_eagleray_s_value():
    ours = {"GOMP_SPINCOUNT": "0", "EAGLERAY_SET_GOMP_SPINCOUNT": "1", "PATH": "/bin"}
    assert "GOMP_SPINCOUNT" not in serve_load.server_env("vllm-champion", ours)
    assert serve_load.server_env("eagleray", ours)["GOMP_SPINCOUNT"] == "0"
    users = {"GOMP_SPINCOUNT": "0", "PATH": "/bin"}  # set by the user before eagleray: every server keeps it
    assert serve_load.server_env("vllm", users)["GOMP_SPINCOUNT"] == "0"
    assert serve_load.server_env("vllm", ours)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
