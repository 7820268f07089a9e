"""Llama decoder building blocks: RMSNorm, gated MLP, self-attention, decoder layer (TP-aware)."""

from __future__ import annotations

import torch
from torch import nn

from eagleray.kernels import cpu_gemm, cpu_panels
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models import native_layer
from eagleray.platform.models.arch import LlamaArch
from eagleray.platform.models.attention import AttentionMetadata, paged_attention
from eagleray.platform.models.rope import RotaryEmbedding
from eagleray.platform.models.tp import (
    ColumnParallelLinear,
    FusedLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPInfo,
    default_weight_loader,
    new_param,
    split_sizes,
)

KVLayer = tuple[torch.Tensor, torch.Tensor]  # one layer's K, V [num_blocks, block_size, Hkv_local, D]


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 like transformers."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = new_param((dim,), dtype, device, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., dim] -> [..., dim]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one kernel, same values
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, arch: LlamaArch, tp: TPInfo, device=None):
        super().__init__()
        h, i, dt = arch.hidden_size, arch.intermediate_size, arch.dtype
        self.gate_proj = ColumnParallelLinear(h, i, arch.mlp_bias, tp, dt, device, "intermediate_size")
        self.up_proj = ColumnParallelLinear(h, i, arch.mlp_bias, tp, dt, device, "intermediate_size")
        self.down_proj = RowParallelLinear(i, h, arch.mlp_bias, tp, dt, device, "intermediate_size")
        self.gate_up: FusedLinear | None = None  # set by fuse() for inference

    def fuse(self) -> None:
        """Inference: gate and up in one GEMM."""
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] -> [T, H]
        if self.gate_up is not None:
            gate, up = self.gate_up(x)  # [T, I/tp] each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)  # [T, I/tp] each
        return self.down_proj(nn.functional.silu(gate) * up)


