"""The compatibility guard's checks of the draft's config: algorithm, aux layers, geometry, rope and
positions, the recorded fingerprints; and :class:`GuardContext`, what every check reads.

The weight and vocabulary checks are :mod:`eagleray.platform.checkpoints.guard_tensors`;
:mod:`eagleray.platform.checkpoints.guard` runs them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagleray.platform.checkpoints.draft import EAGLE, EAGLE3, DraftCheckpoint
from eagleray.platform.checkpoints.target import TargetSpec, rope_of
from eagleray.platform.errors import EaglerayError, Problem

KNOWN_ALGORITHMS = (EAGLE3, EAGLE)


def config_problem(field: str, what: str) -> Problem:
    """A problem whose cause is the draft's config.json (a field that is wrong or missing, or a weight that disagrees
    with it): the fix is to restore that file."""
    return Problem(field, what, "restore the draft's config.json")


@dataclass
class GuardContext:
    """What every check reads: the target, the opened draft checkpoint, the configured algorithm, the positions served."""

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
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0  # else check_dims reports it

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

    def config_int(self, key: str, out: list[Problem]) -> int | None:
        """An integer field of the draft config (None when absent); a non-integer is a problem, not a crash."""
        value = self.cfg.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            out.append(config_problem(f"draft.config.{key}", f"is {value!r}, not a positive integer"))
            return None
        return value

    def geometry(self, out: list[Problem]) -> tuple[int, int, int, int]:
        """(hidden, heads, kv_heads, head_dim) the draft config implies (defaults as transformers); problems with
        those fields go to ``out``."""
        hidden = self.config_int("hidden_size", out) or 0
        heads = self.config_int("num_attention_heads", out)
        if heads is None and "num_attention_heads" not in self.cfg:
            out.append(config_problem("draft.config.num_attention_heads", "is missing"))
        heads = heads or 0
        kv = self.config_int("num_key_value_heads", out) or heads
        head_dim = self.config_int("head_dim", out) or (hidden // heads if heads else 0)
        return hidden, heads, kv, head_dim


def check_algorithm(c: GuardContext) -> list[Problem]:
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


def check_aux(c: GuardContext) -> list[Problem]:
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


def check_dims(c: GuardContext) -> list[Problem]:
    """Hidden size and head geometry of the draft config: the target's where they must agree, and consistent."""
    t, out = c.target, []
    hidden, heads, kv, head_dim = c.geometry(out)
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
    return out


def check_rope_positions(c: GuardContext) -> list[Problem]:
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


def check_fingerprints(c: GuardContext) -> list[Problem]:
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
