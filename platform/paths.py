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
def atomic_dir(out: Path, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; on success it replaces ``out`` in one rename.

    Readers never see a half-written directory, and a failure leaves ``out`` as it was. With
    ``keep_existing`` (a cache several processes may fill at once) a complete ``out`` that is already
    there is kept and this copy dropped: the first rename wins, and a directory someone may be reading
    is never replaced.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists() and not keep_existing:
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (keep_existing and out.is_dir()):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
