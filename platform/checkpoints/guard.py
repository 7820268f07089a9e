"""The compatibility guard: every reason a draft cannot serve a target, reported at once.

The speculative algorithm is derived from the draft checkpoint; a configured algorithm that
disagrees (EAGLE vs EAGLE3, either way) is refused, because with the wrong one the target never
captures the hidden states the draft needs and acceptance silently stays at 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from eagleray.platform.checkpoints.draft import EAGLE, EAGLE3, DraftCheckpoint
from eagleray.platform.checkpoints.target import TargetSpec, rope_of
from eagleray.platform.checkpoints.vocab_check import check_vocab_map
from eagleray.platform.errors import CompatibilityError, EaglerayError, Problem

KNOWN_ALGORITHMS = (EAGLE3, EAGLE)
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


@dataclass
class GuardReport:
    """Outcome of a guard run: problems (empty when compatible) and facts for the summary."""

    problems: list[Problem] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self, target: str = "", draft: str = "") -> None:
        if self.problems:
            raise CompatibilityError(self.problems, target=target, draft=draft)


def check_compatibility(
    target: TargetSpec, draft_dir: str | Path, *, algorithm: str | None = None, max_model_len: int | None = None
) -> GuardReport:
    """Run every check of the compatibility guard (docs/architecture.md); never raises for a user error, returns the problems."""
    report = GuardReport()
    try:
        draft = DraftCheckpoint.open(draft_dir)
    except EaglerayError as err:
        report.problems.append(
            Problem(
                "draft.files",
                str(err).split("\n    fix: ")[0],
                _fix_of(err, "point --draft at a complete draft checkpoint directory"),
            )
        )
        return report
    ctx = _Ctx(target, draft, algorithm, max_model_len or target.max_positions)
    for check in CHECKS:
        report.problems.extend(check(ctx))
    report.facts = ctx.facts()
    return report


def ensure_compatible(target: TargetSpec, draft_dir: str | Path, **kw: Any) -> GuardReport:
    """Like :func:`check_compatibility` but raises :class:`CompatibilityError` on any problem."""
    report = check_compatibility(target, draft_dir, **kw)
    report.raise_if_failed(target=str(target.path), draft=str(draft_dir))
    return report


def _fix_of(err: Exception, default: str) -> str:
    text = str(err)
    return text.split("\n    fix: ", 1)[1] if "\n    fix: " in text else default


@dataclass
class _Ctx:
    target: TargetSpec
    draft: DraftCheckpoint
    algorithm: str | None
    max_model_len: int

    @property
    def cfg(self) -> dict[str, Any]:
        return self.draft.config

    @property
    def hidden(self) -> int:
        value = self.cfg.get("hidden_size")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0  # else _check_dims reports it

    @property
    def aux_ids(self) -> list[int]:
        return self.draft.aux_layer_ids or []

    def shape(self, name: str) -> list[int] | None:
        return self.draft.shapes.get(name)

    def facts(self) -> dict[str, Any]:
        meta = self.draft.metadata if "eagleray" in self.cfg else None
        return {
            "algorithm": self.draft.algorithm,
            "aux_layer_ids": self.aux_ids,
            "target_layers": self.target.num_layers,
            "hidden_size": self.target.hidden_size,
            "vocab_size": self.target.vocab_size,
            "draft_vocab_size": self.draft.draft_vocab_size,
            "fingerprints_recorded": bool(meta and meta.target_fingerprint),
        }


def _check_algorithm(c: _Ctx) -> list[Problem]:
    derived = c.draft.algorithm
    archs = c.cfg.get("architectures")
    fc = c.shape("fc.weight")
    evidence = f"architectures={archs}, fc.weight={fc}"
    out = []
    if derived is None:
        return [
            Problem(
                "draft.config.architectures",
                f"cannot tell which speculative algorithm the draft is for ({evidence})",
                'set architectures to ["LlamaForCausalLMEagle3"] for an EAGLE-3 draft',
            )
        ]
    if c.algorithm is not None and c.algorithm.lower() not in KNOWN_ALGORITHMS:
        out.append(
            Problem(
                "algorithm",
                f"unknown speculative algorithm {c.algorithm!r}",
                f"use {derived!r} (derived from the draft) or leave it unset",
            )
        )
    elif c.algorithm is not None and c.algorithm.lower() != derived:
        out.append(
            Problem(
                "algorithm",
                f"configured algorithm {c.algorithm!r} but the draft checkpoint is an {derived.upper()} draft "
                f"({evidence}); with {c.algorithm!r} the target would not capture the hidden states this draft reads "
                "and acceptance would stay at 1.0",
                f"set algorithm to {derived!r}, or leave it unset: eagleray derives it from the draft",
            )
        )
    if derived != EAGLE3:
        out.append(
            Problem(
                "draft.config.architectures",
                f"the draft is an {derived.upper()} draft ({evidence}); eagleray serves EAGLE-3 drafts",
                "train an EAGLE-3 draft for this target (eagleray train) or convert it",
            )
        )
    return out


def _check_aux(c: _Ctx) -> list[Problem]:
    ids, n = c.aux_ids, c.target.num_layers
    field_ = "draft.config.eagle_config.eagle_aux_hidden_state_layer_ids"
    if not ids:
        return [Problem(field_, "the draft names no aux hidden-state layers", f"set it, e.g. {c.target.default_aux_layer_ids}")]
    out = []
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        out.append(
            Problem(
                field_,
                f"layer ids {bad} are outside [0, {n}] (the target has {n} layers; id k = input of layer k)",
                f"use ids in [0, {n}], e.g. the EAGLE-3 default {c.target.default_aux_layer_ids}",
            )
        )
    if len(set(ids)) != len(ids):
        out.append(Problem(field_, f"layer ids {ids} repeat a layer", "list each layer once"))
    if (c.cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        out.append(
            Problem(
                "draft.config.eagle_config.use_aux_hidden_state",
                "is false, so the target's aux states would be ignored",
                "set use_aux_hidden_state: true for an EAGLE-3 draft",
            )
        )
    return out


def _check_fc(c: _Ctx) -> list[Problem]:
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
        out.append(
            Problem(
                "draft.weights.fc.weight",
                f"output width {fc[0]} != draft hidden_size {c.hidden}",
                "restore the draft's config.json",
            )
        )
    return out


def _config_int(c: _Ctx, key: str, out: list[Problem]) -> int | None:
    """An integer field of the draft config (None when absent); a non-integer is a problem, not a crash."""
    value = c.cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        out.append(Problem(f"draft.config.{key}", f"is {value!r}, not a positive integer", "restore the draft's config.json"))
        return None
    return value


def _check_dims(c: _Ctx) -> list[Problem]:
    """Hidden size and head geometry: the target's where they must agree, and the draft's own against its weights."""
    t, out = c.target, []
    hidden = _config_int(c, "hidden_size", out) or 0
    heads = _config_int(c, "num_attention_heads", out)
    if heads is None and "num_attention_heads" not in c.cfg:
        out.append(Problem("draft.config.num_attention_heads", "is missing", "restore the draft's config.json"))
    heads = heads or 0
    kv = _config_int(c, "num_key_value_heads", out) or heads
    head_dim = _config_int(c, "head_dim", out) or (hidden // heads if heads else 0)
    if out:
        return out
    if c.cfg.get("head_dim") is None and heads and hidden % heads:
        out.append(
            Problem(
                "draft.config.head_dim",
                f"is not set and hidden_size {hidden} is not a multiple of num_attention_heads {heads}",
                "set head_dim to the target's head_dim",
            )
        )
    for name, got, want in (("hidden_size", hidden, t.hidden_size), ("head_dim", head_dim, t.head_dim)):
        if got != want:
            out.append(
                Problem(
                    f"draft.config.{name}",
                    f"is {got} but the target's {name} is {want}",
                    "use a draft trained for this target (eagleray train builds one from the target's config)",
                )
            )
    if heads and kv and (kv > heads or heads % kv):
        out.append(
            Problem(
                "draft.config.num_key_value_heads",
                f"{heads} attention heads cannot be split into {kv} key/value "
                f"groups (num_attention_heads must be a multiple of num_key_value_heads); vLLM and transformers "
                f"refuse such a model at load",
                f"use a draft whose num_attention_heads is a multiple of "
                f"num_key_value_heads (the target has {t.num_heads} heads, {t.num_kv_heads} key/value heads)",
            )
        )
    shapes = {
        "q_proj": [heads * head_dim, 2 * hidden],
        "k_proj": [kv * head_dim, 2 * hidden],
        "v_proj": [kv * head_dim, 2 * hidden],
        "o_proj": [hidden, heads * head_dim],
    }
    for proj, want in shapes.items():
        s = c.shape(f"midlayer.self_attn.{proj}.weight")
        if s is not None and s != want:
            out.append(
                Problem(
                    f"draft.weights.midlayer.self_attn.{proj}.weight",
                    f"has shape {s}, config implies {want} "
                    f"({heads} heads, {kv} key/value heads, head_dim {head_dim}, hidden {hidden})",
                    "restore the config.json that belongs to these weights",
                )
            )
    return out


def _check_rope_positions(c: _Ctx) -> list[Problem]:
    out = []
    dr, tr = rope_of(c.cfg), c.target.rope
    if dr != tr:
        out.append(
            Problem(
                "draft.config.rope_theta",
                f"draft rope {dr} differs from the target's {tr}",
                "copy the target's rope_theta/rope_scaling into the draft config",
            )
        )
    dmax = int(c.cfg.get("max_position_embeddings") or 0)
    if dmax < c.max_model_len:
        out.append(
            Problem(
                "draft.config.max_position_embeddings",
                f"is {dmax} but serving allows {c.max_model_len} positions",
                f"lower max_model_len to {dmax} or use a draft built with max_position_embeddings >= {c.max_model_len}",
            )
        )
    return out


def _check_tensors(c: _Ctx) -> list[Problem]:
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
    emb = c.shape("embed_tokens.weight")
    if emb is not None and emb != [c.target.vocab_size, c.target.hidden_size]:
        out.append(
            Problem(
                "draft.weights.embed_tokens.weight",
                f"has shape {emb}, the target's embedding is {[c.target.vocab_size, c.target.hidden_size]}",
                "drop embed_tokens.weight to share the target's",
            )
        )
    return out


def _check_vocab(c: _Ctx) -> list[Problem]:
    return check_vocab_map(c.draft, c.target.vocab_size)


def _check_fingerprints(c: _Ctx) -> list[Problem]:
    if "eagleray" not in c.cfg:
        return []
    try:
        meta = c.draft.metadata
    except EaglerayError as err:
        return [Problem("draft.config.eagleray", str(err).splitlines()[0], "restore the metadata block eagleray wrote")]
    out = []
    if meta.target_fingerprint and meta.target_fingerprint != c.target.fingerprint:
        out.append(
            Problem(
                "draft.config.eagleray.target_fingerprint",
                f"the draft was trained for target {meta.target_fingerprint}, this target is {c.target.fingerprint}",
                "serve it with the target it was trained for, or retrain",
            )
        )
    if meta.tokenizer_fingerprint and meta.tokenizer_fingerprint != c.target.tokenizer_fingerprint:
        out.append(
            Problem(
                "draft.config.eagleray.tokenizer_fingerprint",
                f"the draft was trained with tokenizer {meta.tokenizer_fingerprint}, "
                f"the target's is {c.target.tokenizer_fingerprint}",
                "serve it with the tokenizer it was trained with, or retrain",
            )
        )
    if meta.aux_layer_ids != c.aux_ids:
        out.append(
            Problem(
                "draft.config.eagleray.aux_layer_ids",
                f"metadata says {meta.aux_layer_ids}, eagle_config says {c.aux_ids}",
                "make both lists the layers the draft was trained on",
            )
        )
    return out


CHECKS: tuple[Callable[[_Ctx], list[Problem]], ...] = (
    _check_algorithm,
    _check_aux,
    _check_fc,
    _check_dims,
    _check_rope_positions,
    _check_tensors,
    _check_vocab,
    _check_fingerprints,
)


def assert_aux_shape(aux: torch.Tensor, num_aux: int, hidden_size: int) -> None:
    """Run-time check of the first speculative step: aux states must be [T, num_aux * H]."""
    if aux is None or aux.dim() != 2 or aux.shape[-1] != num_aux * hidden_size:
        got = None if aux is None else list(aux.shape)
        raise CompatibilityError(
            [
                Problem(
                    "engine.aux_hidden_states",
                    f"captured aux states have shape {got}, the draft needs "
                    f"[T, {num_aux} x {hidden_size} = {num_aux * hidden_size}]",
                    "capture the draft's eagle_aux_hidden_state_layer_ids in the target (algorithm eagle3)",
                )
            ]
        )
