"""EAGLE-3 draft model (inference), numerically equal to vLLM's ``Eagle3LlamaForCausalLM``.

One draft step over T tokens (token t is paired with the hidden state of the position before it)::

    first step:  hidden = combine_hidden_states(aux)          # fc: [T, n_aux*H_t] -> [T, H]
    later steps: hidden = previous step's ``next_hidden``      # [T, H], fc skipped
    normed, next_hidden = draft(input_ids, positions, hidden, attn, kv_cache)
    logits = draft.compute_logits(normed)                      # [T, draft_vocab]
    target_ids = draft.to_target_ids(logits.argmax(-1))        # draft id + d2t[draft id]

Inside the layer (vLLM, ``norm_before_residual=False``)::

    x = cat([input_layernorm(embed(ids)), hidden_norm(hidden)])   # [T, 2H]
    h = self_attn(x) + hidden                                     # residual = hidden (fc output)
    pre = mlp(post_attention_layernorm(h)) + h                    # next_hidden (pre-norm)
    normed = norm(pre)

``norm_before_residual=True`` uses hidden_norm(hidden) as the residual; ``norm_before_fc`` applies
``input_norm`` [n_aux*H_t] before fc; ``norm_output`` returns ``normed`` as next_hidden.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagleray.platform.checkpoints.draft import DraftCheckpoint
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models import native_layer
from eagleray.platform.models.arch import LlamaArch, parse_dtype
from eagleray.platform.models.attention import AttentionMetadata, KVCache
from eagleray.platform.models.layers import MLP, RMSNorm, SelfAttention
from eagleray.platform.models.tp import ColumnParallelLinear, ParallelLMHead, TPInfo, VocabParallelEmbedding
from eagleray.platform.models.weights import load_weights


def _flag(config: dict[str, Any], name: str) -> bool:
    return bool((config.get("eagle_config") or {}).get(name, config.get(name, False)))


def _check_supported(config: dict[str, Any]) -> None:
    """Refuse the vLLM Eagle3 variants eagleray does not implement, naming the field and the fix."""
    eagle = config.get("eagle_config") or {}
    checks = [  # (field, value, is it bad, fix)
        (
            "num_hidden_layers",
            config.get("num_hidden_layers", 1),
            int(config.get("num_hidden_layers", 1)) != 1,
            "eagleray drafts have one decoder layer",
        ),
        (
            "eagle_config.use_aux_hidden_state",
            eagle.get("use_aux_hidden_state"),
            eagle.get("use_aux_hidden_state") is False,
            "EAGLE-3 drafts consume aux hidden states; set it to true or serve the checkpoint as an EAGLE draft",
        ),
        (
            "fc_norm",
            config.get("fc_norm"),
            bool(config.get("fc_norm")),
            "per-chunk fc norms are not implemented; use norm_before_fc instead",
        ),
    ]
    for field_, value, bad, fix in checks:
        if bad:
            raise EaglerayError(f"draft.config.{field_}={value!r} is not supported\n    fix: {fix}")


class Eagle3Layer(nn.Module):
    """The draft's decoder layer (checkpoint prefix ``midlayer.``); q/k/v read 2H features."""

    def __init__(self, arch: LlamaArch, tp: TPInfo, norm_before_residual: bool, device=None):
        super().__init__()
        h, eps, dt = arch.hidden_size, arch.rms_norm_eps, arch.dtype
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(h, eps, dt, device)
        self.hidden_norm = RMSNorm(h, eps, dt, device)
        self.self_attn = SelfAttention(arch, tp, device, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps, dt, device)
        self.mlp = MLP(arch, tp, device)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, cache
    ) -> torch.Tensor:  # embeds, hidden [T, H] -> pre-norm [T, H]
        fused = native_layer.forward(self, hidden, positions, attn, cache, embeds)  # a CPU decode step's: one native call
        if fused is not None:
            return fused  # [T, H]
        normed_hidden = self.hidden_norm(hidden)  # [T, H]
        residual = normed_hidden if self.norm_before_residual else hidden  # [T, H]
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)  # [T, 2H]
        h = self.self_attn(x, positions, attn, cache) + residual  # [T, H]
        return self.mlp(self.post_attention_layernorm(h)) + h  # [T, H]


