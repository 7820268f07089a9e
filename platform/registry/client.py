"""MLflow model registry client for EAGLE-3 drafts (used by training, promotion and serving).

The client API (a draft *source* of any kind becomes a directory through
:func:`eagleray.platform.registry.resolve_draft`)::

    uri = configure(tracking_uri=None, experiment="eagleray")      # sqlite + local artifacts by default
    v = register_draft("eagleray-draft", run_id, "draft", tags={...})  # run artifact dir -> model version
    v = register_directory("eagleray-draft", "/a/draft/dir", "imported")   # any draft directory -> model version
    set_alias("eagleray-draft", "champion", v.version)
    get_alias("eagleray-draft", "champion")                           # -> DraftVersion
    path = download_draft("models:/eagleray-draft@champion", dst)     # -> local directory (under dst)
    path = download_draft("models:/eagleray-draft/3")                 # -> local directory (MLflow's temp dir)

Defaults: tracking URI ``sqlite:///$EAGLERAY_HOME/mlflow/mlflow.db`` with artifacts under
``$EAGLERAY_HOME/mlflow/artifacts``; a tracking server URI (``http://...``) scales it out.
MLflow telemetry is turned off before mlflow is imported.

A draft is a plain directory (config.json + model.safetensors), not an MLflow "model" flavour, so
versions are created with ``MlflowClient.create_model_version(source=<run artifact uri>/<dir>)``
(``mlflow.register_model("runs:/...")`` refuses plain directories).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagleray.platform.errors import EaglerayError
from eagleray.platform.paths import eagleray_home

_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")
_TELEMETRY_OFF = {"MLFLOW_ENABLE_TELEMETRY": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}


@dataclass(frozen=True)
class DraftVersion:
    """One registered draft version."""

    name: str
    version: str
    source: str  # artifact URI the version points at
    run_id: str | None
    tags: dict[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def default_tracking_uri() -> str:
    """``sqlite:///$EAGLERAY_HOME/mlflow/mlflow.db``."""
    root = eagleray_home() / "mlflow"
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def _mlflow():
    for k, v in _TELEMETRY_OFF.items():
        os.environ.setdefault(k, v)
    import mlflow

    return mlflow


def configure(tracking_uri: str | None = None, experiment: str | None = None) -> str:
    """Point MLflow at ``tracking_uri`` (default sqlite under $EAGLERAY_HOME); create ``experiment``.

    With a local sqlite store the experiment's artifacts go next to the database (``artifacts/``).
    Returns the tracking URI in use. Also exported as MLFLOW_TRACKING_URI for Ray workers.
    """
    mlflow = _mlflow()
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    mlflow.set_tracking_uri(uri)
    os.environ["MLFLOW_TRACKING_URI"] = uri
    if experiment:
        client = mlflow.MlflowClient()
        if client.get_experiment_by_name(experiment) is None:
            client.create_experiment(experiment, artifact_location=_artifact_location(uri, experiment))
        mlflow.set_experiment(experiment)
    return uri


def _artifact_location(uri: str, experiment: str) -> str | None:
    if not uri.startswith("sqlite:///"):
        return None  # a tracking server decides
    root = Path(uri.removeprefix("sqlite:///")).parent / "artifacts" / re.sub(r"[^A-Za-z0-9_.-]", "_", experiment)
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve().as_uri()


def _client():
    return _mlflow().MlflowClient()


def _version(mv: Any) -> DraftVersion:
    return DraftVersion(
        name=mv.name,
        version=str(mv.version),
        source=mv.source,
        run_id=mv.run_id,
        tags=dict(mv.tags or {}),
        aliases=tuple(getattr(mv, "aliases", None) or ()),
    )


