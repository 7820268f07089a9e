"""Stable fingerprints of a target model and its tokenizer.

A draft records both when it is trained; the guard refuses to serve it on a target whose
fingerprints differ. The target fingerprint hashes the architecture-relevant config keys and
the weights' names and shapes (not their dtype or values: the bf16 and fp32 copies of one model
share a fingerprint). The tokenizer fingerprint hashes the token -> id mapping.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from eagleray.platform.errors import EaglerayError

ARCH_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
)


def _digest(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def weight_shapes(model_dir: str | Path) -> dict[str, list[int]]:
    """Names and shapes of every tensor in a HF directory's safetensors files (headers only)."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise EaglerayError(
            f"{d}: no *.safetensors files\n    fix: point at a Hugging Face model directory saved with safetensors"
        )
    shapes: dict[str, list[int]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                shapes[name] = list(sf.get_slice(name).get_shape())
    return shapes


def target_fingerprint(config: dict[str, Any], shapes: dict[str, list[int]]) -> str:
    """Hash of the architecture config and the weights' names/shapes."""
    arch = {k: config.get(k) for k in ARCH_KEYS if config.get(k) is not None}
    return "tgt-" + _digest({"config": arch, "weights": sorted(shapes.items())})


def vocab_fingerprint(vocab: dict[str, int]) -> str:
    """Hash of a token -> id mapping (added tokens included)."""
    return "tok-" + _digest(sorted(vocab.items(), key=lambda kv: kv[1]))


def tokenizer_vocab(model_dir: str | Path) -> dict[str, int]:
    """The full token -> id mapping of the tokenizer saved in ``model_dir``."""
    d = Path(model_dir)
    tj = d / "tokenizer.json"
    if tj.is_file():
        data = json.loads(tj.read_text())
        raw = data.get("model", {}).get("vocab") or {}
        # BPE/WordPiece store {token: id}; Unigram stores [[piece, score], ...] indexed by id.
        vocab = dict(raw) if isinstance(raw, dict) else {piece: i for i, (piece, _score) in enumerate(raw)}
        for tok in data.get("added_tokens", []):
            vocab[tok["content"]] = tok["id"]
        if vocab:
            return vocab
    from transformers import AutoTokenizer  # slow path for tokenizers without tokenizer.json

    return dict(AutoTokenizer.from_pretrained(str(d)).get_vocab())


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    return vocab_fingerprint(tokenizer_vocab(model_dir))
