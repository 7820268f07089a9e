"""Tensor parallelism: TP=2 over gloo (two spawned processes) equals TP=1, target and draft."""

from __future__ import annotations

import pytest
import torch

from eagleray.platform.draft_factory import make_random_draft
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.arch import LlamaArch
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.tp import TPInfo
from eagleray.platform.models.tp_check import AUX_IDS, compare
from eagleray.platform.target import TargetSpec


def test_tp2_gloo_equals_single_process(tiny_dirs, tmp_path):
    model_dir = tiny_dirs["llama_odd_vocab"]  # vocab 97: the last rank's vocab shard is padded
    draft_dir = make_random_draft(TargetSpec.from_dir(model_dir), tmp_path / "draft", aux_layer_ids=AUX_IDS,
                                  draft_vocab_size=33, counts=torch.arange(97.0))
    report = compare(model_dir, world=2, backend="gloo", draft_dir=draft_dir)
    assert report["greedy_equal"], report
    for key in ("logits", "aux", "decode", "draft"):
        assert report[key] < 1e-5, report


def test_heads_that_do_not_split_are_refused(tiny_dirs):
    arch = LlamaArch.from_config({**TargetSpec.from_dir(tiny_dirs["llama_tied"]).config, "num_key_value_heads": 1})
    with pytest.raises(EaglerayError, match="num_key_value_heads=1 is not divisible by the tensor-parallel size 2"):
        LlamaModel(arch, tp=TPInfo(rank=0, world=2))
