"""The capture writer: its torch-free module, a capture path it cannot write named at start, and the thread host
(rows queued to a thread of the replica: shards by count and by time, a failed write reported, the last shard on
close). The actor host runs in tests/integration/test_capture_serve.py (real Ray)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from eagleray.platform import capture_store
from eagleray.serve.capture_config import CaptureConfig
from eagleray.serve.capture_writer import CaptureWriteFailed, ThreadHost, writable
from eagleray.tests.support.capture import META, captured


def test_the_writer_module_imports_no_torch_or_engine():
    # an actor process imports its class's module: with torch the writer took 2.6 s of CPU beside the replica
    code = (
        "import sys, eagleray.serve.capture_writer; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('eagleray.serve.engine')]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_capture_path_it_cannot_write_names_the_field(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    problem = writable(afile / "traffic" / "shards")
    assert problem is not None and problem.startswith("serving.capture.path:") and "fix:" in problem
    assert writable(tmp_path / "traffic" / "shards") is None
    assert (tmp_path / "traffic" / "shards").is_dir() and not any((tmp_path / "traffic" / "shards").iterdir())
    assert ThreadHost(CaptureConfig(path=str(afile / "traffic")), META).ready() == problem


def test_the_thread_host_writes_a_shard_per_rows_per_shard_and_on_flush(tmp_path):
    host = ThreadHost(CaptureConfig(path=str(tmp_path), rows_per_shard=2, flush_seconds=3600), META)
    assert host.ready() is None

    async def go():
        acks = [await host.add(captured(i), "v1") for i in range(3)]
        assert acks == [{"stored": True}] * 3
        assert len(capture_store.list_shards(tmp_path)) == 1  # two rows: a shard; the third is buffered
        status = await host.flush()
        assert status["shards"] == 2 and status["rows"] == 3 and status["buffered"] == 0

    asyncio.run(go())
    rows = [r for s in capture_store.list_shards(tmp_path) for r in pq.read_table(s.path).to_pylist()]
    assert [r["prompt_id"] for r in rows] == ["req-0", "req-1", "req-2"]
    assert capture_store.shard_meta(capture_store.list_shards(tmp_path)[0].path)["draft_versions"] == ["v1"]
    host.close()
    assert not host.thread.is_alive()


def test_the_thread_host_writes_a_due_shard_by_itself_and_the_buffer_on_close(tmp_path):
    host = ThreadHost(CaptureConfig(path=str(tmp_path / "a"), flush_seconds=0.2), META)
    asyncio.run(_add(host, captured(0)))
    deadline = time.monotonic() + 10
    while not capture_store.list_shards(tmp_path / "a") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(capture_store.list_shards(tmp_path / "a")) == 1  # flush_seconds after its first row, no call
    host.close()

    host = ThreadHost(CaptureConfig(path=str(tmp_path / "b"), flush_seconds=3600), META)
    asyncio.run(_add(host, captured(1)))
    assert not capture_store.list_shards(tmp_path / "b")
    host.close()  # the replica goes away: its buffered rows are written first
    assert capture_store.count_rows(capture_store.list_shards(tmp_path / "b")) == 1


def test_a_failed_write_reaches_the_caller_and_the_thread_lives_on(tmp_path):
    host = ThreadHost(CaptureConfig(path=str(tmp_path), rows_per_shard=1), META)
    bad = captured(0)
    bad["num_tokens"] = "not a number"  # the shard's Arrow conversion raises in the writer thread

    async def go():
        with pytest.raises(CaptureWriteFailed, match="writing a shard of 1 rows failed, they are dropped"):
            await host.add(bad, None)
        assert await host.add(captured(1), None) == {"stored": True}  # the bad row did not stay to fail again
        return await host.flush()

    status = asyncio.run(go())
    assert host.thread.is_alive() and status["lost_rows"] == 1 and status["rows"] == 1
    assert [r["prompt_id"] for r in pq.read_table(capture_store.list_shards(tmp_path)[0].path).to_pylist()] == ["req-1"]
    host.close()


async def _add(host: ThreadHost, r: dict) -> None:
    assert await host.add(r, None) == {"stored": True}
