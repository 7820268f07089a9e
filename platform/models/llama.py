"""The target: a Llama-family decoder with paged KV cache, varlen batches, tree masks, tensor
parallelism and EAGLE-3 aux hidden-state capture.

Aux convention (vLLM's): id k in [0, N] is the residual stream at the *input* of layer k (0 = the
embeddings, N = the final pre-norm state). The captured states are concatenated in ascending id
order: aux [T, n_aux * H].

Typical use by the engine::

    model = LlamaModel.from_dir(path, aux_layer_ids=[2, 15, 29])
    cache = model.make_kv_cache(num_blocks, block_size)
    attn = AttentionMetadata.build(query_lens, context_lens, block_tables, block_size, tree_masks)
    hidden, aux = model(input_ids, positions, attn, cache)   # [T, H], [T, n_aux*H]
    logits = model.compute_logits(hidden[sample_idx])         # [S, V]
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.arch import LlamaArch, parse_dtype
from eagleray.platform.models.attention import AttentionMetadata, KVCache
from eagleray.platform.models.layers import DecoderLayer, RMSNorm
from eagleray.platform.models.tp import ParallelLMHead, TPInfo, VocabParallelEmbedding
from eagleray.platform.models.weights import iter_safetensors, load_weights

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaModel(nn.Module):
    """Llama/Mistral/Qwen2/Qwen3 decoder. Parameter names equal the HF names minus ``model.``."""

    def __init__(self, arch: LlamaArch, tp: TPInfo | None = None, device=None, aux_layer_ids: list[int] | None = None):
        super().__init__()
        self.arch = arch
        self.tp = tp or TPInfo.current()
        h, dt = arch.hidden_size, arch.dtype
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, h, self.tp, dt, device)
        self.layers = nn.ModuleList(DecoderLayer(arch, self.tp, device) for _ in range(arch.num_layers))
        self.norm = RMSNorm(h, arch.rms_norm_eps, dt, device)
        self.lm_head = ParallelLMHead(arch.vocab_size, h, self.tp, dt, device)
        if arch.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)
        self.aux_layer_ids: list[int] = []
        self.set_aux_layers(aux_layer_ids or [])

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        *,
        dtype: str | torch.dtype | None = None,
        device=None,
        tp: TPInfo | None = None,
        aux_layer_ids: list[int] | None = None,
    ) -> "LlamaModel":
        """Build from a HF directory (config.json + *.safetensors); ``dtype`` defaults to the config's."""
        spec = TargetSpec.from_dir(path)
        arch = LlamaArch.from_config(spec.config)
        if dtype is not None:
            arch = replace(arch, dtype=parse_dtype(dtype))
        with torch.device(device or "cpu"):
            model = cls(arch, tp, device, aux_layer_ids)
        model.load_checkpoint(spec.path)
        return model.eval()

    @classmethod
    def from_config(
        cls,
        config: dict,
        *,
        dtype: str | torch.dtype | None = None,
        device=None,
        tp: TPInfo | None = None,
        aux_layer_ids: list[int] | None = None,
        seed: int = 0,
        std: float = 0.02,
    ) -> "LlamaModel":
        """Random weights for a HF config dict, made on ``device`` (for speed work: values don't matter).

        Linear and embedding weights ~ N(0, std), biases 0, norm weights 1.
        """
        arch = LlamaArch.from_config(config)
        if dtype is not None:
            arch = replace(arch, dtype=parse_dtype(dtype))
        with torch.device(device or "cpu"):
            model = cls(arch, tp, device, aux_layer_ids)
        gen = torch.Generator(device=model.norm.weight.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=gen)
        return model.eval()

    def load_checkpoint(self, path: str | Path) -> None:
        """Load (and shard) HF-named safetensors weights; a tied lm_head may be absent."""

        def rename(name: str) -> str | None:
            if name.endswith(_IGNORED_SUFFIXES):
                return None
            return name.removeprefix("model.")

        load_weights(self, iter_safetensors(Path(path)), rename=rename, what=f"target {path}")

    def set_aux_layers(self, ids: list[int]) -> None:
        """Capture the inputs of layers ``ids`` (each in [0, N]); stored sorted and unique."""
        n = self.arch.num_layers
        bad = [i for i in ids if not 0 <= int(i) <= n]
        if bad:
            raise EaglerayError(
                f"aux_layer_ids {bad} are outside [0, {n}] (the target has {n} layers)\n"
                f"    fix: use ids between 0 (embeddings) and {n} (final pre-norm state)"
            )
        self.aux_layer_ids = sorted({int(i) for i in ids})

    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: KVCache | None = None,
        out_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions [T] -> final-normed hidden [T, H], aux [T, n_aux*H] (None if no ids).

        ``out_rows`` [S] int64: only these rows' final hidden states are wanted (a prefill's last rows) -> hidden
        [S, H]. The last layer then writes every row's K/V but runs its attention output and MLP for these rows
        alone (a prefill of T rows saves ~1/N of its products), unless the final pre-norm state is an aux id."""
        if input_ids.shape[0] != attn.num_tokens:
            raise EaglerayError(f"forward: {input_ids.shape[0]} tokens but attention metadata describes {attn.num_tokens}")
        h = self.embed_tokens(input_ids)  # [T, H]
        wanted = set(self.aux_layer_ids)
        last_rows = None if self.arch.num_layers in wanted else out_rows  # rows the last layer carries on
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in wanted:
                aux.append(h)
            cache = None if kv_cache is None else (kv_cache.k[i], kv_cache.v[i])
            h = layer(h, positions, attn, cache, last_rows if i == len(self.layers) - 1 else None)  # [T, H]; last [S, H]
        if self.arch.num_layers in wanted:
            aux.append(h)
            h = h if out_rows is None else h[out_rows]  # [S, H]
        return self.norm(h), (torch.cat(aux, dim=-1) if aux else None)  # [T or S, H], [T, n_aux*H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, V]
        return self.lm_head(hidden)

    @torch.inference_mode()
    def forward_full(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No-cache convenience: input_ids [B, T] -> logits [B, T, V], aux [B, T, n_aux*H] or None."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).repeat(b)  # [B*T]
        attn = AttentionMetadata.build([t] * b)
        hidden, aux = self(input_ids.reshape(-1), positions, attn, None)  # [B*T, H], [B*T, A]
        logits = self.compute_logits(hidden).view(b, t, -1)  # [B, T, V]
        return logits, (None if aux is None else aux.view(b, t, -1))

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None, device=None) -> KVCache:
        """A zeroed paged cache for this rank: [L, num_blocks, block_size, Hkv/tp, D]."""
        attn = self.layers[0].self_attn
        device = device or self.norm.weight.device
        return KVCache.allocate(
            self.arch.num_layers, num_blocks, block_size, attn.kv_heads, attn.head_dim, dtype or self.arch.dtype, device
        )
