"""The compatibility guard's checks of the draft's weights: ``fc`` width, the midlayer's attention shapes,
complete tensors, the vocabulary map. (The config checks: :mod:`eagleray.platform.checkpoints.guard_config`.)"""

from __future__ import annotations

from eagleray.platform.checkpoints.guard_config import GuardContext, config_problem
from eagleray.platform.checkpoints.vocab_check import check_vocab_map
from eagleray.platform.errors import Problem

MIDLAYER = (
    "input_layernorm",
    "hidden_norm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _wrong_shape(c: GuardContext, name: str, want: list[int], why: str, fix: str) -> list[Problem]:
    """The problem of draft tensor ``name`` when the draft holds it with a shape other than ``want`` (``why``: where
    ``want`` comes from); none when it is absent (:func:`check_tensors` reports missing ones) or right."""
    s = c.shape(name)
    if s is None or s == want:
        return []
    return [Problem(f"draft.weights.{name}", f"has shape {s}, {why}", fix)]


def check_fc(c: GuardContext) -> list[Problem]:
    fc = c.shape("fc.weight")
    t_hidden = int(c.cfg.get("target_hidden_size") or c.hidden)
    out = []
    if c.cfg.get("target_hidden_size") is not None and t_hidden != c.target.hidden_size:
        out.append(
            Problem(
                "draft.config.target_hidden_size",
                f"is {t_hidden} but the target's hidden_size is {c.target.hidden_size}",
                "use a draft trained for this target",
            )
        )
    if fc is None:
        return out + [
            Problem("draft.weights.fc.weight", "is missing", "use a complete EAGLE-3 checkpoint (fc.weight [H, n_aux*H])")
        ]
    want = c.target.hidden_size * len(c.aux_ids)
    if fc[1] != want:
        out.append(
            Problem(
                "draft.weights.fc.weight",
                f"input width is {fc[1]} but the target gives {len(c.aux_ids)} aux layers x "
                f"hidden {c.target.hidden_size} = {want}",
                "make eagle_aux_hidden_state_layer_ids match the layers the draft was trained on",
            )
        )
    if c.hidden and fc[0] != c.hidden:
        out.append(config_problem("draft.weights.fc.weight", f"output width {fc[0]} != draft hidden_size {c.hidden}"))
    return out


def check_attention_shapes(c: GuardContext) -> list[Problem]:
    """The midlayer's attention weights against the geometry the draft config implies."""
    problems: list[Problem] = []
    hidden, heads, kv, head_dim = c.geometry(problems)
    if problems:
        return []  # check_dims reports the config fields
    shapes = {
        "q_proj": [heads * head_dim, 2 * hidden],
        "k_proj": [kv * head_dim, 2 * hidden],
        "v_proj": [kv * head_dim, 2 * hidden],
        "o_proj": [hidden, heads * head_dim],
    }
    why = f"({heads} heads, {kv} key/value heads, head_dim {head_dim}, hidden {hidden})"
    fix = "restore the config.json that belongs to these weights"
    out = []
    for proj, want in shapes.items():
        out += _wrong_shape(c, f"midlayer.self_attn.{proj}.weight", want, f"config implies {want} {why}", fix)
    return out


def check_tensors(c: GuardContext) -> list[Problem]:
    need = [f"midlayer.{m}.weight" for m in MIDLAYER] + ["norm.weight", "lm_head.weight"]
    missing = [n for n in need if n not in c.draft.shapes]
    out = []
    if missing:
        out.append(
            Problem(
                "draft.weights",
                f"missing tensors {missing}",
                "use a complete EAGLE-3 checkpoint (see eagleray.platform.checkpoints.draft)",
            )
        )
    emb = [c.target.vocab_size, c.target.hidden_size]
    return out + _wrong_shape(
        c, "embed_tokens.weight", emb, f"the target's embedding is {emb}", "drop embed_tokens.weight to share the target's"
    )


def check_vocab(c: GuardContext) -> list[Problem]:
    return check_vocab_map(c.draft, c.target.vocab_size)
