"""Tiny target + synthetic shards for the training tests (built once per session)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _synth():
    spec = importlib.util.spec_from_file_location("eagleray_test_synth", Path(__file__).with_name("synth.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def train_target(tmp_path_factory) -> Path:
    from eagleray.platform.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("train-tiny") / "target", num_layers=4, hidden_size=64,
                           num_heads=4, num_kv_heads=2, intermediate_size=96)


@pytest.fixture(scope="session")
def synthetic_data(train_target, tmp_path_factory) -> Path:
    return _synth().write_synthetic(train_target, tmp_path_factory.mktemp("train-data") / "data")
