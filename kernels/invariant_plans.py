"""The tiling plans of the batch-invariant linear (:mod:`eagleray.kernels.invariant_linear`): one per weight shape and
GPU, never per number of rows, which is what keeps a row's summation order the same at every batch size.

    p = plan(n, k, device)   # measured plans first (invariant_linear_plans.json by GPU name), else make_plan's default

Plans measured on a GPU (``jobs/bench/invariant_check --tune``) lie in ``invariant_linear_plans.json`` by device name
and shape; ``EAGLERAY_INVARIANT_PLANS`` names another file.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 128
NUM_WARPS, NUM_STAGES = 4, 3
REDUCE_BM, REDUCE_BN = 32, 128  # the split-K reduce kernel's tiles (its epilogue's column tiles)
TARGET_PROGRAMS = 264  # two per SM of an H200: enough loads in flight to stream a weight at one row
# measured plans by GPU name and weight shape; EAGLERAY_INVARIANT_PLANS names another file (plans tuned on this machine)
PLANS_FILE = Path(os.environ.get("EAGLERAY_INVARIANT_PLANS") or Path(__file__).with_name("invariant_linear_plans.json"))


@dataclass(frozen=True)
class Plan:
    """How a weight [N, K] is tiled: ``splits`` ranges of ``k_per_split`` columns (a multiple of ``block_k``), tiles
    of ``block_n`` output columns, and the launch's warps and pipeline stages."""

    splits: int
    k_per_split: int
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    warps: int = NUM_WARPS
    stages: int = NUM_STAGES


def make_plan(
    n: int,
    k: int,
    splits: int | None = None,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    warps: int = NUM_WARPS,
    stages: int = NUM_STAGES,
) -> Plan:
    """A plan for a weight [N, K]: ``splits`` ranges of K (at most, no empty one), or by default enough to keep
    about :data:`TARGET_PROGRAMS` programs in flight at one row."""
    chunks = -(-k // block_k)
    if splits is None:
        splits = max(1, min(chunks, -(-TARGET_PROGRAMS // -(-n // block_n))))
    per = -(-chunks // max(1, min(splits, chunks)))
    return Plan(-(-chunks // per), per * block_k, block_n, block_k, warps, stages)


@functools.lru_cache(maxsize=None)
def measured_plans(device_name: str) -> dict[tuple[int, int], Plan]:
    """The plans measured on the GPU ``device_name`` (``jobs/bench/invariant_check --tune``), by weight shape."""
    table = json.loads(PLANS_FILE.read_text()) if PLANS_FILE.exists() else {}
    out = {}
    for shape, cfg in table.get(device_name, {}).items():
        n, k = (int(v) for v in shape.split("x"))
        out[(n, k)] = make_plan(n, k, **cfg)
    return out


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def plan(n: int, k: int, device: torch.device | None = None) -> Plan:
    """The plan for a weight [N, K] on ``device``: a function of the device and the shape alone, never of the
    number of rows (the batch invariance rests on it). Measured plans first, else :func:`make_plan`'s default."""
    name = _device_name(device) if device is not None else None
    found = measured_plans(name).get((n, k)) if name is not None else None
    return found if found is not None else make_plan(n, k)
