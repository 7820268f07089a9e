"""The Ray Serve application: ``eagleray.serve.app:build_app`` for ``serve run`` / ``serve deploy``.

    serve run eagleray.serve.app:build_app config=jobs/configs/serving-smollm2-cpu.yaml
    serve deploy jobs/configs/serve-smollm2-cpu.yaml       # a Serve config whose args hold `serving`

``args``: either ``config`` (a ServingConfig YAML path) or ``serving`` (the ServingConfig inline).
The engine deployment gets the draft as its ``user_config`` so a config update hot-swaps it.
A draft directory that exists where the app is built is checked by the compatibility guard first:
an incompatible or broken draft (a zero-byte checkpoint, say) stops ``build`` with the guard's
message instead of a replica that fails to start (whose message only reaches the replica log).
With ``target.tensor_parallel_size > 1`` the engine replica is placed in a STRICT_PACK placement
group of one bundle per rank: the replica (rank 0) takes bundle 0 and starts ranks 1..N-1 as Ray
actors in bundles 1..N-1 (:mod:`eagleray.serve.engine.tp_ray`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from ray import serve
from ray.serve import Application

from eagleray.platform.checkpoints.guard import ensure_compatible
from eagleray.platform.checkpoints.target import TargetSpec, resolve_target
from eagleray.platform.config.load import StrictModel, load_yaml_config, parse_config
from eagleray.platform.registry import is_registry_uri
from eagleray.serve.engine_ingress import EngineIngress
from eagleray.serve.engine_server import EngineServer
from eagleray.serve.ingress import OpenAIIngress
from eagleray.serve.ingress import app as fastapi_app
from eagleray.serve.serving_config import ServingConfig


class AppArgs(StrictModel):
    config: str | None = Field(None, description="Path of a ServingConfig YAML file.")
    serving: dict[str, Any] | None = Field(None, description="ServingConfig given inline (as in a Serve config file's args).")

    @model_validator(mode="after")
    def _one(self) -> "AppArgs":
        if (self.config is None) == (self.serving is None):
            raise ValueError("give exactly one of 'config' (a ServingConfig YAML path) or 'serving' (inline)")
        return self

    def load(self) -> ServingConfig:
        if self.config is not None:
            return load_yaml_config(ServingConfig, self.config)
        return parse_config(ServingConfig, self.serving, source="build_app args", prefix="serving")


def engine_options(cfg: ServingConfig) -> dict[str, Any]:
    """Deployment options of the engine: one replica; a STRICT_PACK placement group for TP ranks."""
    tp = cfg.target.tensor_parallel_size
    gpu = cfg.target.device == "cuda" or (cfg.target.device == "auto" and tp > 1)
    opts: dict[str, Any] = {
        "num_replicas": 1,
        "max_ongoing_requests": max(64, 4 * cfg.max_num_seqs),
        "health_check_period_s": 10,
        "graceful_shutdown_timeout_s": 30,
    }
    if tp > 1:
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        opts["placement_group_bundles"] = [dict(bundle) for _ in range(tp)]
        opts["placement_group_strategy"] = "STRICT_PACK"
        opts["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1 if gpu else 0}  # fits in the first bundle
    else:
        opts["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1 if cfg.target.device == "cuda" else 0}
    if env := cfg.replica_env():  # GOMP_SPINCOUNT is read once, when the replica's torch loads libgomp
        opts["ray_actor_options"]["runtime_env"] = {"env_vars": env}
    if cfg.engine_resources:  # rank 0 (the replica) needs them: in the actor options and, with TP, in bundle 0
        opts["ray_actor_options"]["resources"] = dict(cfg.engine_resources)
        if tp > 1:
            opts["placement_group_bundles"][0].update(cfg.engine_resources)
    return opts


def user_config_of(cfg: ServingConfig) -> dict[str, Any] | None:
    if cfg.draft is None or cfg.draft.source == "random":
        return None
    out: dict[str, Any] = {"draft": cfg.draft.source}
    if cfg.alias_poll_seconds is not None:
        out["alias_poll_seconds"] = cfg.alias_poll_seconds
    return out


def guard_local_draft(cfg: ServingConfig) -> None:
    """Run the guard here when the draft is a directory this machine has (raises CompatibilityError).

    Registry drafts and directories that exist only on the cluster are guarded by the replica.
    """
    if cfg.draft is None or cfg.draft.source == "random" or is_registry_uri(cfg.draft.source):
        return
    draft = Path(cfg.draft.source)
    target = resolve_target(cfg.target.model, cfg.target.dtype)
    if draft.exists() and target.is_dir():
        ensure_compatible(
            TargetSpec.from_dir(target), draft, algorithm=cfg.draft.algorithm, max_model_len=cfg.target.max_model_len
        )


def ingress_deployment(cfg: ServingConfig):
    """The ingress deployment (bind it to an engine deployment or handle and the serving dict)."""
    ingress_cls = serve.ingress(fastapi_app)(OpenAIIngress)
    return serve.deployment(
        ingress_cls,
        name="EagleRayIngress",
        num_replicas=1,
        max_ongoing_requests=max(128, 8 * cfg.max_num_seqs),
        ray_actor_options={"num_cpus": 0, **({"resources": dict(cfg.ingress_resources)} if cfg.ingress_resources else {})},
    )


def engine_ingress_deployment(cfg: ServingConfig):
    """``ingress: engine``: the routes and the engine in one deployment, placed as the engine is."""
    opts = engine_options(cfg) | {"max_ongoing_requests": max(128, 8 * cfg.max_num_seqs)}
    return serve.deployment(serve.ingress(fastapi_app)(EngineIngress), name="EagleRayEngine", **opts)


def build(cfg: ServingConfig) -> Application:
    """The application for a validated ServingConfig (the guard first, for a local draft directory)."""
    guard_local_draft(cfg)
    serving = cfg.model_dump(mode="json")
    if cfg.ingress == "engine":
        engine_dep = engine_ingress_deployment(cfg)
    else:
        engine_dep = serve.deployment(EngineServer, name="EagleRayEngine", **engine_options(cfg))
    user_config = user_config_of(cfg)
    if user_config is not None:
        engine_dep = engine_dep.options(user_config=user_config)
    if cfg.ingress == "engine":
        return engine_dep.bind(serving)
    return ingress_deployment(cfg).bind(engine_dep.bind(serving), serving)


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder (``import_path: eagleray.serve.app:build_app``)."""
    return build(parse_config(AppArgs, dict(args), source="build_app args").load())