class SelfAttention(nn.Module):
    """GQA self-attention with rotary embeddings; heads split across TP ranks.

    ``in_features`` is the q/k/v input width (2H for the EAGLE-3 draft layer, H otherwise).
    """

    def __init__(self, arch: LlamaArch, tp: TPInfo, device=None, in_features: int | None = None):
        super().__init__()
        d, dt = arch.head_dim, arch.dtype
        inp = in_features or arch.hidden_size
        if arch.num_heads % arch.num_kv_heads:
            raise EaglerayError(
                f"num_attention_heads={arch.num_heads} is not a multiple of num_key_value_heads={arch.num_kv_heads}\n"
                "    fix: the config.json is not a GQA Llama-family config"
            )
        kv_parts = split_sizes(arch.num_kv_heads, tp.world, "num_key_value_heads")  # whole GQA groups per rank
        group = arch.num_heads // arch.num_kv_heads
        q_sizes, kv_sizes = [n * group * d for n in kv_parts], [n * d for n in kv_parts]
        self.kv_heads = kv_parts[tp.rank]
        self.heads = self.kv_heads * group
        self.head_dim = d
        self.scale = d**-0.5
        self.sliding_window = arch.sliding_window
        self.q_proj = ColumnParallelLinear(
            inp, arch.num_heads * d, arch.qkv_bias, tp, dt, device, "num_attention_heads*head_dim", q_sizes
        )
        self.k_proj = ColumnParallelLinear(
            inp, arch.num_kv_heads * d, arch.qkv_bias, tp, dt, device, "num_key_value_heads*head_dim", kv_sizes
        )
        self.v_proj = ColumnParallelLinear(
            inp, arch.num_kv_heads * d, arch.qkv_bias, tp, dt, device, "num_key_value_heads*head_dim", kv_sizes
        )
        self.o_proj = RowParallelLinear(
            arch.num_heads * d, arch.hidden_size, arch.o_bias, tp, dt, device, "num_attention_heads*head_dim", q_sizes
        )
        self.q_norm = RMSNorm(d, arch.rms_norm_eps, dt, device) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps, dt, device) if arch.qk_norm else None
        self.rotary = RotaryEmbedding(arch.rope, d, device)
        self.qkv: FusedLinear | None = None  # set by fuse() for inference

    def fuse(self) -> None:
        """Inference: q, k and v in one GEMM."""
        self.qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        cache: KVLayer | None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # x [T, in] -> [T, H], or [S, H] for the rows ``out_rows`` [S] (every row's K/V still written)
        t = x.shape[0]
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.reshape(t, self.heads, self.head_dim)  # [T, Hq/tp, D]
        k = k.reshape(t, self.kv_heads, self.head_dim)  # [T, Hkv/tp, D]
        v = v.reshape(t, self.kv_heads, self.head_dim)  # [T, Hkv/tp, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k, getattr(attn, "layouts", None))  # one cos/sin per forward
        o = paged_attention(q, k, v, positions, attn, cache, self.scale, self.sliding_window)  # [T, Hq/tp, D]
        o = o.reshape(t, self.heads * self.head_dim)  # [T, Hq/tp D]
        return self.o_proj(o if out_rows is None else o[out_rows])  # [T or S, H]


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer: h + attn(norm(h)), then + mlp(norm(.))."""

    def __init__(self, arch: LlamaArch, tp: TPInfo, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.dtype, device)
        self.self_attn = SelfAttention(arch, tp, device)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.dtype, device)
        self.mlp = MLP(arch, tp, device)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        cache: KVLayer | None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # h [T, H] -> [T, H]; with out_rows [S]: K/V of every row written, the output [S, H] of those
        fused = native_layer.forward(self, h, positions, attn, cache)  # a CPU decode step's layer in one native call
        if fused is not None:
            return fused if out_rows is None else fused[out_rows]  # [T or S, H]
        fused = native_layer.prefill_forward(self, h, positions, attn, cache, out_rows)  # a CPU prefill's layer
        if fused is not None:
            return fused  # [T or S, H]
        kept = h if out_rows is None else h[out_rows]  # [T or S, H]
        h = kept + self.self_attn(self.input_layernorm(h), positions, attn, cache, out_rows)  # [T or S, H]
        return h + self.mlp(self.post_attention_layernorm(h))  # [T or S, H]


def pack_for_cpu(model: nn.Module) -> int:
    """Make the CPU kernels' packed layouts of every weight the fused model's forward multiplies by, now rather
    than in the first step that uses it; returns how many weights. Each gets the native decode kernel's layout
    (``cpu_panels.packed``); each but an LM head (a prefill multiplies only each prompt's last row by it, on the
    native kernel) also gets oneDNN's for prefill GEMMs (``cpu_gemm.packed``) where PyTorch has oneDNN. The parts
    of a fused q/k/v or gate/up are skipped (only the fused weight is used). Call when the native kernel is on."""
    fused_parts = set()
    weights = []
    for m in model.modules():
        if isinstance(m, SelfAttention) and m.qkv is not None:
            fused_parts |= {id(m.q_proj), id(m.k_proj), id(m.v_proj)}
            weights.append((m.qkv.weight, True))
        elif isinstance(m, MLP) and m.gate_up is not None:
            fused_parts |= {id(m.gate_proj), id(m.up_proj)}
            weights.append((m.gate_up.weight, True))
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)) and id(m) not in fused_parts:
            weights.append((m.weight, not isinstance(m, ParallelLMHead)))
    for w, gemm in weights:
        cpu_panels.packed(w)
        if gemm and w.dtype == torch.float32 and cpu_gemm.available():
            cpu_gemm.packed(w)
    return len(weights)


def fuse_for_inference(model: nn.Module) -> nn.Module:
    """One GEMM for q/k/v and one for gate/up in every layer of ``model`` (idempotent; not for training)."""
    for m in model.modules():
        if isinstance(m, SelfAttention) and m.qkv is None:
            m.fuse()
        elif isinstance(m, MLP) and m.gate_up is None:
            m.fuse()
    return model
