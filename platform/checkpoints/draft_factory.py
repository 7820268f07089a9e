"""Build EAGLE-3 draft configs, vocabulary maps and randomly initialised drafts for a target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagleray.platform.checkpoints.draft import EAGLE3_ARCHITECTURES, DraftMetadata, save_draft
from eagleray.platform.checkpoints.target import TargetSpec, rope_of
from eagleray.platform.errors import EaglerayError


def eagle3_config(
    target: TargetSpec, aux_layer_ids: list[int] | None = None, draft_vocab_size: int | None = None
) -> dict[str, Any]:
    """A vLLM-loadable EAGLE-3 config whose layer shapes and rope follow the target."""
    ids = list(aux_layer_ids if aux_layer_ids is not None else target.default_aux_layer_ids)
    rope = rope_of(target.config)
    cfg = {
        "architectures": [EAGLE3_ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": int(target.config["intermediate_size"]),
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": int(draft_vocab_size or target.vocab_size),
        "max_position_embeddings": target.max_positions,
        "rms_norm_eps": float(target.config.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope["rope_theta"],
        "hidden_act": target.config.get("hidden_act", "silu"),
        "tie_word_embeddings": False,
        "target_hidden_size": target.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "torch_dtype": "float32",
    }
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = scaling
    return cfg


def vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the ``draft_vocab_size`` most frequent target tokens.

    counts: [V] token frequencies. Returns d2t [Vd] int64 (target_id - draft_id, draft ids in
    ascending target-id order) and t2d [V] bool. Ties go to the lower token id.
    """
    vocab = counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise EaglerayError(f"draft_vocab_size={draft_vocab_size} must be in [1, {vocab}] (the target vocab size)")
    # Stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-counts.to(torch.float64), stable=True).indices[:draft_vocab_size]
    chosen = torch.sort(order).values  # [Vd] target ids, ascending
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.to(torch.int64), t2d


def random_eagle3_tensors(
    cfg: dict[str, Any], d2t: torch.Tensor, t2d: torch.Tensor, seed: int = 0, std: float = 0.02
) -> dict[str, torch.Tensor]:
    """Randomly initialised EAGLE-3 weights for ``cfg`` (norms at 1, linears N(0, std))."""
    g = torch.Generator().manual_seed(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    shapes = {
        "fc.weight": (h, n_aux * cfg["target_hidden_size"]),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
    }
    out = {k: torch.randn(s, generator=g) * std for k, s in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        out[f"{norm}.weight"] = torch.ones(h)
    out["d2t"] = d2t
    out["t2d"] = t2d
    return out


def make_random_draft(
    target: TargetSpec,
    out_dir: str | Path,
    *,
    aux_layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    counts: torch.Tensor | None = None,
) -> Path:
    """Write an untrained EAGLE-3 draft for ``target`` (τ≈1; for lossless checks and as a start)."""
    cfg = eagle3_config(target, aux_layer_ids, draft_vocab_size)
    counts = counts if counts is not None else torch.zeros(target.vocab_size)
    d2t, t2d = vocab_map(counts, cfg["draft_vocab_size"])
    meta = DraftMetadata(
        target_fingerprint=target.fingerprint,
        tokenizer_fingerprint=target.tokenizer_fingerprint,
        aux_layer_ids=cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        created_by="eagleray random init",
        notes={"seed": seed},
    )
    return save_draft(out_dir, cfg, random_eagle3_tensors(cfg, d2t, t2d, seed), meta)
