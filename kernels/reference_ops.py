"""The PyTorch ops that the decode kernels' references are built from, shared with the model code.

The model (``platform/models``) computes rotary embeddings and stores new K/V with these same
functions, so a kernel's reference is, op for op, what the model's own forward computes.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # x [..., D] -> [..., D]
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], inv_freq [D/2] -> cos, sin [T, 1, D] computed in fp32 (as transformers does), cast to ``dtype``."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new k, v [T, Hkv, D] into one layer's cache [num_blocks, block_size, Hkv, D] at ``slot_mapping`` [T]."""
    flat_k = cache_k.view(-1, *cache_k.shape[2:])  # [num_blocks*block_size, Hkv, D]
    flat_v = cache_v.view(-1, *cache_v.shape[2:])  # [num_blocks*block_size, Hkv, D]
    flat_k[slot_mapping] = k.to(flat_k.dtype)
    flat_v[slot_mapping] = v.to(flat_v.dtype)
