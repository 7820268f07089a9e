"""Resolve a draft source (``models:/name@alias``, ``models:/name/3``, a directory) to a local directory.

Uses ``eagleray.platform.registry`` when it exists (the training side's registry client);
until then MLflow's client and ``mlflow.artifacts.download_artifacts`` directly.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from eagleray.platform.errors import EaglerayError
from eagleray.platform.paths import eagleray_home
from eagleray.platform.schemas import MlflowConfig

logger = logging.getLogger(__name__)
_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))$")


@dataclass(frozen=True)
class ResolvedDraft:
    """A draft directory and the version label reported in responses and metrics."""

    path: Path
    version: str  # "name/3" for registry versions, the directory name otherwise
    source: str  # what was asked for


def tracking_uri(cfg: MlflowConfig) -> str:
    """The configured tracking URI, or sqlite under $EAGLERAY_HOME/mlflow (DESIGN.md, defaults)."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    root = eagleray_home() / "mlflow"
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """'models:/name@alias' -> (name, alias, None); 'models:/name/3' -> (name, None, '3')."""
    m = _URI.match(uri)
    if not m:
        raise EaglerayError(f"draft source {uri!r} is not a registry URI of the form models:/<name>@<alias> or models:/<name>/<version>\n"
                            f"    fix: e.g. models:/eagleray-draft@champion")
    return m["name"], m["alias"], m["version"]


def registry_version(uri: str, cfg: MlflowConfig) -> str:
    """The version number a registry URI points at now (aliases are looked up)."""
    from mlflow import MlflowClient

    name, alias, version = parse_models_uri(uri)
    if version is not None:
        return version
    client = MlflowClient(tracking_uri=tracking_uri(cfg), registry_uri=tracking_uri(cfg))
    return str(client.get_model_version_by_alias(name, alias).version)


def find_draft_dir(root: Path) -> Path:
    """The directory under ``root`` holding the draft's config.json and safetensors."""
    hits = sorted({p.parent for p in root.rglob("config.json") if any(p.parent.glob("*.safetensors"))})
    if len(hits) != 1:
        raise EaglerayError(f"expected one draft checkpoint (config.json + *.safetensors) under {root}, found {len(hits)}: "
                            f"{[str(h) for h in hits][:4]}\n    fix: register the draft directory itself as the model version's artifact")
    return hits[0]


def resolve_draft_source(uri: str, mlflow_cfg: MlflowConfig) -> Path:
    """Local directory of a draft source (downloads registry versions into $EAGLERAY_HOME/drafts)."""
    return resolve(uri, mlflow_cfg).path


def resolve(uri: str, mlflow_cfg: MlflowConfig) -> ResolvedDraft:
    if not uri.startswith("models:/"):
        path = Path(uri)
        if not path.is_dir():
            raise EaglerayError(f"draft source {uri!r} is not a directory\n    fix: pass a draft checkpoint directory or models:/<name>@<alias>")
        return ResolvedDraft(path, path.name, uri)
    name, _, _ = parse_models_uri(uri)
    version = registry_version(uri, mlflow_cfg)
    if importlib.util.find_spec("eagleray.platform.registry") is not None:
        from eagleray.platform import registry  # the training side's client, when present

        if hasattr(registry, "resolve_draft"):
            return ResolvedDraft(Path(registry.resolve_draft(f"models:/{name}/{version}", mlflow_cfg)), f"{name}/{version}", uri)
    import mlflow

    dest = eagleray_home() / "drafts" / name / version
    if not dest.is_dir() or not any(dest.rglob("config.json")):
        dest.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(tracking_uri(mlflow_cfg))
        mlflow.set_registry_uri(tracking_uri(mlflow_cfg))
        logger.info("downloading %s (version %s) to %s", uri, version, dest)
        mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(dest))
    return ResolvedDraft(find_draft_dir(dest), f"{name}/{version}", uri)
