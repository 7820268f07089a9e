"""Local Ray for the integration tests: the environment of `ray start` processes, waiting on a condition,
the dashboard's job API, stopping a process group, and an in-process Ray that exports metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
WORKER_RESOURCE = "node_loss_worker"  # the custom resource of the two-node cluster's worker node


def ray_env() -> dict[str, str]:
    """The environment of every Ray process: this one's (PYTHONPATH included, so a worktree's code is
    what the cluster imports), with the venv's bin first on PATH.

    No drain on SIGTERM: `ray start --block` otherwise asks the GCS to drain its node and waits up to 30 s
    for it to go idle (a Kubernetes pod's grace, for Serve's proxies); a test cluster that ran jobs took
    the whole 30 s to stop."""
    return {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        "TOKENIZERS_PARALLELISM": "false",
    }


def head_command(port: int, dashboard_port: int, temp: Path, object_store_bytes: int, *extra: str) -> list[str]:
    """`ray start --head --block` on 127.0.0.1 with 2 CPUs, the dashboard (job API) and its own ports and temp dir."""
    return [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        "--include-dashboard=true",
        "--num-cpus=2",
        f"--object-store-memory={object_store_bytes}",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
        *extra,
    ]


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, every: float = 0.2):
    """``pred()``'s first truthy value within ``timeout`` seconds; fails early when ``proc`` exits."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}")
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def job_api_up(url: str) -> bool:
    """The Ray dashboard at ``url`` answers its job API."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def stop_group(proc: subprocess.Popen, timeout: float) -> None:
    """Stop the process group ``proc`` leads (started with start_new_session): SIGTERM to ``proc`` alone, then
    SIGKILL to whatever of the group is left after ``timeout`` s or once ``proc`` has exited.

    For `ray start --block`: on SIGTERM it drains the node through the GCS and stops its own processes (~2 s).
    SIGTERM to the whole group at once stopped the GCS first and left `ray start` waiting ~30 s for it
    ("Failed to mark the local node as draining on SIGTERM")."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group is gone already
        pass
    proc.wait(timeout=10)


def init_ray_with_metrics() -> int:
    """Start an in-process local Ray (2 CPUs) that exports metrics every second; returns the metrics port."""
    import ray

    from eagleray.platform.host import free_port

    assert not ray.is_initialized()
    metrics_port = free_port()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    return metrics_port


def stop_local_ray() -> None:
    """End the in-process local Ray of a Serve test module (what ``serve.local.start_local`` started), Serve with it.

    ``ray.shutdown()`` of the driver that started a local Ray ends that whole instance: the Serve controller, the
    proxy and every replica go with it. ``serve.local.stop_local`` calls ``serve.shutdown()`` first, which stops the
    replicas one deployment after the other, each after Ray Serve's graceful wait loop (2 s): ~5 s a module, for
    requests no test has in flight. Not for a Ray this process only connected to (there the apps would outlive it)."""
    import ray

    ray.shutdown()
