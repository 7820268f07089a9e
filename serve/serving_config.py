"""One Serve deployment's settings: every engine setting plus HTTP, auth, alias polling and the registry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from eagleray.platform.config.load import StrictModel
from eagleray.platform.config.schemas import MlflowConfig, check_custom_resources
from eagleray.platform.errors import EaglerayError
from eagleray.serve.capture_config import CaptureConfig
from eagleray.serve.engine import EngineConfig


class AdaptSchedule(StrictModel):
    command: list[str] = Field(
        min_length=1,
        description="The command the engine deployment runs every every_s, e.g. [python, -m, eagleray.jobs.adapt, --config, adapt.yaml, --once].",
    )
    every_s: float = Field(gt=0.0, description="Seconds between the end of one run and the start of the next.")
    log: str = Field("adapt-schedule.log", description="Output of the runs, appended; relative paths are under capture.path.")


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
    capture: CaptureConfig | None = Field(
        None,
        description="Capture a sample of finished requests (token ids, loss mask over the answer, the target's aux and final hidden states) as training shards; null (default) captures nothing.",
    )
    adapt_schedule: AdaptSchedule | None = Field(
        None, description="Run the adaptation loop from the engine deployment on a schedule (needs capture); null: never."
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        le=16,
        description="Threads of a CPU engine replica (native kernels and prefill GEMMs). None: every core the replica may run on; Ray would otherwise leave it at OMP_NUM_THREADS = its num_cpus reservation (1), a single core.",
    )
    cpu_omp_passive: bool = Field(
        True,
        description="A CPU engine replica starts with GOMP_SPINCOUNT=0 in its Ray runtime environment: GNU OpenMP's workers sleep at once after each parallel region instead of spinning ~3 ms, so the native kernels between a prefill's oneDNN GEMMs get every core (prefill of 8 prompts 1.58 -> 1.45 s on 2 cores). Only the replica's process (not a command adapt_schedule runs): training and datagen keep the default, where their many small parallel regions would each pay a wake-up. false: libgomp's default.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=64,
        description="Stream a request's tokens in events of at least this many (its first and its last at once), as vLLM's --stream-interval: each event costs the replica's Python threads work that, on a small CPU machine, the engine's thread waits for (the GIL). 1: every step's tokens as they come.",
    )
    ingress: Literal["engine", "separate"] = Field(
        "separate",
        description="Where the OpenAI routes run. separate: a replica of their own that calls the engine replica (a lost engine replica is answered with a clean 503 by a replica that is still up: docs/fault-model.md); engine: in the engine's replica, one process and one hop per token fewer (faster on a small machine), and a lost replica takes its routes along.",
    )
    direct_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve HTTP from the engine's replica itself on this port (Ray Serve's direct ingress), besides Serve's proxy on port: a streamed token skips the proxy's Ray hop (on the 2-core CPU at c4 with 512-token prompts the replica's decode step 39-46 -> 35-41 ms, BENCHMARKS.md). Needs ingress: engine and Ray started by `eagleray serve` (Ray Serve reads it from the environment its processes start with). None: only the proxy.",
    )
    ingress_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources of the HTTP ingress replica, e.g. {'node:__internal_head__': 0.01} keeps it on the head node, so that losing a worker node never drops the entry point.",
    )

    @model_validator(mode="after")
    def _custom_resources(self) -> "ServingConfig":
        check_custom_resources("engine_resources", self.engine_resources, "set target.device / target.tensor_parallel_size")
        check_custom_resources("ingress_resources", self.ingress_resources, "the ingress reserves no CPU or GPU")
        if self.ingress == "engine" and self.ingress_resources:
            raise ValueError(
                "ingress_resources: places a separate ingress replica, but ingress is 'engine' (the routes run in the "
                "engine replica, placed by engine_resources); set ingress: separate or remove ingress_resources"
            )
        if self.direct_port is not None and self.ingress != "engine":
            raise ValueError(
                "direct_port: serves HTTP from the replica that runs the routes and the engine; set ingress: engine or remove direct_port"
            )
        if self.direct_port is not None and self.direct_port == self.port:
            raise ValueError(
                f"direct_port: {self.direct_port} is also port, where Serve's proxy listens; choose another port for direct_port"
            )
        if self.capture is not None and self.draft is None:
            raise ValueError(
                "capture: needs a draft (the target computes the aux hidden states the shards hold only for one); set draft.source or remove capture"
            )
        if self.adapt_schedule is not None and self.capture is None:
            raise ValueError(
                "adapt_schedule: the adaptation loop trains on captured traffic; set capture or remove adapt_schedule"
            )
        if self.capture is not None and self.decode_path == "rows":
            raise ValueError(
                "capture: reads the target's final hidden states from the varlen forward; set decode_path: varlen or remove capture"
            )
        return self

    def replica_env(self) -> dict[str, str]:
        """Environment variables the engine replica's process starts with (its Ray runtime env); a command it runs
        (``adapt_schedule``) goes without them."""
        return {"GOMP_SPINCOUNT": "0"} if self.cpu_omp_passive and self.target.device != "cuda" else {}

    def direct_ingress_env(self) -> dict[str, str]:
        """The environment Ray Serve's controller and replicas must start with for ``direct_port`` (read once, at
        their start): direct ingress on, and the replica's HTTP port range that one port ({} without direct_port)."""
        if self.direct_port is None:
            return {}
        return {
            "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(self.direct_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(self.direct_port + 1),
        }

    def check_direct_ingress(self, env: Mapping[str, str]) -> None:
        """In the replica: ``direct_port`` set but this process started without :meth:`direct_ingress_env` (``serve run``
        or ``serve deploy`` of the YAML instead of ``eagleray serve``) would never listen on it; raise instead."""
        want = self.direct_ingress_env()
        if any(env.get(k) != v for k, v in want.items()):
            have = {k: env.get(k) for k in want}
            raise EaglerayError(
                f"serving.direct_port={self.direct_port}: this replica started without Ray Serve's direct ingress on that "
                f"port (its environment has {have})\n    fix: start it with `eagleray serve --config ...` (it sets "
                f"{want} before Ray starts), or set them in the Ray cluster's environment, or remove direct_port"
            )

    def engine_config(self, **update: Any) -> EngineConfig:
        """The engine's part of this config, with ``update`` applied (e.g. the resolved target and draft)."""
        return EngineConfig(**{name: getattr(self, name) for name in EngineConfig.model_fields} | update)
