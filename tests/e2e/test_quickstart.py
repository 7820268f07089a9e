"""The README's first command end to end (small sizes): datagen -> train -> register -> promote -> serve -> chat."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_quickstart_whole_loop(tmp_path, smollm2_fp32):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        str(Path(sys.executable).parent / "eagleray"),
        "quickstart",
        "--workdir",
        str(tmp_path),
        "--prompts",
        "8",
        "--max-tokens",
        "16",
        "--train-steps",
        "4",
        "--eval-prompts",
        "1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    steps = ("[1/7]", "[3/7] the champion", "[4/7] datagen", "[5/7] train", "[6/7] promote", "[7/7] serve", "quickstart finished")
    for step in steps:
        assert step in out.stdout, out.stdout[-4000:]
    assert "refused: algorithm" in out.stdout
    # the console: the steps and results only (issue 17: hundreds of Ray/Serve INFO lines, ANSI codes, a
    # "graceful_shutdown failed" line at the end of a good run); everything else is in the log it names
    lines = text.splitlines()
    assert len(lines) <= 60, f"{len(lines)} console lines:\n{text}"
    for noise in ("\x1b[", "INFO", "WARNING", "ERROR", "Traceback", "failed", "(raylet)", "(pid="):
        assert noise not in text, f"{noise!r} on the console:\n{text}"
    log = tmp_path / "quickstart.log"
    assert str(log) in out.stdout and log.stat().st_size > 0
    summary = json.loads((tmp_path / "quickstart.json").read_text())
    # the shipped champion serves (the 4-step candidate cannot beat it) and it is a trained draft: τ above 1
    assert summary["champion"] == "shipped:smollm2-135m-instruct-eagle3-sharegpt" and not summary["promoted"]
    assert summary["tau"] > 1.0 and summary["speedup"] > 0 and summary["candidate"]["tau"] >= 1.0
    assert summary["served"]["draft_version"] == "quickstart-smollm2-eagle3/1"
    assert (tmp_path / "mlflow.db").is_file() and list((tmp_path / "datagen" / "shards").glob("*.parquet"))
