"""``bench cpu-linear``: the implementations it times, named on the command line."""

from __future__ import annotations

import pytest
import torch

from eagleray.jobs.bench import cpu_linear
from eagleray.kernels import cpu_decode, cpu_decode_build
from eagleray.platform.errors import EaglerayError


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    """The suite sets torch's and the native kernel's threads and the dispatch mode: put them back."""
    monkeypatch.setattr(cpu_decode, "_threads", cpu_decode.threads())
    monkeypatch.setattr(cpu_decode, "_mode", cpu_decode._mode)
    monkeypatch.setattr(cpu_decode, "_why_not", cpu_decode._why_not)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_an_unknown_implementation_is_refused_naming_the_flag():
    with pytest.raises(EaglerayError, match=r"(?s)--impls 'native,mkl'.*fix: --impls native,torch"):
        cpu_linear.run(["--impls", "native,mkl", "--rows", "1"])


@pytest.mark.skipif(cpu_decode_build.unsupported() is not None, reason=f"native CPU linear: {cpu_decode_build.unsupported()}")
def test_the_native_kernel_alone_is_timed_against_its_reference(tmp_path):
    out = cpu_linear.run(["--impls", "native", "--rows", "2", "--reps", "1", "--json", str(tmp_path / "r.json")])
    (rec,) = out["records"]
    assert rec["rows"] == 2 and rec["native_ms"] > 0
    assert "torch_ms" not in rec and "native_vs_torch" not in rec
