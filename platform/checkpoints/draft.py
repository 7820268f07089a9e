"""EAGLE-3 draft checkpoints in the format vLLM and SGLang/SpecForge load.

A draft directory holds ``config.json`` and ``model.safetensors``:

- config: ``architectures: ["LlamaForCausalLMEagle3"]``, Llama fields for the one decoder layer
  (hidden_size, heads, head_dim, intermediate_size, rope, rms_norm_eps, max_position_embeddings),
  ``num_hidden_layers: 1``, ``vocab_size`` (the target's), ``draft_vocab_size``,
  ``target_hidden_size``, ``eagle_config: {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}``
  and, for drafts eagleray wrote, an ``eagleray`` block (:class:`DraftMetadata`).
- tensors: ``fc.weight`` [H, n_aux*H_t], ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`` [H],
  ``midlayer.self_attn.{q,k,v}_proj.weight`` [heads*head_dim, 2H], ``midlayer.self_attn.o_proj.weight`` [H, heads*head_dim],
  ``midlayer.mlp.{gate,up}_proj.weight`` [I, H], ``midlayer.mlp.down_proj.weight`` [H, I], ``norm.weight`` [H],
  ``lm_head.weight`` [draft_vocab, H], ``d2t`` [draft_vocab] int64 (target_id = draft_id + d2t[draft_id]),
  ``t2d`` [vocab] bool, optionally ``embed_tokens.weight`` [vocab, H] (else the target's is shared).

A full-vocabulary draft (``draft_vocab_size == vocab_size``) has the identity map and is written
without ``d2t``/``t2d``: vLLM's ``Eagle3LlamaForCausalLM`` only has a ``draft_id_to_target_id``
parameter when the two sizes differ, yet renames any ``d2t`` it reads to that name and refuses the
checkpoint ("no module or parameter named 'draft_id_to_target_id'"). :meth:`DraftCheckpoint.load_tensors`
gives the identity maps back to readers that ask for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eagleray.platform.config.load import StrictModel, parse_config
from eagleray.platform.errors import EaglerayError
from eagleray.platform.paths import atomic_dir

EAGLE3 = "eagle3"
EAGLE = "eagle"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM", "EAGLEModel")
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1


class DraftMetadata(StrictModel):
    """eagleray's record of how a draft was made (config.json key ``eagleray``)."""

    format_version: int = Field(FORMAT_VERSION, description="Version of this metadata block.")
    target_fingerprint: str | None = Field(None, description="Fingerprint of the target the draft was trained for.")
    tokenizer_fingerprint: str | None = Field(None, description="Fingerprint of the target tokenizer's token -> id map.")
    aux_layer_ids: list[int] = Field(description="Target layer ids whose input hidden states the draft consumes.")
    dataset_id: str | None = Field(None, description="Id of the training data manifest (datagen).")
    created_by: str = Field("eagleray", description="Tool and purpose that wrote the draft.")
    notes: dict[str, Any] = Field(default_factory=dict, description="Free-form facts (training steps, metrics).")


def derive_algorithm(config: dict[str, Any], shapes: dict[str, list[int]]) -> str | None:
    """The speculative algorithm a draft checkpoint was built for, from its files alone.

    Architectures decide when present; otherwise the weights do (``midlayer.*``/``d2t`` or an
    fc over 3 hidden states mean EAGLE-3; ``layers.0.*`` with an fc over 2 mean EAGLE).
    """
    archs = config.get("architectures") or []
    if any(a in EAGLE3_ARCHITECTURES for a in archs):
        return EAGLE3
    if any(a in EAGLE_ARCHITECTURES for a in archs):
        return EAGLE
    hidden = config.get("target_hidden_size") or config.get("hidden_size")
    fc = shapes.get("fc.weight")
    if any(k.startswith("midlayer.") for k in shapes) or "d2t" in shapes:
        return EAGLE3
    if fc and hidden and fc[1] == 2 * hidden:
        return EAGLE
    if fc and hidden and fc[1] % hidden == 0 and fc[1] // hidden >= 3:
        return EAGLE3
    return None


