"""One Serve deployment's settings: every engine setting plus HTTP, auth, alias polling and the registry."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from eagleray.platform.config.schemas import MlflowConfig, check_custom_resources
from eagleray.serve.engine import EngineConfig


class ServingConfig(EngineConfig):
    """An :class:`EngineConfig` (target, draft, max_num_seqs, block_size, kv_cache_gib, verify_backend, ...)
    with the deployment's own fields; the YAML's ``serving:`` mapping holds both side by side."""

    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    model_name: str = Field("eagleray", description="Model id reported by /v1/models and accepted in requests.")
    api_key: str | None = Field(
        None, description="Bearer token required on every route when set (always required for admin routes)."
    )
    alias_poll_seconds: float | None = Field(
        None, gt=0, description="Poll the MLflow alias of draft.source this often and hot-swap on change."
    )
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="Registry used to resolve models:/ URIs.")
    engine_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources the engine replica needs (e.g. {'engine': 1} for nodes started with `ray start --resources '{\"engine\": 1}'`): Serve places it, and any replacement after a lost node, only on nodes that have them; until one does, /health says 'restarting'.",
    )
    ingress_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources of the HTTP ingress replica, e.g. {'node:__internal_head__': 0.01} keeps it on the head node, so that losing a worker node never drops the entry point.",
    )

    @model_validator(mode="after")
    def _custom_resources(self) -> "ServingConfig":
        check_custom_resources("engine_resources", self.engine_resources, "set target.device / target.tensor_parallel_size")
        check_custom_resources("ingress_resources", self.ingress_resources, "the ingress reserves no CPU or GPU")
        return self

    def engine_config(self, **update: Any) -> EngineConfig:
        """The engine's part of this config, with ``update`` applied (e.g. the resolved target and draft)."""
        return EngineConfig(**{name: getattr(self, name) for name in EngineConfig.model_fields} | update)
