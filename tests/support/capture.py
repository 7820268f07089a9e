"""Rows as the serving capture hands them to its writer (serve/capture.shard_row), for the writer's tests."""

from __future__ import annotations

import torch

from eagleray.platform.shard_format import encode_bf16

META = {"target_fingerprint": "fp", "tokenizer_fingerprint": "tok", "hidden_size": 8}


def captured(i: int, n: int = 5) -> dict:
    """A row as CaptureClient hands it over (serve/capture.shard_row), hidden size 8, three aux layers."""
    return {
        "prompt_id": f"req-{i}",
        "source": "traffic",
        "response": "x",
        "num_tokens": n,
        "truncated": False,
        "input_ids": list(range(n)),
        "loss_mask": [0, 0] + [1] * (n - 2),
        "aux_hidden": encode_bf16(torch.randn(n, 24)),
        "final_hidden": encode_bf16(torch.randn(n, 8)),
        "_aux_layer_ids": [1, 2, 3],
    }
