"""Resolve a draft source (``models:/name@alias``, ``models:/name/3``, a directory) to a local directory.

Registry URIs go through :mod:`eagleray.platform.registry`; this module adds the version label
("name/3") that responses and metrics report, and a download cache under
$EAGLERAY_HOME/drafts/<name>/<version>-<hash of the artifact source>.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eagleray.platform import registry
from eagleray.platform.paths import eagleray_home
from eagleray.platform.schemas import MlflowConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedDraft:
    """A draft directory and the version label reported in responses and metrics."""

    path: Path
    version: str  # "name/3" for registry versions, the directory name otherwise
    source: str  # what was asked for


def registry_version(uri: str, cfg: MlflowConfig) -> str:
    """The version number a registry URI points at now (aliases are looked up)."""
    registry.configure(cfg.tracking_uri)
    return registry.lookup(uri).version


def resolve_draft_source(uri: str, mlflow_cfg: MlflowConfig) -> Path:
    """Local directory of a draft source (downloads registry versions into $EAGLERAY_HOME/drafts)."""
    return resolve(uri, mlflow_cfg).path


def resolve(uri: str, mlflow_cfg: MlflowConfig) -> ResolvedDraft:
    if not registry.is_registry_uri(uri):
        return ResolvedDraft(registry.resolve_draft(uri), Path(uri).name, uri)
    registry.configure(mlflow_cfg.tracking_uri)
    version = registry.lookup(uri)
    # keyed by the artifact source too: name/version alone is not unique across registries sharing $EAGLERAY_HOME
    digest = hashlib.sha256(version.source.encode()).hexdigest()[:12]
    dest = eagleray_home() / "drafts" / version.name / f"{version.version}-{digest}"
    if not dest.is_dir():  # download beside, then rename: a cached directory is always complete
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{version.version}.", dir=dest.parent))
        logger.info("downloading %s (version %s) to %s", uri, version.version, dest)
        try:
            registry.resolve_draft(version.uri, tmp)  # raises on an empty download (artifacts gone): never cached
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return ResolvedDraft(registry.find_draft_dir(dest), f"{version.name}/{version.version}", uri)
