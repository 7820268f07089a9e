"""engine.cpu_heap: glibc malloc keeps freed step temporaries instead of faulting them in again every step."""

import logging
import subprocess
import sys

import pytest
import torch

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine import startup
from eagleray.serve.engine.config import EngineConfig

CYCLES = """
import resource, sys, torch
from eagleray.serve.engine.config import EngineConfig
from eagleray.serve.engine.startup import configure_heap
configure_heap(EngineConfig(cpu_heap=sys.argv[1]), torch.device("cpu"))
x = torch.ones(16 << 20); del x  # 64 MiB, a prefill-sized temporary, faulted in once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    x = torch.ones(16 << 20); del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1])


@pytest.mark.skipif(startup._mallopt() is None, reason="the C library has no mallopt (not glibc)")
def test_retained_heap_reuses_freed_temporaries_instead_of_faulting_them_in_again():
    default, retained = _faults("default"), _faults("retain")
    assert default >= 10 * (64 << 20) // (2 << 20)  # each 64 MiB temporary faulted in again (2 MiB pages at best)
    assert retained * 5 < default


def test_retain_sets_the_thresholds_the_c_library_takes(monkeypatch):
    calls = []

    def mallopt(param, value):
        calls.append((param, value))
        return int(value <= 32 << 20 or param == startup.M_TRIM_THRESHOLD)  # a glibc that caps the mmap threshold

    monkeypatch.setattr(startup, "_mallopt", lambda: mallopt)
    assert startup.configure_heap(EngineConfig(cpu_heap="retain"), torch.device("cpu")) == 32 << 20
    assert calls[-1] == (startup.M_TRIM_THRESHOLD, startup.HEAP_TRIM_THRESHOLD)


def test_default_and_non_cpu_engines_leave_malloc_alone(monkeypatch):
    def untouched():
        raise AssertionError("mallopt looked up")

    monkeypatch.setattr(startup, "_mallopt", untouched)
    assert startup.configure_heap(EngineConfig(cpu_heap="default"), torch.device("cpu")) is None
    assert startup.configure_heap(EngineConfig(cpu_heap="retain"), torch.device("meta")) is None


def test_without_mallopt_retain_names_the_field_and_auto_says_so(monkeypatch, caplog):
    monkeypatch.setattr(startup, "_mallopt", lambda: None)
    with pytest.raises(EaglerayError, match=r"engine\.cpu_heap='retain'.*\n.*fix: set engine\.cpu_heap"):
        startup.configure_heap(EngineConfig(cpu_heap="retain"), torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger=startup.__name__):
        assert startup.configure_heap(EngineConfig(cpu_heap="auto"), torch.device("cpu")) is None
    assert "no mallopt" in caplog.text


def test_refused_thresholds_are_an_error_naming_the_field(monkeypatch):
    monkeypatch.setattr(startup, "_mallopt", lambda: lambda param, value: 0)
    with pytest.raises(EaglerayError, match=r"engine\.cpu_heap='auto': mallopt refused"):
        startup.configure_heap(EngineConfig(cpu_heap="auto"), torch.device("cpu"))


def test_a_cpu_engine_applies_it_at_start(target, tokenizer):
    from eagleray.serve.engine.engine import LLMEngine

    engine = LLMEngine(target, tokenizer, EngineConfig(max_num_seqs=2, kv_cache_gib=0.01, cpu_heap="retain"))
    assert engine.heap_mmap_threshold in startup.HEAP_MMAP_THRESHOLDS
