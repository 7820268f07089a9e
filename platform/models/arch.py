"""Architecture facts of a Llama-family decoder, read from a HF ``config.json`` dict.

Covers Llama 2/3 (incl. ``llama3`` rope scaling), SmolLM2, Mistral (sliding window), Qwen2
(q/k/v bias) and Qwen3 (per-head q/k RMSNorm). Anything else is refused with the field and fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from eagleray.platform.checkpoints.target import SUPPORTED_TARGET_TYPES, rope_of
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.rope import SUPPORTED_ROPE_TYPES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16``... -> torch dtype."""
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    alias = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    key = alias.get(str(name), str(name).replace("torch.", ""))
    if key not in _DTYPES:
        raise EaglerayError(f"dtype={name!r} is not supported\n    fix: use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def _fail(field_: str, value: Any, fix: str) -> None:
    raise EaglerayError(f"config.{field_}={value!r} is not supported\n    fix: {fix}")


@dataclass(frozen=True)
class LlamaArch:
    """The numbers a decoder needs; built with :meth:`from_config`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any] = field(hash=False)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    max_positions: int = 0
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LlamaArch":
        mtype = config.get("model_type", "llama")
        if mtype not in SUPPORTED_TARGET_TYPES:
            _fail("model_type", mtype, f"eagleray implements {SUPPORTED_TARGET_TYPES}")
        if config.get("hidden_act", "silu") != "silu":
            _fail("hidden_act", config.get("hidden_act"), "only SiLU-gated MLPs (hidden_act='silu') are implemented")
        rope = rope_of(config)
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            _fail("rope_scaling.rope_type", rope["rope_type"], f"use a model whose rope type is one of {SUPPORTED_ROPE_TYPES}")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            model_type=mtype,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(mtype, config),
            o_bias=mtype in ("llama", "mistral") and bool(config.get("attention_bias")),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=mtype == "qwen3",
            sliding_window=_sliding_window(mtype, config),
            max_positions=int(config.get("max_position_embeddings") or 0),
            dtype=parse_dtype(config.get("torch_dtype") or config.get("dtype")),
        )


def _qkv_bias(mtype: str, config: dict[str, Any]) -> bool:
    if mtype == "qwen2":
        return True  # Qwen2 always has q/k/v bias (and no o_proj bias)
    return bool(config.get("attention_bias", False))


def _sliding_window(mtype: str, config: dict[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if mtype in ("qwen2", "qwen3"):
        if config.get("use_sliding_window"):
            _fail(
                "use_sliding_window",
                True,
                "per-layer sliding windows (Qwen max_window_layers) are not implemented; "
                "set use_sliding_window=false if the model was trained without it",
            )
        return None
    if mtype == "llama":
        return None
    return int(window) if window else None
