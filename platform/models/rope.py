"""Rotary position embeddings (GPT-NeoX "rotate half" layout, as HF Llama/Mistral/Qwen use).

Supported ``rope_type``: ``default``, ``linear`` and ``llama3`` (Llama 3.1+). Others are refused
with an error naming the field, so a model never runs with silently wrong positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from eagleray.kernels.reference_ops import rotary_cos_sin, rotate_half
from eagleray.platform.errors import EaglerayError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _require(rope: dict[str, Any], key: str) -> float:
    if key not in rope:
        raise EaglerayError(
            f"config.rope_scaling.{key} is missing for rope_type={rope['rope_type']!r}\n"
            f"    fix: add {key} to rope_scaling (or rope_parameters) in config.json"
        )
    return float(rope[key])


def _llama3(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency smoothing: long wavelengths / factor, short kept, a ramp between."""
    factor = _require(rope, "factor")
    low, high = _require(rope, "low_freq_factor"), _require(rope, "high_freq_factor")
    old_len = _require(rope, "original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)  # [D/2]
    smooth = (old_len / wavelen - low) / (high - low)  # [D/2]
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # [D/2]
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)  # [D/2]
    return torch.where(medium, smoothed, scaled)


def inv_frequencies(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32) for a :func:`eagleray.platform.target.rope_of` dict."""
    kind = rope.get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise EaglerayError(
            f"config.rope_scaling.rope_type={kind!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})\n"
            f"    fix: use a model with one of the supported rope types"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise EaglerayError(
            f"config.partial_rotary_factor={rope['partial_rotary_factor']} is not supported\n"
            f"    fix: only full rotary embeddings (partial_rotary_factor=1.0) are implemented"
        )
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim  # [D/2]
    inv_freq = 1.0 / (float(rope["rope_theta"]) ** exponent)  # [D/2]
    if kind == "linear":
        inv_freq = inv_freq / _require(rope, "factor")
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q [T, Hq, D] and k [T, Hkv, D] at integer ``positions`` [T]."""

    def __init__(self, rope: dict[str, Any], head_dim: int, device=None):
        super().__init__()
        self.head_dim = head_dim
        freqs = inv_frequencies(rope, head_dim)  # [D/2]
        self._freq_key = hash(tuple(freqs.tolist()))  # equal for every layer of a model: they share one cos/sin
        self.register_buffer("inv_freq", freqs.to(device), persistent=False)  # [D/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] computed in fp32 (as transformers does), cast to ``dtype``."""
        return rotary_cos_sin(positions, self.inv_freq.to(positions.device), dtype)  # [T, 1, D] each

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cache``: a per-forward dict (``AttentionMetadata.layouts``) so every layer reuses one cos/sin."""
        key = ("rope", self._freq_key, q.dtype)
        cos_sin = None if cache is None else cache.get(key)
        if cos_sin is None:
            cos_sin = self.cos_sin(positions, q.dtype)  # [T, 1, D] each
            if cache is not None:
                cache[key] = cos_sin
        cos, sin = cos_sin
        q = q * cos + rotate_half(q) * sin  # [T, Hq, D]
        k = k * cos + rotate_half(k) * sin  # [T, Hkv, D]
        return q, k
