"""Synthetic datagen-format data for training tests: the tiny target extends random prompts greedily
(its "regenerated responses"); shards, manifest.json and vocab_counts.npy as datagen writes them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from eagleray.datagen import shards
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.llama import LlamaModel


@torch.inference_mode()
def write_synthetic(
    target_dir: Path, out: Path, *, rows: int = 24, prompt_len: int = 6, gen_len: int = 26, rows_per_shard: int = 8, seed: int = 0
) -> Path:
    spec = TargetSpec.from_dir(target_dir)
    aux_ids = spec.default_aux_layer_ids
    model = LlamaModel.from_dir(target_dir, aux_layer_ids=aux_ids)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, spec.vocab_size, (rows, prompt_len), generator=g)  # [R, P]
    for _ in range(gen_len):
        logits, _ = model.forward_full(ids)  # [R, T, V]
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    t = ids.shape[1]
    mask = [0] * prompt_len + [1] * gen_len
    out_rows = []
    for r in range(rows):
        final, aux = model(ids[r], torch.arange(t), AttentionMetadata.build([t]), None)  # [T, H], [T, A]
        out_rows.append(
            {
                "prompt_id": f"p{seed}-{r:04d}",
                "source": "synthetic",
                "response": "",
                "num_tokens": t,
                "truncated": False,
                "input_ids": ids[r].tolist(),
                "loss_mask": mask,
                "aux_hidden": shards.encode_bf16(aux),
                "final_hidden": shards.encode_bf16(final),
            }
        )
    for i in range(0, rows, rows_per_shard):
        shards.write_shard(shards.shard_path(out, f"{i // rows_per_shard:05d}"), out_rows[i : i + rows_per_shard], {})
    counts = np.bincount(ids[:, prompt_len:].flatten().numpy(), minlength=spec.vocab_size)
    np.save(out / "vocab_counts.npy", counts.astype(np.int64))
    manifest = {
        "dataset_id": f"synthetic-{seed}",
        "target_fingerprint": spec.fingerprint,
        "aux_layer_ids": aux_ids,
        "hidden_size": spec.hidden_size,
        "rows": rows,
        "tokens": rows * t,
        "vocab_size": spec.vocab_size,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out
