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

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("EAGLERAY_HOME", str(REPO / ".cache" / "eagleray"))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny random Llama HF directory (8 layers, hidden 64, GQA, tied embeddings)."""
    from eagleray.tests.support.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="session")
def smollm2_fp32() -> Path:
    """The real SmolLM2-135M-Instruct converted to an fp32 HF directory (once per cache)."""
    from eagleray.platform.checkpoints.smollm2 import smollm2_dir

    return smollm2_dir("fp32")
