"""``bench vllm`` runs vLLM's engine in its own process: apply_model's function cannot cross to an engine process."""

from __future__ import annotations

import pytest

from eagleray.jobs.bench import vllm as bench
from eagleray.platform.errors import EaglerayError


def test_vllm_engine_in_this_process_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    bench.in_process()
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_multiprocessing_asked_for_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(EaglerayError, match="VLLM_ENABLE_V1_MULTIPROCESSING=1.*\n.*fix: unset it or set it to 0"):
        bench.in_process()
