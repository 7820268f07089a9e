"""eagleray's inference engine: paged KV, continuous batching, EAGLE-3 speculative decoding.

Public names::

    LLMEngine, AsyncEngine, EngineConfig, SamplingParams, RequestOutput, EngineMetrics
"""

from eagleray.serve.engine.async_engine import AsyncEngine
from eagleray.serve.engine.config import EngineConfig
from eagleray.serve.engine.engine import LLMEngine
from eagleray.serve.engine.metrics import EngineMetrics
from eagleray.serve.engine.outputs import RequestOutput
from eagleray.serve.engine.sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineConfig", "EngineMetrics", "LLMEngine", "RequestOutput", "SamplingParams"]
