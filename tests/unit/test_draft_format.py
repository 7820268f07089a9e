"""EAGLE-3 draft checkpoint format: write/read round trip, vocab maps, derived algorithm."""

import json

import pytest
import torch

from eagleray.platform.checkpoints.draft import EAGLE, EAGLE3, DraftCheckpoint, derive_algorithm
from eagleray.platform.checkpoints.draft_factory import eagle3_config, make_random_draft, vocab_map
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import EaglerayError


def test_vocab_map_picks_most_frequent_in_id_order():
    counts = torch.tensor([5.0, 0.0, 9.0, 9.0, 1.0, 7.0])
    d2t, t2d = vocab_map(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]
    assert t2d.tolist() == [False, False, True, True, False, True]
    with pytest.raises(EaglerayError, match="draft_vocab_size"):
        vocab_map(counts, 7)


def test_round_trip_in_vllm_layout(tiny_target, tmp_path):
    target = TargetSpec.from_dir(tiny_target)
    out = make_random_draft(target, tmp_path / "d", draft_vocab_size=50, seed=3)
    ck = DraftCheckpoint.open(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": target.default_aux_layer_ids, "use_aux_hidden_state": True}
    assert ck.algorithm == EAGLE3 and ck.draft_vocab_size == 50
    assert ck.shapes["fc.weight"] == [64, 3 * 64] and ck.shapes["lm_head.weight"] == [50, 64]
    assert ck.shapes["midlayer.self_attn.q_proj.weight"] == [64, 128]
    t = ck.load_tensors(["d2t", "t2d"])
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and int(t["t2d"].sum()) == 50
    assert ck.metadata.target_fingerprint == target.fingerprint
    assert not list(tmp_path.glob(".d.*")), "temporary directory left behind"


def test_fingerprint_ignores_dtype_but_not_shapes(tiny_target, tmp_path):
    from eagleray.platform.checkpoints.fingerprint import target_fingerprint

    t = TargetSpec.from_dir(tiny_target)
    shapes = dict(t.weight_shapes)
    assert target_fingerprint({**t.config, "torch_dtype": "bfloat16"}, shapes) == t.fingerprint
    shapes["lm_head.weight"] = [1, 1]
    assert target_fingerprint(t.config, shapes) != t.fingerprint


@pytest.mark.parametrize(
    "config,shapes,expect",
    [
        ({"architectures": ["LlamaForCausalLMEagle3"]}, {}, EAGLE3),
        ({"architectures": ["LlamaForCausalLMEagle"]}, {}, EAGLE),
        ({"hidden_size": 8}, {"midlayer.mlp.up_proj.weight": [16, 8]}, EAGLE3),
        ({"hidden_size": 8}, {"fc.weight": [8, 16], "layers.0.mlp.up_proj.weight": [16, 8]}, EAGLE),
        ({"hidden_size": 8}, {"fc.weight": [8, 24]}, EAGLE3),
        ({"hidden_size": 8}, {"lm_head.weight": [4, 8]}, None),
    ],
)
def test_derive_algorithm(config, shapes, expect):
    assert derive_algorithm(config, shapes) == expect


def test_config_follows_target_rope_scaling(tmp_path):
    from eagleray.tests.support.tiny import make_tiny_llama

    scaled = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    t = TargetSpec.from_dir(make_tiny_llama(tmp_path / "t", rope_scaling=scaled))
    cfg = eagle3_config(t)
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 8.0
