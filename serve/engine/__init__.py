"""eagleray's inference engine: paged KV, continuous batching, EAGLE-3 speculative decoding.

This package's public API; code outside ``serve/engine/`` imports only these names (the layout
test enforces it)::

    LLMEngine           the engine: add_request / step / generate / swap_draft / current_draft / metrics / close
    AsyncEngine         the step loop on a thread for asyncio callers (stream, between_steps, health counters)
    RequestFailed       the error a stream raises when its request failed inside the engine
    EngineConfig        target, draft, KV cache, scheduling and verification settings
    SamplingParams, RequestOutput, EngineMetrics
    load_models, load_draft, close_target, TPLaunch   building the models from config (guarded), TP launch
    PHASES, bucket      step-profile phase names and the policy's batch buckets (for reports)
"""

from eagleray.serve.engine.async_engine import AsyncEngine, RequestFailed
from eagleray.serve.engine.config import EngineConfig
from eagleray.serve.engine.engine import LLMEngine
from eagleray.serve.engine.loader import close_target, load_draft, load_models
from eagleray.serve.engine.metrics import EngineMetrics
from eagleray.serve.engine.outputs import CapturedHidden, RequestOutput
from eagleray.serve.engine.policy import bucket
from eagleray.serve.engine.profile import PHASES
from eagleray.serve.engine.sampling import SamplingParams
from eagleray.serve.engine.tp_workers import TPLaunch

__all__ = [
    "PHASES",
    "AsyncEngine",
    "EngineConfig",
    "EngineMetrics",
    "LLMEngine",
    "RequestFailed",
    "RequestOutput",
    "CapturedHidden",
    "SamplingParams",
    "TPLaunch",
    "bucket",
    "close_target",
    "load_draft",
    "load_models",
]
