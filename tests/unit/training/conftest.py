"""Tiny target + synthetic shards for the training tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def train_target(tmp_path_factory) -> Path:
    from eagleray.tests.support.tiny import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("train-tiny") / "target",
        num_layers=4,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=96,
    )


@pytest.fixture(scope="session")
def synthetic_data(train_target, tmp_path_factory) -> Path:
    from eagleray.tests.support.synth import write_synthetic

    return write_synthetic(train_target, tmp_path_factory.mktemp("train-data") / "data")
