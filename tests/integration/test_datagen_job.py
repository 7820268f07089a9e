"""datagen on a real local Ray cluster (`ray start --head`): the driver is killed mid-run, then the
job is resubmitted with the real `ray job submit` CLI and resumes; every prompt ends up exactly once.

The cluster is this test's own (own temp dir and ports, started with --block in its own process
group) and is stopped by signalling that group, never with a machine-wide `ray stop`.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from eagleray.datagen import shards
from eagleray.datagen.manifest import MANIFEST
from eagleray.platform.host import free_port
from eagleray.tests.support.cluster import BIN, head_command, job_api_up, ray_env, stop_group, wait_for
from eagleray.tests.support.datagen import FIXTURE, datagen_config, expected_ids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    port, dash = free_port(), free_port()
    temp = Path(f"/tmp/ray-dg-{os.getpid()}")
    cmd = head_command(port, dash, temp, 200_000_000)
    log = open(tmp_path_factory.mktemp("ray") / "ray-start.log", "w")
    head = subprocess.Popen(cmd, env=ray_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        wait_for(lambda: job_api_up(url), 60, "the Ray dashboard job API", head)
        yield {"gcs": f"127.0.0.1:{port}", "dashboard": url}
    finally:
        stop_group(head, timeout=30)
        log.close()


def _submit(cmd: list[str], agent_wait_s: float = 240.0) -> subprocess.CompletedProcess:
    """`ray job submit`, again while the head's job agent is still starting: the dashboard answers before
    the raylet's agent registers, and Ray refuses with "No available agent to submit job, please try
    again later" (seen on a loaded 2-core machine; once still refused after 90 s while two training
    workers shared the cores). No job is created by a refused submit."""
    end = time.monotonic() + agent_wait_s
    while True:
        res = subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, timeout=180)
        if res.returncode == 0 or "No available agent" not in res.stderr + res.stdout or time.monotonic() > end:
            return res
        time.sleep(2)


def test_driver_killed_then_ray_job_submit_resumes(cluster, tiny_target, tmp_path):
    out = tmp_path / "out"
    cfg = datagen_config(tiny_target, FIXTURE, out, rows_per_shard=2, testing={"chunk_delay_s": 1.0})
    cfg_path = tmp_path / "datagen.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    job = [sys.executable, "-m", "eagleray.jobs.datagen", "--config", str(cfg_path)]

    # 1. A driver connected to the cluster, SIGKILLed as soon as its first shard lands.
    driver_log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(
        job, env={**ray_env(), "RAY_ADDRESS": cluster["gcs"]}, stdout=driver_log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        try:
            wait_for(lambda: shards.shard_files(out), 90, "the first shard", driver)
        except AssertionError as err:
            driver_log.flush()
            raise AssertionError(f"{err}; driver output:\n{(tmp_path / 'driver.log').read_text()[-4000:]}") from None
    finally:
        driver_log.close()
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
    assert not (out / MANIFEST).exists(), "the run finished before the driver was killed"
    first = {p: p.stat().st_mtime_ns for p in shards.shard_files(out)}
    assert 0 < len(first) < 10

    # 2. The same config through the real `ray job submit` CLI (blocking; streams the job's output).
    submit = [
        str(BIN / "ray"),
        "job",
        "submit",
        "--address",
        cluster["dashboard"],
        "--",
        *job,
        "--set",
        "testing.chunk_delay_s=0",
    ]
    res = _submit(submit)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "already done" in res.stdout and "datagen summary" in res.stdout, res.stdout[-3000:]

    # 3. Every prompt exactly once; shards of the killed run were kept, not redone.
    seen = Counter(shards.written_ids(out)) + Counter(e["prompt_id"] for e in shards.read_errors(out))
    assert set(seen) == expected_ids(cfg) and max(seen.values()) == 1
    assert all(p.exists() and p.stat().st_mtime_ns == t for p, t in first.items())
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["rows"] + manifest["errors"] == len(seen) == 20
