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
    # A Serve proxy has 3 ready checks of this many seconds to start before its controller kills it (and serve.start
    # fails): 3 x 5 s was too short on a 2-core machine while the other xdist worker ran CPU-bound tests (the
    # quickstart and the adapt-loop module failed that way once on an AVX2-only EPYC; alone they pass).
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "20",
}
for _k, _v in _ENV.items():
    os.environ.setdefault(_k, _v)
# The Triton interpreter must be on before any @triton.jit function is defined; CPU has no GPU.
if not os.environ.get("EAGLERAY_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("EAGLERAY_HOME", str(REPO / ".cache" / "eagleray"))


# Parallel runs: `make test` is `pytest -n 2 --dist loadgroup` (pytest-xdist, two worker processes on CI's two
# cores). Every module stays whole on one worker (its module-scoped fixtures, a Ray cluster or a Serve app, start
# once; tests that read what earlier tests of the module did still run after them). The modules that start Ray
# (a local instance, `ray start` processes, `serve run`) form one lane, run on one worker in file order, so two Ray
# instances never run at once (a trial with Ray modules on both workers took about twice as long per module on 2
# cores, and a local Ray timed out starting its GCS). The lane goes first (the e2e and integration tests are
# collected first); the other modules run on the other worker meanwhile.
RAY_LANE = (
    "tests/e2e/test_quickstart.py",
    "tests/integration/test_adapt_loop.py",
    "tests/integration/test_capture_serve.py",
    "tests/integration/test_datagen_job.py",
    "tests/integration/test_node_loss.py",
    "tests/integration/test_serve_cli.py",
    "tests/integration/test_serve_engine_ingress.py",
    "tests/integration/test_serve_http.py",
    "tests/integration/test_serve_registry_metrics.py",
    "tests/integration/test_serve_tp2.py",
    "tests/integration/test_train_ray_mlflow.py",
    "tests/unit/datagen/test_answers_only.py",
    "tests/unit/datagen/test_pipeline.py",
)


def _xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups above: every module is one work unit, the Ray lane one more; the units go
    out in file order (not xdist's most-tests-first). pytest-xdist's own loadgroup does not group under pytest 9
    (its ``xdist_group`` marks rename ``item._nodeid``, which pytest 9 no longer reads), so this scheduler does."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayLaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if path in RAY_LANE else path

    config.option.loadscopereorder = False
    return RayLaneScheduling(config, log)


if importlib.util.find_spec("xdist") is not None:  # an unknown hook name is an error where pytest-xdist is missing
    pytest_xdist_make_scheduler = _xdist_make_scheduler


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny random Llama HF directory (8 layers, hidden 64, GQA, tied embeddings)."""
    from eagleray.tests.support.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="session")
def tiny_drafts(tiny_target, tmp_path_factory) -> dict[str, Path]:
    """Two random EAGLE-3 drafts of ``tiny_target``, versions ``d1`` and ``d2`` (what a hot-swap test swaps between)."""
    from eagleray.platform.checkpoints.draft_factory import make_random_draft
    from eagleray.platform.checkpoints.target import TargetSpec

    spec, root = TargetSpec.from_dir(tiny_target), tmp_path_factory.mktemp("drafts")
    return {name: make_random_draft(spec, root / name, seed=seed) for name, seed in (("d1", 1), ("d2", 2))}


@pytest.fixture(scope="session")
def smollm2_fp32() -> Path:
    """The real SmolLM2-135M-Instruct converted to an fp32 HF directory (once per cache)."""
    from eagleray.platform.checkpoints.smollm2 import smollm2_dir

    return smollm2_dir("fp32")
