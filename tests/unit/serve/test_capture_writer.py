"""The capture writer actor's module: no torch in its process, and a capture path it cannot write named at start."""

from __future__ import annotations

import subprocess
import sys

from eagleray.serve.capture_writer import writable


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
