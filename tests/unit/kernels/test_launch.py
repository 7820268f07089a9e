"""EAGLERAY_PDL: programmatic dependent launch only where it is supported, a clear error where it is forced and
cannot run, and a clear error for a value it does not know. (That PDL leaves the step's bits unchanged is
tests/gpu/test_graphs_gpu.py's: it needs a Hopper GPU.)"""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import launch
from eagleray.kernels.errors import KernelInputError

CPU = torch.device("cpu")


@pytest.mark.parametrize("mode", ["auto", "off", "", "AUTO"])
def test_pdl_stays_off_where_it_cannot_run(monkeypatch, mode):
    monkeypatch.setenv(launch.PDL_ENV, mode)
    assert launch.pdl_enabled(CPU) is False
    assert launch.pdl_launch(CPU) == {"PDL": False}  # no launch_pdl keyword: the interpreter and old GPUs never see it


def test_pdl_forced_on_a_device_without_it_names_the_setting_and_the_fix(monkeypatch):
    monkeypatch.setenv(launch.PDL_ENV, "on")
    with pytest.raises(KernelInputError, match="EAGLERAY_PDL.*compute capability >= 9.*EAGLERAY_PDL=auto"):
        launch.pdl_enabled(CPU)


def test_pdl_unknown_value_is_refused(monkeypatch):
    monkeypatch.setenv(launch.PDL_ENV, "yes")
    with pytest.raises(KernelInputError, match="EAGLERAY_PDL: expected one of auto, on, off, got 'yes'"):
        launch.pdl_mode()


def test_pdl_auto_turns_on_for_a_supported_device(monkeypatch):
    monkeypatch.setenv(launch.PDL_ENV, "auto")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(launch, "_supported", lambda device: True)
    assert launch.pdl_launch(CPU) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no PDL: off even on a supported device
    assert launch.pdl_launch(CPU) == {"PDL": False}
