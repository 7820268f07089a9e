"""The one place a draft source becomes a local directory.

    resolve_draft("random", target)                 -> an untrained draft for ``target``, written once into
                                                       $EAGLERAY_HOME/drafts/random/<hash of the target> (or ``workdir``)
    resolve_draft("models:/name@alias")             -> that version, downloaded once into
    resolve_draft("models:/name/3")                    $EAGLERAY_HOME/drafts/<name>/<version>-<hash of the artifact source>
    resolve_draft("shipped:<name>")                 -> a draft shipped in the repository (platform/checkpoints/shipped)
    resolve_draft("/some/draft/dir")                -> the same directory

The result carries the version label ("name/3", "random", the directory name) that responses,
metrics and promotion tags report.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from eagleray.platform.checkpoints import shipped
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import EaglerayError
from eagleray.platform.paths import atomic_dir, eagleray_home
from eagleray.platform.registry import client

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedDraft:
    """A draft directory and the version label reported in responses and metrics."""

    path: Path
    version: str  # "name/3" for registry versions, "random", "shipped:<name>", the directory name otherwise
    source: str  # what was asked for


def resolve_draft(
    source: str | Path, target: TargetSpec | None = None, *, tracking_uri: str | None = None, workdir: str | Path | None = None
) -> ResolvedDraft:
    """``source`` ('random', ``models:/...``, ``shipped:<name>`` or a directory) -> :class:`ResolvedDraft`.

    ``target`` is needed for 'random' only; ``tracking_uri`` picks the registry (default:
    MLFLOW_TRACKING_URI, else the sqlite store under $EAGLERAY_HOME); ``workdir`` is where a random
    draft is written (default: a cache under $EAGLERAY_HOME keyed by the target, so starting a server
    with 'random' again reuses the draft instead of writing another copy).
    """
    source = str(source)
    if source == "random":
        if target is None:
            raise EaglerayError(
                "draft source 'random' needs the target it drafts for\n"
                "    fix: pass a draft directory or models:/<name>@<alias>, or resolve 'random' with the target"
            )
        if workdir is not None:
            return ResolvedDraft(make_random_draft(target, Path(workdir) / "random-draft"), "random", source)
        return ResolvedDraft(_cached_random(target), "random", source)
    if client.is_registry_uri(source):
        client.configure(tracking_uri)
        return _cached_download(source)
    if source.startswith(shipped.PREFIX):
        return ResolvedDraft(shipped.shipped_draft(source[len(shipped.PREFIX) :]), source, source)
    path = Path(source)
    if not path.is_dir():
        raise EaglerayError(
            f"draft: {path} is not a directory\n"
            f"    fix: pass a draft directory, models:/<name>@<alias>, models:/<name>/<version>, shipped:<name> or 'random'"
        )
    return ResolvedDraft(path, path.name, source)


def registry_version(uri: str, tracking_uri: str | None = None) -> str:
    """The version number a registry URI points at now (aliases are looked up)."""
    client.configure(tracking_uri)
    return client.lookup(uri).version


def _cached_download(uri: str) -> ResolvedDraft:
    version = client.lookup(uri)
    # keyed by the artifact source too: name/version alone is not unique across registries sharing $EAGLERAY_HOME
    digest = hashlib.sha256(version.source.encode()).hexdigest()[:12]
    dest = eagleray_home() / "drafts" / version.name / f"{version.version}-{digest}"
    if not dest.is_dir():
        logger.info("downloading %s (version %s) to %s", uri, version.version, dest)
        # raises on an empty download (artifacts gone): never cached
        _write_once(dest, lambda tmp: client.download_draft(version.uri, tmp))
    return ResolvedDraft(client.find_draft_dir(dest), f"{version.name}/{version.version}", uri)


def _cached_random(target: TargetSpec) -> Path:
    """The untrained draft for ``target`` (seed 0), written once per target architecture and tokenizer."""
    key = f"{target.fingerprint}|{target.tokenizer_fingerprint}|seed=0"
    dest = eagleray_home() / "drafts" / "random" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if not dest.is_dir():
        _write_once(dest, lambda tmp: make_random_draft(target, tmp))
    return dest


def _write_once(dest: Path, write) -> None:
    """``write(tmp)`` fills a directory that is then renamed to ``dest`` unless another process's complete copy
    got there first (see :func:`~eagleray.platform.paths.atomic_dir`)."""
    with atomic_dir(dest, keep_existing=True) as tmp:
        write(tmp)
