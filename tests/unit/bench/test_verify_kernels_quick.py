"""`eagleray bench verify --quick` runs end to end on CPU (Triton interpreter) and writes JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_verify_quick_writes_json(tmp_path):
    out = tmp_path / "verify.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [str(Path(sys.executable).parent / "eagleray"), "bench", "verify", "--quick", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    ours = [r for r in data["records"] if r["impl"] == "eagleray"]
    assert ours and all(r["us"] is not None for r in ours)
    assert {r["mode"] for r in ours} == {"greedy", "sampled"}
    # vLLM's kernels are only present after `python -m eagleray.jobs.bench.vllm_extract`; a missing
    # peer is recorded as an error in the JSON, never silently dropped.
    peers = [r for r in data["records"] if r["impl"].startswith("vllm")]
    assert peers and all(("error" in r) or r["us"] is not None for r in peers)
