"""Tensor parallelism: TP=2 over gloo (two spawned processes) equals TP=1, target and draft."""

from __future__ import annotations

import pytest
import torch

from eagleray.jobs.bench.tp_check import AUX_IDS, compare
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.arch import LlamaArch
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.tp import TPInfo


def test_tp2_gloo_equals_single_process(tiny_dirs, tmp_path):
    model_dir = tiny_dirs["llama_odd_vocab"]  # vocab 97: the last rank's vocab shard is padded
    draft_dir = make_random_draft(
        TargetSpec.from_dir(model_dir), tmp_path / "draft", aux_layer_ids=AUX_IDS, draft_vocab_size=33, counts=torch.arange(97.0)
    )
    report = compare(model_dir, world=2, backend="gloo", draft_dir=draft_dir)
    assert report["greedy_equal"], report
    for key in ("logits", "aux", "decode", "draft"):
        assert report[key] < 1e-5, report


def test_uneven_gqa_groups_tp2_equals_single_process(tmp_path):
    """SmolLM2's case: 3 KV heads (9 query heads) over 2 ranks -> 2 + 1 whole GQA groups."""
    from eagleray.tests.support.tiny import make_tiny_llama

    model_dir = make_tiny_llama(
        tmp_path / "gqa3", num_layers=4, hidden_size=48, num_heads=6, num_kv_heads=3, intermediate_size=64
    )
    ranks = [
        LlamaModel(LlamaArch.from_config(TargetSpec.from_dir(model_dir).config), tp=TPInfo(rank=r, world=2)) for r in range(2)
    ]
    attn = [m.layers[0].self_attn for m in ranks]
    assert [(a.kv_heads, a.heads) for a in attn] == [(2, 4), (1, 2)]
    assert [tuple(a.o_proj.weight.shape) for a in attn] == [(48, 32), (48, 16)]
    draft_dir = make_random_draft(TargetSpec.from_dir(model_dir), tmp_path / "draft", aux_layer_ids=AUX_IDS)
    report = compare(model_dir, world=2, backend="gloo", draft_dir=draft_dir)
    assert report["greedy_equal"], report
    for key in ("logits", "aux", "decode", "draft"):
        assert report[key] < 1e-5, report


def test_heads_that_do_not_split_are_refused(tiny_dirs):
    arch = LlamaArch.from_config({**TargetSpec.from_dir(tiny_dirs["llama_tied"]).config, "num_key_value_heads": 1})
    with pytest.raises(EaglerayError, match="num_key_value_heads=1 cannot be split over tensor-parallel size 2"):
        LlamaModel(arch, tp=TPInfo(rank=0, world=2))
