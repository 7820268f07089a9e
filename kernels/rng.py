"""Counter-based hash RNG shared bit-for-bit by the Triton kernels and the PyTorch references.

Philox (`tl.rand`) cannot be reproduced in PyTorch, so kernel == reference equality for a seed
needs our own generator. This is a 32-bit "lowbias32" integer mix (Chris Wellons) applied to
(seed, position, index), computed in int64 arithmetic that never overflows (32x16-bit partial
products), so the SAME Python source runs on torch int64 tensors and inside @triton.jit code:

    base = rng_base(seed, pos)        # per (row, position) scalar: two mixes of the seed, one of pos
    bits = rng_bits(base, idx)        # per element: one mix -> 23 random bits in [0, 2**23)
    u    = (bits + 0.5) * 2**-23      # uniform in (0, 1), exactly representable in float32

`idx` is the vocabulary index for exponential/Gumbel draws and ACCEPT_IDX for the acceptance
uniform of a position, so the two never share a counter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl  # noqa: F401  (must be visible to the jit functions)

# Counter index of the acceptance uniform (never a vocabulary id).
ACCEPT_IDX = 2147483647
# 2**-23: scale from 23 random bits to (0, 1).
U_SCALE = 1.1920928955078125e-07


def _rng_base(seed, pos):
    """Mix an int64 seed (any sign) and a position into a 32-bit stream key (int64 holding uint32)."""
    lo = ((seed % 4294967296) + 4294967296) % 4294967296
    hi = (((seed >> 32) % 4294967296) + 4294967296) % 4294967296
    x = hi ^ 1640531527
    x = x ^ (x >> 16)
    x = (x * 43693 + ((x * 8688) % 65536) * 65536) % 4294967296  # x *= 0x21F0AAAD (mod 2**32)
    x = x ^ (x >> 15)
    x = (x * 11671 + ((x * 54106) % 65536) * 65536) % 4294967296  # x *= 0xD35A2D97 (mod 2**32)
    x = x ^ (x >> 15) ^ lo
    x = x ^ (x >> 16)
    x = (x * 43693 + ((x * 8688) % 65536) * 65536) % 4294967296
    x = x ^ (x >> 15)
    x = (x * 11671 + ((x * 54106) % 65536) * 65536) % 4294967296
    x = x ^ (x >> 15) ^ ((pos + 4294967296) % 4294967296)
    x = x ^ (x >> 16)
    x = (x * 43693 + ((x * 8688) % 65536) * 65536) % 4294967296
    x = x ^ (x >> 15)
    x = (x * 11671 + ((x * 54106) % 65536) * 65536) % 4294967296
    return x ^ (x >> 15)


def _rng_bits(base, idx):
    """One lowbias32 mix of (base ^ idx) -> int64 in [0, 2**23)."""
    x = base ^ idx
    x = x ^ (x >> 16)
    x = (x * 43693 + ((x * 8688) % 65536) * 65536) % 4294967296
    x = x ^ (x >> 15)
    x = (x * 11671 + ((x * 54106) % 65536) * 65536) % 4294967296
    x = x ^ (x >> 15)
    return x >> 9


rng_base = triton.jit(_rng_base)
rng_bits = triton.jit(_rng_bits)


def torch_uniform(seed: torch.Tensor, pos: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 for broadcastable int64 tensors (seed, pos, idx): the kernels' draws."""
    base = _rng_base(seed.to(torch.int64), pos.to(torch.int64))
    bits = _rng_bits(base, idx.to(torch.int64))
    return (bits.to(torch.float32) + 0.5) * U_SCALE
