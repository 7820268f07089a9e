"""jobs/bench/train_step: the `train` bench suite runs the trainer's step on a tiny draft (CPU smoke, no timing asserts)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_quick_run_writes_the_json(tmp_path):
    from eagleray.jobs.bench.train_step import run

    out = tmp_path / "train.json"
    result = run(["--quick", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert {"flop_formula", "tokens", "peak_tflops", "device", "command"} <= set(saved["meta"])
    (rec,) = saved["train"]
    assert rec["model"] == "tiny" and rec["ttt_steps"] == 7 and rec["batch"] == 2 and rec["seq_len"] == 32
    assert rec["draft_vocab"] == 128 and rec["aux_layer_ids"] == [2, 4, 5]
    assert rec["timed_steps"] == 2 and rec["step_ms"] > 0
    assert rec["tokens_per_s"] > 0
    assert math.isfinite(rec["loss_last"]) and math.isfinite(rec["loss_first"]) and math.isfinite(rec["grad_norm_last"])
    p = rec["params"]
    assert p["trainable"] == p["fc"] + p["layer"] + p["lm_head"] > 0
    assert p["fc"] == 64 * 3 * 64 and p["lm_head"] == 128 * 64
    f = rec["model_flops_per_step"]
    assert (
        f["total"] > f["draft_matmuls"] > 0
        and f["attention"] > 0
        and f["target_logits"] == pytest.approx(2 * 2 * 32 * 256 * 64, rel=1e-3)
    )
    assert rec["model_TFLOPs"] > 0 and 0 < rec["flop_fraction"] < 1


def test_registered_and_imports_no_ray_mlflow_vllm(tmp_path):
    """In a fresh interpreter the suite (through jobs.bench) never imports ray, mlflow or vllm (absent on the GPU box)."""
    code = textwrap.dedent(f"""
        import sys, torch
        torch.set_num_threads(1)
        from eagleray.jobs.bench import main
        assert main(["train", "--quick", "--json", {str(tmp_path / "t.json")!r}]) == 0
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "mlflow", "vllm"))
        assert not bad, bad
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((tmp_path / "t.json").read_text())["train"][0]["tokens_per_s"] > 0
