"""serve/measure.measure_draft: the training hook (evaluate_with_engine) measures τ and speed of a draft with the engine."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_measure_tiny_target_random_draft(tmp_path):
    from eagleray.platform.checkpoints.draft_factory import make_random_draft
    from eagleray.platform.checkpoints.target import TargetSpec
    from eagleray.platform.config.schemas import TargetConfig, TrainingConfig
    from eagleray.serve.measure import measure_draft as measure
    from eagleray.tests.support.tiny import make_tiny_llama

    target_dir = make_tiny_llama(tmp_path / "target", num_layers=4, max_positions=4096)
    draft_dir = make_random_draft(TargetSpec.from_dir(target_dir), tmp_path / "draft")
    cfg = TrainingConfig(
        data_dir=str(tmp_path / "data"),
        output_dir=str(tmp_path / "out"),
        target=TargetConfig(model=str(target_dir), device="cpu"),
    )
    out = measure(cfg, draft_dir, limit=2, max_tokens=8)
    for suite in ("mtbench", "humaneval"):
        pre = f"engine/{suite}"
        assert out[f"{pre}/lossless"] == 1.0
        assert out[f"{pre}/tau"] >= 1.0
        assert out[f"{pre}/plain_tokens_per_s"] > 0 and out[f"{pre}/spec_tokens_per_s"] > 0
        assert out[f"{pre}/speedup"] > 0
        assert sorted(k for k in out if k.startswith(f"{pre}/acc_pos_")) == [f"{pre}/acc_pos_{i}" for i in range(4)]
    assert all(isinstance(v, float) for v in out.values())
