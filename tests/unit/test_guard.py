"""The compatibility guard through `eagleray doctor`: each misconfiguration exits 2 with a clear message."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleray.platform.cli import main
from eagleray.platform.draft_factory import make_random_draft
from eagleray.platform.target import TargetSpec


@pytest.fixture(scope="module")
def good_draft(tiny_target, tmp_path_factory) -> Path:
    counts = torch.arange(TargetSpec.from_dir(tiny_target).vocab_size, dtype=torch.float32)
    return make_random_draft(TargetSpec.from_dir(tiny_target), tmp_path_factory.mktemp("d") / "good",
                             draft_vocab_size=100, counts=counts)


def _variant(src: Path, dst: Path, config=None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"))
    return dst


def _doctor(capsys, target, draft, *extra) -> tuple[int, str]:
    rc = main(["doctor", "--target", str(target), "--draft", str(draft), *extra])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def _eagle1(cfg):
    cfg["architectures"] = ["LlamaForCausalLMEagle"]


def _strip_meta(cfg):
    cfg.pop("eagleray")


def _set(key, value):
    def edit(cfg):
        cfg[key] = value
    return edit


def _aux(ids):
    def edit(cfg):
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        cfg["eagleray"]["aux_layer_ids"] = ids
    return edit


def _meta(key, value):
    def edit(cfg):
        cfg["eagleray"][key] = value
    return edit


def _drop(name):
    def edit(t):
        del t[name]
    return edit


def _bad_d2t(t):
    t["d2t"] = t["d2t"].clone()
    t["d2t"][5] = 10_000


def _eagle1_weights(t):
    t["fc.weight"] = t["fc.weight"][:, : 2 * 64].contiguous()


# (case id, config edit, tensor edit, extra doctor args, text the message must contain)
CASES = [
    ("aux-out-of-range", _aux([2, 4, 12]), None, [], "outside [0, 8]"),
    ("aux-duplicate", _aux([2, 4, 4]), None, [], "repeat a layer"),
    ("fc-width-vs-aux-count", _aux([2, 4]), None, [], "input width is 192"),
    ("hidden-size", _set("hidden_size", 96), None, [], "draft.config.hidden_size"),
    ("head-dim", _set("head_dim", 32), None, [], "draft.config.head_dim"),
    ("vocab-size", _set("vocab_size", 500), None, [], "draft.config.vocab_size"),
    ("draft-vocab-vs-lm-head", _set("draft_vocab_size", 120), None, [], "has 100 rows but draft_vocab_size is 120"),
    ("d2t-missing", None, _drop("d2t"), [], "missing ['d2t']"),
    ("d2t-out-of-range", None, _bad_d2t, [], "outside [0, 384)"),
    ("eagle3-served-as-eagle", None, None, ["--algorithm", "eagle"], "configured algorithm 'eagle' but the draft checkpoint is an EAGLE3"),
    ("eagle-served-as-eagle3", _eagle1, _eagle1_weights, ["--algorithm", "eagle3"], "configured algorithm 'eagle3' but the draft checkpoint is an EAGLE draft"),
    ("eagle-draft-default", _eagle1, _eagle1_weights, [], "eagleray serves EAGLE-3 drafts"),
    ("unknown-algorithm", None, None, ["--algorithm", "medusa"], "unknown speculative algorithm 'medusa'"),
    ("tokenizer-fingerprint", _meta("tokenizer_fingerprint", "tok-000000000000000000000000"), None, [], "tokenizer_fingerprint"),
    ("target-fingerprint", _meta("target_fingerprint", "tgt-000000000000000000000000"), None, [], "target_fingerprint"),
    ("rope-theta", _set("rope_theta", 500000.0), None, [], "draft.config.rope_theta"),
    ("max-positions", _set("max_position_embeddings", 128), None, [], "max_position_embeddings: is 128 but serving allows 512"),
    ("midlayer-missing", None, _drop("midlayer.mlp.down_proj.weight"), [], "missing tensors ['midlayer.mlp.down_proj.weight']"),
    ("q-proj-shape", _set("num_attention_heads", 8), None, [], "midlayer.self_attn.q_proj.weight: has shape"),
    ("use-aux-false", lambda c: c["eagle_config"].update(use_aux_hidden_state=False), None, [], "use_aux_hidden_state"),
]


@pytest.mark.parametrize("case,config,tensors,extra,expect", CASES, ids=[c[0] for c in CASES])
def test_misconfiguration_refused(capsys, tmp_path, tiny_target, good_draft, case, config, tensors, extra, expect):
    draft = _variant(good_draft, tmp_path / case, config, tensors)
    rc, text = _doctor(capsys, tiny_target, draft, *extra)
    assert rc == 2, text
    assert "NOT compatible" in text and expect in text, text
    assert "fix:" in text and "Traceback" not in text


def test_corrupted_safetensors_refused(capsys, tmp_path, tiny_target, good_draft):
    draft = _variant(good_draft, tmp_path / "trunc")
    f = draft / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    rc, text = _doctor(capsys, tiny_target, draft)
    assert rc == 2 and "corrupt or truncated" in text, text


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_missing_file_refused(capsys, tmp_path, tiny_target, good_draft, name):
    draft = _variant(good_draft, tmp_path / "missing")
    (draft / name).unlink()
    rc, text = _doctor(capsys, tiny_target, draft)
    assert rc == 2 and "draft.files" in text, text


def test_all_problems_reported_at_once(capsys, tmp_path, tiny_target, good_draft):
    def many(cfg):
        cfg.update(hidden_size=96, vocab_size=500, rope_theta=1.0)
    rc, text = _doctor(capsys, tiny_target, _variant(good_draft, tmp_path / "many", many))
    assert rc == 2
    for field in ("draft.config.hidden_size", "draft.config.vocab_size", "draft.config.rope_theta"):
        assert field in text


def test_good_draft_passes(capsys, tiny_target, good_draft):
    rc, text = _doctor(capsys, tiny_target, good_draft, "--algorithm", "eagle3")
    assert rc == 0, text
    assert "compatible" in text and "fingerprints    checked" in text


def test_vllm_format_draft_without_metadata_passes(capsys, tmp_path, tiny_target, good_draft):
    """A draft as SpecForge/vLLM write it: no eagleray block, Eagle3LlamaForCausalLM arch name."""
    def vllm_style(cfg):
        cfg.pop("eagleray")
        cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
    draft = _variant(good_draft, tmp_path / "vllm", vllm_style)
    rc, text = _doctor(capsys, tiny_target, draft)
    assert rc == 0, text
    assert "not recorded" in text


def test_missing_target_dir_is_a_clean_error(capsys, tmp_path, good_draft):
    rc, text = _doctor(capsys, tmp_path / "nope", good_draft)
    assert rc == 2 and "is not a directory" in text and "Traceback" not in text
