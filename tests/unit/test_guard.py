"""The compatibility guard through `eagleray doctor`: each misconfiguration exits 2 with a clear message."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleray.jobs.cli import main
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec


@pytest.fixture(scope="module")
def good_draft(tiny_target, tmp_path_factory) -> Path:
    counts = torch.arange(TargetSpec.from_dir(tiny_target).vocab_size, dtype=torch.float32)
    return make_random_draft(
        TargetSpec.from_dir(tiny_target), tmp_path_factory.mktemp("d") / "good", draft_vocab_size=100, counts=counts
    )


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


def _heads(heads, kv, head_dim=16, hidden=64):
    """Config and matching attention weights for ``heads`` query heads and ``kv`` key/value heads."""

    def config(cfg):
        cfg.update(num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)

    def tensors(t):
        a = "midlayer.self_attn."
        t[a + "q_proj.weight"] = torch.zeros(heads * head_dim, 2 * hidden)
        t[a + "k_proj.weight"] = torch.zeros(kv * head_dim, 2 * hidden)
        t[a + "v_proj.weight"] = torch.zeros(kv * head_dim, 2 * hidden)
        t[a + "o_proj.weight"] = torch.zeros(hidden, heads * head_dim)

    return config, tensors


def _shape(name, *shape):
    def edit(t):
        t[name] = torch.zeros(*shape)

    return edit


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
    (
        "eagle3-served-as-eagle",
        None,
        None,
        ["--algorithm", "eagle"],
        "configured algorithm 'eagle' but the draft checkpoint is an EAGLE3",
    ),
    (
        "eagle-served-as-eagle3",
        _eagle1,
        _eagle1_weights,
        ["--algorithm", "eagle3"],
        "configured algorithm 'eagle3' but the draft checkpoint is an EAGLE draft",
    ),
    ("eagle-draft-default", _eagle1, _eagle1_weights, [], "eagleray serves EAGLE-3 drafts"),
    ("unknown-algorithm", None, None, ["--algorithm", "medusa"], "unknown speculative algorithm 'medusa'"),
    ("tokenizer-fingerprint", _meta("tokenizer_fingerprint", "tok-000000000000000000000000"), None, [], "tokenizer_fingerprint"),
    ("target-fingerprint", _meta("target_fingerprint", "tgt-000000000000000000000000"), None, [], "target_fingerprint"),
    ("rope-theta", _set("rope_theta", 500000.0), None, [], "draft.config.rope_theta"),
    ("max-positions", _set("max_position_embeddings", 128), None, [], "max_position_embeddings: is 128 but serving allows 512"),
    ("midlayer-missing", None, _drop("midlayer.mlp.down_proj.weight"), [], "missing tensors ['midlayer.mlp.down_proj.weight']"),
    ("q-proj-shape", _set("num_attention_heads", 8), None, [], "midlayer.self_attn.q_proj.weight: has shape"),
    ("use-aux-false", lambda c: c["eagle_config"].update(use_aux_hidden_state=False), None, [], "use_aux_hidden_state"),
    # the draft's own head geometry (the 9 heads / 4 kv heads passed with exit 0)
    ("heads-9-kv-4", *_heads(9, 4), [], "draft.config.num_key_value_heads: 9 attention heads cannot be split into 4"),
    ("kv-more-than-heads", *_heads(2, 4), [], "2 attention heads cannot be split into 4"),
    (
        "o-proj-shape",
        None,
        _shape("midlayer.self_attn.o_proj.weight", 64, 32),
        [],
        "midlayer.self_attn.o_proj.weight: has shape [64, 32]",
    ),
    (
        "k-proj-shape",
        None,
        _shape("midlayer.self_attn.k_proj.weight", 48, 128),
        [],
        "midlayer.self_attn.k_proj.weight: has shape [48, 128]",
    ),
    (
        "kv-heads-vs-weights",
        _set("num_key_value_heads", 4),
        None,
        [],
        "midlayer.self_attn.k_proj.weight: has shape [32, 128], config implies [64, 128]",
    ),
    (
        "heads-not-an-int",
        _set("num_attention_heads", "nine"),
        None,
        [],
        "draft.config.num_attention_heads: is 'nine', not a positive integer",
    ),
    ("heads-missing", lambda c: c.pop("num_attention_heads"), None, [], "draft.config.num_attention_heads: is missing"),
    ("hidden-not-an-int", _set("hidden_size", "64"), None, [], "draft.config.hidden_size: is '64', not a positive integer"),
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


def test_grouped_heads_that_divide_pass(capsys, tmp_path, tiny_target, good_draft):
    """The geometry check refuses only what cannot be grouped: 8 heads / 4 key/value heads with matching weights serve."""
    rc, text = _doctor(capsys, tiny_target, _variant(good_draft, tmp_path / "h8kv4", *_heads(8, 4)))
    assert rc == 0, text


def _bad_target(tmp_path, tiny_target, edit) -> Path:
    out = tmp_path / "target"
    shutil.copytree(tiny_target, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda c: c.pop("hidden_size"), "target.config.hidden_size: is missing"),
        (lambda c: c.pop("num_hidden_layers"), "target.config.num_hidden_layers: is missing"),
        (lambda c: c.update(vocab_size="many"), "target.config.vocab_size: is 'many', not a positive integer"),
        (lambda c: c.update(num_attention_heads=0), "target.config.num_attention_heads: is 0, not a positive integer"),
        (lambda c: c.update(head_dim=-1), "target.config.head_dim: is -1"),
        (
            lambda c: c.update(num_attention_heads=3, num_key_value_heads=2),
            "target.config.num_key_value_heads: 3 attention heads",
        ),
        (lambda c: c.update(num_attention_heads=3, num_key_value_heads=3, head_dim=None), "target.config.head_dim: is not set"),
    ],
)
def test_malformed_target_config_exits_2_naming_file_and_field(capsys, tmp_path, tiny_target, good_draft, edit, expect):
    """Was exit 1 with a KeyError traceback."""
    target = _bad_target(tmp_path, tiny_target, edit)
    rc, text = _doctor(capsys, target, good_draft)
    assert rc == 2 and expect in text and str(target / "config.json") in text, text
    assert "Traceback" not in text and "KeyError" not in text and "fix:" in text
