"""Before a run: how many bytes it will write and roughly how long it will take; refuse without space."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.errors import EaglerayError
from eagleray.platform.prompts.template import prompt_ids

# Rough device numbers for the time guess (decode is bandwidth-bound, prefill compute-bound).
_DEVICE = {"cpu": {"bytes_per_s": 10e9, "flops": 5e10}, "cuda": {"bytes_per_s": 3e12, "flops": 3e14}}


@dataclass
class Estimate:
    rows: int
    avg_prompt_tokens: float  # backend 'given': the whole record, answer included
    tokens_per_row: float  # upper bound: prompt + max_tokens (capped at max_seq_len)
    bytes_per_token: int
    total_bytes: int
    seconds: float  # rough; the live ETA replaces it once rows finish
    free_bytes: int
    required_bytes: int  # total_bytes x disk_headroom

    def lines(self) -> list[str]:
        return [
            f"estimate: {self.rows} prompts x ~{self.tokens_per_row:.0f} tokens (avg prompt {self.avg_prompt_tokens:.0f})",
            f"estimate: output <= {human_bytes(self.total_bytes)} ({self.bytes_per_token} B/token bf16 hidden states); "
            f"free {human_bytes(self.free_bytes)}, need {human_bytes(self.required_bytes)} with headroom",
            f"estimate: time ~{human_seconds(self.seconds)} (rough; live ETA follows)",
        ]

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_seconds(s: float) -> str:
    s = int(math.ceil(s))
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def free_bytes_at(path: str | Path) -> int:
    """Free space of the filesystem that will hold ``path`` (its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _param_count(spec: TargetSpec) -> int:
    return sum(math.prod(shape) for shape in spec.weight_shapes.values())


def _seconds(cfg: DatagenConfig, spec: TargetSpec, rows: int, tokens_per_row: float, device: str) -> float:
    params = _param_count(spec)
    dev = _DEVICE["cuda" if device == "cuda" else "cpu"]
    wbytes = 2 if cfg.target.dtype == "bf16" else 4
    if cfg.est_tokens_per_second:
        gen_tps = cfg.est_tokens_per_second
    else:  # one decode step reads every weight once and serves batch_size rows
        gen_tps = min(dev["bytes_per_s"] / (params * wbytes) * cfg.batch_size, dev["flops"] / (2 * params))
    gen_s = 0.0 if cfg.backend == "given" else rows * cfg.generation.max_tokens / gen_tps
    fwd_s = rows * tokens_per_row * 2 * params / dev["flops"]
    return (gen_s + fwd_s) / cfg.num_workers


def estimate(
    cfg: DatagenConfig,
    spec: TargetSpec,
    tokenizer,
    conversations: list[list[dict]],
    n_aux: int,
    device: str,
    already_bytes: int = 0,
) -> Estimate:
    """Size and time of writing ``conversations`` (a sample of <= 256 is tokenized for the prompt length)."""
    sample = conversations[:256]
    avg = sum(len(prompt_ids(tokenizer, c)) for c in sample) / max(1, len(sample))
    answer = 0 if cfg.backend == "given" else cfg.generation.max_tokens  # given: the sample already holds the answers
    per_row = min(cfg.max_seq_len, avg + answer + 2)
    bpt = 2 * spec.hidden_size * (n_aux + 1) + 4 + 1  # aux + final hidden (bf16) + int32 id + int8 mask
    total = int(len(conversations) * per_row * bpt)
    seconds = _seconds(cfg, spec, len(conversations), per_row, device)
    free = free_bytes_at(cfg.output_dir)
    return Estimate(len(conversations), avg, per_row, bpt, total, seconds, free, int(total * cfg.disk_headroom))


def check_space(est: Estimate, output_dir: str) -> None:
    """Refuse to start when the destination cannot hold the estimated output."""
    if est.free_bytes < est.required_bytes:
        raise EaglerayError(
            f"not enough space for datagen output in {output_dir}: estimated {human_bytes(est.total_bytes)} "
            f"(x headroom = {human_bytes(est.required_bytes)}) but only {human_bytes(est.free_bytes)} free\n"
            f"    fix: free space, choose another output_dir, or lower limit / max_tokens / max_seq_len"
        )
