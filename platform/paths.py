"""Where eagleray keeps its data: ``$EAGLERAY_HOME`` or ``~/.cache/eagleray``."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def eagleray_home() -> Path:
    """Root of eagleray's local state (converted models, MLflow store, datasets)."""
    root = os.environ.get("EAGLERAY_HOME") or str(Path.home() / ".cache" / "eagleray")
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; on success it replaces ``out`` in one rename.

    Readers never see a half-written directory, and a failure leaves ``out`` as it was.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
