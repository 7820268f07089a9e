"""One Serve deployment's settings: every engine setting plus HTTP, auth, alias polling and the registry."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from eagleray.platform.config.schemas import MlflowConfig
from eagleray.serve.engine import EngineConfig


class ServingConfig(EngineConfig):
    """An :class:`EngineConfig` (target, draft, max_num_seqs, block_size, kv_cache_gib, verify_backend, ...)
    with the deployment's own fields; the YAML's ``serving:`` mapping holds both side by side."""

    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    model_name: str = Field("eagleray", description="Model id reported by /v1/models and accepted in requests.")
    api_key: str | None = Field(None, description="Bearer token required on every route when set (always required for admin routes).")
    alias_poll_seconds: float | None = Field(None, gt=0, description="Poll the MLflow alias of draft.source this often and hot-swap on change.")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="Registry used to resolve models:/ URIs.")

    def engine_config(self, **update: Any) -> EngineConfig:
        """The engine's part of this config, with ``update`` applied (e.g. the resolved target and draft)."""
        return EngineConfig(**{name: getattr(self, name) for name in EngineConfig.model_fields} | update)