class Eagle3Draft(nn.Module):
    """EAGLE-3 Llama draft; parameter names are the checkpoint's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``)."""

    def __init__(
        self,
        config: dict[str, Any],
        tp: TPInfo | None = None,
        device=None,
        dtype: torch.dtype | None = None,
        own_embedding: bool = False,
    ):
        super().__init__()
        _check_supported(config)
        self.config = config
        self.tp = tp or TPInfo.current()
        arch = LlamaArch.from_config({**config, "model_type": "llama"})
        self.arch = arch = replace(arch, dtype=dtype or arch.dtype)
        h, dt = arch.hidden_size, arch.dtype
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        self.num_aux = int(config.get("num_aux_hidden_states") or (len(ids) if ids else 3))
        self.fc_in = int(config.get("target_hidden_size") or h) * self.num_aux
        self.draft_vocab_size = int(config.get("draft_vocab_size") or arch.vocab_size)
        self.norm_output = bool(config.get("norm_output", False))
        self.input_norm = RMSNorm(self.fc_in, arch.rms_norm_eps, dt, device) if _flag(config, "norm_before_fc") else None
        self.fc = ColumnParallelLinear(self.fc_in, h, False, TPInfo(), dt, device)  # replicated on every rank
        self.midlayer = Eagle3Layer(arch, self.tp, bool(config.get("norm_before_residual", False)), device)
        self.norm = RMSNorm(h, arch.rms_norm_eps, dt, device)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, h, self.tp, dt, device)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, h, self.tp, dt, device) if own_embedding else None
        self._shared_embed: list[VocabParallelEmbedding] = []  # the target's, not a submodule (not loaded/saved)
        self.register_buffer(
            "d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64, device=device), persistent=False
        )  # [Vd] target_id - draft_id

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: DraftCheckpoint | str | Path,
        target: nn.Module | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device=None,
        tp: TPInfo | None = None,
    ) -> "Eagle3Draft":
        """Load a draft dir; without ``embed_tokens.weight`` it shares ``target.embed_tokens``."""
        ckpt = ckpt if isinstance(ckpt, DraftCheckpoint) else DraftCheckpoint.open(ckpt)
        names = {_rename(n) for n in ckpt.shapes}
        own = "embed_tokens.weight" in names
        if not own and target is None:
            raise EaglerayError(
                f"draft {ckpt.path} has no embed_tokens.weight and no target was given to share it\n"
                f"    fix: pass the target model (Eagle3Draft.from_checkpoint(path, target))"
            )
        dt = parse_dtype(dtype) if dtype is not None else (target.arch.dtype if target is not None else None)
        with torch.device(device or "cpu"):
            draft = cls(ckpt.config, tp, device, dt, own_embedding=own)
        draft.load(ckpt)
        if not own:
            draft.share_embedding(target.embed_tokens)
        return draft.eval()

    def load(self, ckpt: DraftCheckpoint) -> None:
        tensors = ckpt.load_tensors()
        d2t = tensors.pop("d2t", None)
        if d2t is None and self.draft_vocab_size != self.arch.vocab_size:
            raise EaglerayError(
                f"draft {ckpt.path}: draft_vocab_size={self.draft_vocab_size} != vocab_size="
                f"{self.arch.vocab_size} but the checkpoint has no d2t tensor\n"
                f"    fix: save the draft->target id offsets as 'd2t' (see eagleray.platform.draft_factory.vocab_map)"
            )
        if d2t is not None:
            self.d2t.copy_(d2t.to(torch.int64))
        load_weights(self, tensors.items(), rename=_rename, what=f"draft {ckpt.path}")

    def share_embedding(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape[1] != self.arch.hidden_size:
            raise EaglerayError(
                f"target embedding width {embedding.weight.shape[1]} != draft hidden_size {self.arch.hidden_size}\n"
                f"    fix: the draft was not trained for this target"
            )
        self._shared_embed = [embedding]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        emb = self.embed_tokens if self.embed_tokens is not None else self._shared_embed[0]
        return emb(input_ids).to(self.arch.dtype)

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:  # [T, n_aux*H_t] -> [T, H]
        if aux.shape[-1] != self.fc_in:
            raise EaglerayError(
                f"draft expects aux hidden states of width {self.fc_in} ({self.num_aux} x target hidden), "
                f"got {aux.shape[-1]}\n    fix: capture the aux layers {self.config.get('eagle_config')} in the target"
            )
        x = aux.to(self.arch.dtype)
        return self.fc(self.input_norm(x) if self.input_norm is not None else x)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T], hidden [T, H] -> normed [T, H] (for logits), next_hidden [T, H]."""
        cache = None if kv_cache is None else (kv_cache.k[0], kv_cache.v[0])
        pre = self.midlayer(self.embed(input_ids), hidden.to(self.arch.dtype), positions, attn, cache)  # [T, H]
        normed = self.norm(pre)  # [T, H]
        return normed, (normed if self.norm_output else pre)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, Vd]
        return self.lm_head(normed)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:  # [...] draft ids -> target ids
        return draft_ids + self.d2t[draft_ids]

    def logits_in_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:  # [T, Vd] -> [T, V], -inf elsewhere
        out = logits.new_full((logits.shape[0], self.arch.vocab_size), float("-inf"))  # [T, V]
        out[:, self.to_target_ids(torch.arange(self.draft_vocab_size, device=logits.device))] = logits
        return out

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None, device=None) -> KVCache:
        """The draft's own one-layer paged cache: [1, num_blocks, block_size, Hkv/tp, D]."""
        a = self.midlayer.self_attn
        return KVCache.allocate(
            1, num_blocks, block_size, a.kv_heads, a.head_dim, dtype or self.arch.dtype, device or self.norm.weight.device
        )


def _rename(name: str) -> str | None:
    """Checkpoint name -> parameter name: accepts vLLM's ``layers.0.``/``model.`` spellings; skips t2d/d2t."""
    if name in ("t2d", "d2t"):
        return None
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