@dataclass
class DraftCheckpoint:
    """A draft directory opened lazily: config and tensor shapes, tensors on demand."""

    path: Path
    config: dict[str, Any] = field(repr=False)
    shapes: dict[str, list[int]] = field(repr=False)
    dtypes: dict[str, str] = field(repr=False)

    @classmethod
    def open(cls, path: str | Path) -> "DraftCheckpoint":
        """Read config.json and the safetensors headers; raise EaglerayError if unreadable."""
        from eagleray.platform.checkpoints.target import read_model_dir

        p, config = read_model_dir(path, "draft", "pass a draft checkpoint directory (config.json + model.safetensors)")
        shapes, dtypes = read_headers(p)
        return cls(path=p, config=config, shapes=shapes, dtypes=dtypes)

    @property
    def algorithm(self) -> str | None:
        return derive_algorithm(self.config, self.shapes)

    @cached_property
    def metadata(self) -> DraftMetadata | None:
        raw = self.config.get("eagleray")
        if raw is None:
            return None
        return parse_config(DraftMetadata, raw, source=str(self.path / "config.json"), prefix="draft.config.eagleray")

    @property
    def aux_layer_ids(self) -> list[int] | None:
        ids = (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None and self.metadata is not None:
            ids = self.metadata.aux_layer_ids
        return None if ids is None else [int(i) for i in ids]

    @property
    def draft_vocab_size(self) -> int:
        return int(self.config.get("draft_vocab_size") or self.config["vocab_size"])

    def load_tensors(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Load tensors (all, or ``names``) from the safetensors files on CPU."""
        out: dict[str, torch.Tensor] = {}
        for f in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if names is None or name in names:
                        out[name] = sf.get_tensor(name)
        vocab = self.config.get("vocab_size")
        if vocab is not None and self.draft_vocab_size == int(vocab):
            wanted = [n for n in ("d2t", "t2d") if n not in out and (names is None or n in names)]
            out.update({n: t for n, t in identity_maps(self.draft_vocab_size).items() if n in wanted})
        return out


def read_headers(path: Path) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Names, shapes and dtypes of every tensor; a truncated or corrupt file is a clear error."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EaglerayError(
            f"draft: no *.safetensors file in {path}\n    fix: copy the draft's model.safetensors next to its config.json"
        )
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    sl = sf.get_slice(name)
                    shapes[name] = list(sl.get_shape())
                    dtypes[name] = str(sl.get_dtype())
            _check_size(f)
        except (SafetensorError, OSError, ValueError) as err:
            raise EaglerayError(
                f"draft: {f} is corrupt or truncated ({err})\n    fix: copy the file again from its source; its size must match its header"
            ) from None
    return shapes, dtypes


def _check_size(f: Path) -> None:
    """safetensors maps lazily: compare the file size with the header's last data offset."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    size = f.stat().st_size
    if size < 8 + n + end:
        raise ValueError(f"file has {size} bytes, header needs {8 + n + end}")


def save_draft(
    out_dir: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], metadata: DraftMetadata | None = None
) -> Path:
    """Write a draft checkpoint atomically (temp dir + rename); returns the directory."""
    out = Path(out_dir)
    cfg = dict(config)
    if metadata is not None:
        cfg["eagleray"] = metadata.model_dump(mode="json")
    tensors = _without_identity_maps(cfg, tensors)
    with atomic_dir(out) as tmp:
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"}
        )
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def identity_maps(vocab: int) -> dict[str, torch.Tensor]:
    """The vocabulary maps of a full-vocabulary draft: d2t [V] int64 zeros, t2d [V] bool ones."""
    return {"d2t": torch.zeros(vocab, dtype=torch.int64), "t2d": torch.ones(vocab, dtype=torch.bool)}


def _without_identity_maps(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop d2t/t2d of a full-vocabulary draft (vLLM cannot load them, see the module docstring)."""
    vocab = cfg.get("vocab_size")
    if vocab is None or int(cfg.get("draft_vocab_size") or vocab) != int(vocab) or "d2t" not in tensors:
        return tensors
    if bool(tensors["d2t"].any()):
        raise EaglerayError(
            f"draft.weights.d2t: draft_vocab_size == vocab_size == {vocab} but d2t is not the identity map "
            f"(vLLM cannot load a permuted full vocabulary)\n"
            f"    fix: build the maps with eagleray.platform.checkpoints.draft_factory.vocab_map, or use a smaller draft_vocab_size"
        )
    return {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