def register_draft(
    name: str, run_id: str, artifact_path: str, tags: dict[str, Any] | None = None, description: str | None = None
) -> DraftVersion:
    """Register the run artifact directory ``artifact_path`` (a draft dir) as a new version of ``name``.

    Tag values are stringified (lists as comma-joined ids). The registered model is created if needed.
    """
    from mlflow.exceptions import MlflowException

    client = _client()
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="EAGLE-3 drafts trained by eagleray")
    run = client.get_run(run_id)
    source = f"{run.info.artifact_uri.rstrip('/')}/{artifact_path.strip('/')}"
    str_tags = {k: _tag(v) for k, v in (tags or {}).items()}
    mv = client.create_model_version(name, source=source, run_id=run_id, tags=str_tags, description=description)
    return _version(client.get_model_version(name, mv.version))


def register_directory(
    name: str, draft_dir: str | Path, run_name: str, tags: dict[str, Any] | None = None, description: str | None = None
) -> DraftVersion:
    """A draft directory made from outside a training run (a shipped draft, one brought from another machine) as a
    new version of ``name``: logged as the artifacts of a run ``run_name`` of the active experiment, then registered."""
    import mlflow

    with mlflow.start_run(run_name=run_name) as run:
        mlflow.log_artifacts(str(draft_dir), "draft")
        if tags:
            mlflow.set_tags({k: _tag(v) for k, v in tags.items()})
    return register_draft(name, run.info.run_id, "draft", tags=tags, description=description)


def _tag(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def set_alias(name: str, alias: str, version: str | int) -> None:
    """Point ``models:/name@alias`` at ``version`` (moves the alias if it exists)."""
    _client().set_registered_model_alias(name, alias, str(version))


def get_alias(name: str, alias: str) -> DraftVersion:
    """The version ``alias`` points at; a missing model or alias is an EaglerayError naming the fix."""
    from mlflow.exceptions import MlflowException

    try:
        return _version(_client().get_model_version_by_alias(name, alias))
    except MlflowException as err:
        raise EaglerayError(
            f"registry: models:/{name}@{alias} does not exist ({err.message.splitlines()[0]})\n"
            f"    fix: register a draft (eagleray train) and set the alias, or check the name and "
            f"MLFLOW_TRACKING_URI={os.environ.get('MLFLOW_TRACKING_URI')}"
        ) from None


def get_version(name: str, version: str | int) -> DraftVersion:
    """One version by number; missing is an EaglerayError."""
    from mlflow.exceptions import MlflowException

    try:
        return _version(_client().get_model_version(name, str(version)))
    except MlflowException as err:
        raise EaglerayError(
            f"registry: models:/{name}/{version} does not exist ({err.message.splitlines()[0]})\n"
            f"    fix: list versions in the MLflow UI, or check MLFLOW_TRACKING_URI"
        ) from None


def is_registry_uri(source: str) -> bool:
    return str(source).startswith("models:/")


def lookup(uri: str) -> DraftVersion:
    """``models:/name@alias`` or ``models:/name/version`` -> :class:`DraftVersion`."""
    m = _MODELS_URI.match(uri)
    if m is None:
        raise EaglerayError(
            f"registry: {uri!r} is not a model URI\n    fix: use models:/<name>@<alias> or models:/<name>/<version>"
        )
    if m["alias"]:
        return get_alias(m["name"], m["alias"])
    return get_version(m["name"], m["version"])


def download_draft(uri: str, dst_dir: str | Path | None = None) -> Path:
    """Download a registry version (``models:/name@alias`` or ``models:/name/N``); -> the checkpoint directory in it."""
    version = lookup(str(uri))  # clear error for a missing alias/version
    kw = {"dst_path": str(dst_dir)} if dst_dir is not None else {}
    local = _mlflow().artifacts.download_artifacts(artifact_uri=version.uri, **kw)
    return find_draft_dir(Path(local))


def find_draft_dir(root: Path) -> Path:
    """The directory under ``root`` holding the draft's config.json and safetensors."""
    hits = sorted({p.parent for p in Path(root).rglob("config.json") if any(p.parent.glob("*.safetensors"))})
    if len(hits) != 1:
        raise EaglerayError(
            f"expected one draft checkpoint (config.json + *.safetensors) under {root}, found {len(hits)}: "
            f"{[str(h) for h in hits][:4]}\n    fix: register the draft directory itself as the model version's artifact"
        )
    return hits[0]
