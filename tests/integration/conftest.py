"""A two-node Ray cluster on this machine for the node-loss tests (tests/integration/test_node_loss.py).

``two_nodes`` (module scope) starts a head and one worker node as real ``ray start --block`` processes,
each in its own process group, with explicit ports and its own temp dir, so that other Ray clusters on
the machine are never touched (no ``ray stop``, nothing killed by name). The worker node carries the
custom resource :data:`WORKER_RESOURCE`, so work that asks for it (or prefers it) lands there.
``cluster.kill_worker()`` SIGKILLs that node: its process group and every process it started (recorded
by pid); ``cluster.start_worker()`` starts a replacement with the same resource.

The head detects a dead node by GCS health checks; they are tightened here (every 1 s, 3 misses) so a
killed node is declared dead in ~3 s instead of Ray's default ~15-30 s. The recovery times measured by
the tests include that detection.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from eagleray.platform.host import free_port
from eagleray.tests.support.cluster import BIN, WORKER_RESOURCE, head_command, job_api_up, ray_env, stop_group, wait_for

HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3, "health_check_timeout_ms": 1000}


def free_range(n: int) -> int:
    """The first port of ``n`` consecutive ports that are free now (for --min/--max-worker-port)."""
    import random

    for _ in range(200):
        base = random.randint(20000, 59000)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def _node_ports() -> list[str]:
    base = free_range(24)
    return [
        f"--node-manager-port={free_port()}",
        f"--object-manager-port={free_port()}",
        f"--min-worker-port={base}",
        f"--max-worker-port={base + 23}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
    ]


@dataclass
class Node:
    proc: subprocess.Popen
    log: Path
    pids: set[int] = field(default_factory=set)  # every process of the node seen so far

    def record_pids(self) -> set[int]:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            self.pids |= {root.pid, *(c.pid for c in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
        return self.pids


@dataclass
class TwoNodeCluster:
    gcs: str  # host:port for ray.init / RAY_ADDRESS
    dashboard: str  # http://host:port for `ray job submit` and the state API
    head: Node
    logs: Path
    worker: Node | None = None
    workers_started: int = 0

    def nodes(self) -> list[dict]:
        """The state API's node list (``state``: ALIVE/DEAD, ``resources_total``, ``node_id``)."""
        try:
            with urllib.request.urlopen(f"{self.dashboard}/api/v0/nodes?limit=100&detail=1", timeout=5) as r:
                body = json.loads(r.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            return []
        return list(body.get("data", {}).get("result", {}).get("result", []))

    def alive_workers(self) -> list[dict]:
        return [n for n in self.nodes() if n.get("state") == "ALIVE" and WORKER_RESOURCE in (n.get("resources_total") or {})]

    def start_worker(self, num_cpus: int = 2, timeout: float = 120.0, attempts: int = 2) -> Node:
        """A worker node with {WORKER_RESOURCE: 1}; returns once the head lists it ALIVE.

        `ray start` gives up when its raylet does not register in time ("The current node timed out during
        startup"), seen when other work loads this 2-core machine far beyond its cores: then once more."""
        for attempt in range(attempts):
            try:
                return self._start_worker(num_cpus, timeout)
            except AssertionError:
                if attempt == attempts - 1 or self.worker is None or self.worker.proc.poll() is None:
                    raise
        raise AssertionError("unreachable")

    def _start_worker(self, num_cpus: int, timeout: float) -> Node:
        assert self.worker is None or self.worker.proc.poll() is not None, "a worker node is already running"
        self.workers_started += 1
        log = self.logs / f"worker-{self.workers_started}.log"
        before = {n["node_id"] for n in self.alive_workers()}
        cmd = [
            str(BIN / "ray"),
            "start",
            f"--address={self.gcs}",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps({WORKER_RESOURCE: 1})}",
            "--object-store-memory=150000000",
            "--disable-usage-stats",
            *_node_ports(),
        ]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=ray_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.worker = Node(proc, log)
        wait_for(
            lambda: [n for n in self.alive_workers() if n["node_id"] not in before],
            timeout,
            "the worker node to join",
            proc,
            every=0.5,
        )
        self.worker.record_pids()
        return self.worker

    def ensure_worker(self) -> Node:
        """The running worker node, or a fresh one when the last was killed."""
        if self.worker is not None and self.worker.proc.poll() is None and self.alive_workers():
            return self.worker
        return self.start_worker()

    def kill_worker(self) -> float:
        """SIGKILL the worker node (its process group, then any recorded pid still alive); returns the time.monotonic() of the kill."""
        node = self.worker
        assert node is not None and node.proc.poll() is None, "no worker node is running"
        pids = node.record_pids()
        t = time.monotonic()
        os.killpg(node.proc.pid, signal.SIGKILL)
        for pid in pids:  # anything of this node that left the group (a worker that called setsid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.proc.wait(timeout=10)
        return t

    def wait_worker_dead(self, timeout: float = 60.0) -> float:
        """Seconds until the head lists no ALIVE worker node."""
        t0 = time.monotonic()
        wait_for(lambda: not self.alive_workers(), timeout, "the head to declare the worker node dead", every=0.25)
        return time.monotonic() - t0

    def stop_worker(self) -> None:
        node = self.worker
        if node is None or node.proc.poll() is not None:
            return
        self.kill_worker()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head (2 CPUs, dashboard + job API) and a worker node (2 CPUs, {WORKER_RESOURCE: 1}), both this test's own."""
    logs = tmp_path_factory.mktemp("ray-two-nodes")
    port, dash, client = free_port(), free_port(), free_port()
    temp = Path(f"/tmp/ray-nl-{os.getpid()}")  # short: Ray's unix socket paths must stay < 108 chars
    cmd = head_command(
        port,
        dash,
        temp,
        150_000_000,
        f"--ray-client-server-port={client}",
        "--num-gpus=0",
        f"--system-config={json.dumps(HEALTH_CHECKS)}",
        *_node_ports(),
    )
    with open(logs / "head.log", "w") as f:
        head = subprocess.Popen(cmd, env=ray_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    cluster = TwoNodeCluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", Node(head, logs / "head.log"), logs)
    try:
        wait_for(lambda: job_api_up(cluster.dashboard), 90, "the Ray dashboard job API", head)
        cluster.head.record_pids()
        cluster.start_worker()
        yield cluster
    finally:
        cluster.stop_worker()
        cluster.head.record_pids()
        stop_group(head, timeout=10)
        for pid in cluster.head.record_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)  # session logs: the `ray start` output stays under tmp_path
