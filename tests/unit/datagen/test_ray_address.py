"""Which Ray cluster datagen runs on: a private local instance unless one is named; a dead one is a clear error.

Ray's own default (address=None) joins whatever /tmp/ray's address file names, even a cluster whose
processes were killed without `ray stop`; the tests and local runs must never take that path.
"""

from __future__ import annotations

import time

import pytest

from eagleray.datagen.pipeline import ray_address, run_datagen
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.errors import EaglerayError
from eagleray.platform.host import free_port
from eagleray.tests.support.datagen import datagen_config


def test_default_is_a_private_local_instance(monkeypatch, tiny_target, prompt_file, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = DatagenConfig(**datagen_config(tiny_target, prompt_file, tmp_path / "out"))
    assert ray_address(cfg) == ("local", "default")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(cfg) == ("10.0.0.1:6379", "RAY_ADDRESS")
    cfg = DatagenConfig(**datagen_config(tiny_target, prompt_file, tmp_path / "out", ray_address="10.0.0.2:6379"))
    assert ray_address(cfg) == ("10.0.0.2:6379", "ray_address")


@pytest.mark.parametrize("via", ["RAY_ADDRESS", "ray_address"])
def test_a_cluster_that_is_gone_is_a_clear_error(monkeypatch, tiny_target, prompt_file, tmp_path, via):
    import ray

    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    over = {"ray_address": dead} if via == "ray_address" else {}
    if via == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", dead)
    cfg = DatagenConfig(**datagen_config(tiny_target, prompt_file, tmp_path / "out", **over))
    t0 = time.perf_counter()
    with pytest.raises(EaglerayError) as info:
        run_datagen(cfg, emit=lambda s: None)
    assert time.perf_counter() - t0 < 30  # ray.init itself would retry for minutes
    msg = str(info.value)
    assert f"{via}: the Ray cluster at {dead} does not answer" in msg and "fix:" in msg, msg
    assert not ray.is_initialized()
