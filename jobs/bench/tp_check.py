"""Self-check: a model run tensor-parallel gives the same logits as one process.

``python -m eagleray.jobs.bench.tp_check MODEL_DIR [--draft DRAFT_DIR] --world 2 --backend gloo``
spawns ``world`` processes (torch.multiprocessing, 127.0.0.1, a free port), runs the target (full
forward, a paged-cache decode step, greedy decoding) and optionally the EAGLE-3 draft on every
rank, and compares rank 0's results with a single-process run. Works with gloo (CPU) and NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagleray.platform.host import free_port
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.tp import TPInfo

AUX_IDS = [1, 2]


def _device(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


@torch.inference_mode()
def run_model(model_dir: str, draft_dir: str | None, tp: TPInfo, device: torch.device, steps: int = 5) -> dict[str, torch.Tensor]:
    """Logits of a full forward, of a paged decode step, greedy tokens and draft logits (CPU fp32)."""
    from eagleray.platform.models.eagle3 import Eagle3Draft
    from eagleray.platform.models.llama import LlamaModel

    model = LlamaModel.from_dir(model_dir, dtype=torch.float32, device=device, tp=tp, aux_layer_ids=AUX_IDS)
    vocab = model.arch.vocab_size
    ids = (torch.arange(2 * 10, device=device).view(2, 10) * 7 + 3) % vocab  # [2, 10]
    logits, aux = model.forward_full(ids)  # [2, 10, V], [2, 10, 2H]
    out = {"logits": logits, "aux": aux}
    cache = model.make_kv_cache(num_blocks=8, block_size=4)
    attn = AttentionMetadata.build([10], [0], [[3, 5, 1]], 4, device=device)
    model(ids[0], torch.arange(10, device=device), attn, cache)
    step = AttentionMetadata.build([1], [10], [[3, 5, 1]], 4, device=device)
    hidden, _ = model(ids[1, :1], torch.tensor([10], device=device), step, cache)
    out["decode"] = model.compute_logits(hidden)  # [1, V]
    seq = ids[:1]
    for _ in range(steps):
        nxt = model.forward_full(seq)[0][:, -1].argmax(-1, keepdim=True)  # [1, 1]
        seq = torch.cat([seq, nxt], dim=1)
    out["greedy"] = seq[0, 10:]
    if draft_dir is not None:
        draft = Eagle3Draft.from_checkpoint(draft_dir, model, device=device, tp=tp)
        meta = AttentionMetadata.build([10])
        normed, _ = draft(ids[0], torch.arange(10, device=device), draft.combine_hidden_states(aux[0]), meta)
        out["draft"] = draft.compute_logits(normed)  # [10, Vd]
    return {k: v.float().cpu() for k, v in out.items()}


def _worker(rank: int, world: int, port: int, backend: str, model_dir: str, draft_dir: str | None, out: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = run_model(model_dir, draft_dir, TPInfo.current(), _device(backend, rank))
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def run_tensor_parallel(
    model_dir: str | Path, world: int, backend: str = "gloo", draft_dir: str | Path | None = None
) -> dict[str, torch.Tensor]:
    """Run :func:`run_model` on ``world`` spawned ranks; returns rank 0's results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        args = (world, free_port(), backend, str(model_dir), None if draft_dir is None else str(draft_dir), out)
        mp.spawn(_worker, args=args, nprocs=world, join=True)
        return torch.load(out)


def compare(model_dir: str | Path, world: int, backend: str = "gloo", draft_dir: str | Path | None = None) -> dict:
    """Max |TP - single| per output and whether greedy tokens agree."""
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    single = run_model(str(model_dir), None if draft_dir is None else str(draft_dir), TPInfo(), device)
    sharded = run_tensor_parallel(model_dir, world, backend, draft_dir)
    report = {k: float((single[k] - sharded[k]).abs().max()) for k in single if k != "greedy"}
    report["greedy_equal"] = bool(torch.equal(single["greedy"], sharded["greedy"]))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    a = ap.parse_args()
    print(json.dumps(compare(a.model_dir, a.world, a.backend, a.draft), indent=2))


if __name__ == "__main__":
    main()
