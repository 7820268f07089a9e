"""Test-wide environment: offline, no telemetry, Triton interpreter, fast vLLM start.

These are set before any test module imports torch/triton/vllm/ray so they take effect.
"""

import os

_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "MLFLOW_ENABLE_TELEMETRY": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
for _k, _v in _ENV.items():
    os.environ.setdefault(_k, _v)
# The Triton interpreter must be on before any @triton.jit function is defined; CPU has no GPU.
if not os.environ.get("EAGLERAY_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
