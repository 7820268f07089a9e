"""What the CPU layer tests share: a layer's random weights and paged cache for the kernels (``layer_params``), a
tiny fused Llama for the model-level tests (``LLAMA_CONFIG``, ``fused_model``) and a spy on a layer kernel's calls
(``row_calls``)."""

from __future__ import annotations

import torch

from eagleray.kernels import cpu_layer
from eagleray.platform.models.layers import fuse_for_inference
from eagleray.platform.models.llama import LlamaModel

LLAMA_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip


def fused_model(dtype=torch.float32, **config) -> LlamaModel:
    """LLAMA_CONFIG (with ``config`` over it), random weights of std 0.3, q/k/v and gate/up fused for inference."""
    return fuse_for_inference(LlamaModel.from_config({**LLAMA_CONFIG, **config}, dtype=dtype, std=0.3, seed=3))


def layer_params(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, block_size: int, blocks: int,
                 seed: int = 0) -> cpu_layer.LayerParams:  # fmt: skip
    """A Llama layer's random weights (norms ~1, products scaled so outputs stay ~1-10) and a random paged cache of
    ``blocks`` blocks."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    nqkv = (heads + 2 * kv_heads) * head_dim
    cache = (blocks, block_size, kv_heads, head_dim)
    return cpu_layer.LayerParams(
        1 + 0.1 * rnd(hidden), 1 + 0.1 * rnd(hidden), 0.3 * rnd(nqkv, hidden), 0.2 * rnd(hidden, heads * head_dim),
        0.2 * rnd(2 * inter, hidden), 0.1 * rnd(hidden, inter), rnd(*cache), rnd(*cache), 1e-5, 1e-6, head_dim**-0.5,
    )  # fmt: skip


def row_calls(monkeypatch, module, name: str) -> list[int]:
    """The row counts (h.shape[0]) of every call to ``module.name`` from now on; the real function still runs."""
    seen: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda h, *a: seen.append(h.shape[0]) or real(h, *a))
    return seen
