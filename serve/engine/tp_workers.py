"""Tensor-parallel target ranks for the engine: rank 0 is the engine process, ranks 1..N-1 are workers.

    workers = TPWorkers.start(target_dir, world=2, dtype="fp32", device=torch.device("cpu"))
    model = LlamaModel.from_dir(target_dir, tp=workers.tp, ...)       # rank 0's shard
    workers.call("kv", runner_id, num_blocks, block_size)            # every rank allocates its KV shard
    workers.call("forward", runner_id, batch, logits_index)          # then rank 0 runs the same forward
    workers.close()

Mechanism: ``torch.multiprocessing`` (spawn) workers joined with rank 0 in a ``torch.distributed``
group (gloo on CPU, NCCL on GPU) on 127.0.0.1 and a free port. The same code runs in tests and in
a Ray Serve replica (a replica is a process that may spawn children). Commands travel over one
multiprocessing queue per worker (so an idle server never hits a collective timeout); the model's
collectives (row-parallel all-reduce, vocab all-gather) run over the process group. Every rank runs
the same target forward with its shard; only rank 0 keeps logits and aux states. The draft runs
replicated on rank 0 only (one small layer), with its own full embedding.
"""

from __future__ import annotations

import dataclasses
import logging
import queue as queue_mod
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.tp import TPInfo

logger = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a step's collectives; idle time is spent on the queues


class TPWorkerError(EaglerayError):
    """A tensor-parallel worker failed (its traceback is in the message)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return device


def move(obj, device: torch.device):
    """Tensors inside (nested) dataclasses, lists and tuples -> ``device``; other values unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: move(getattr(obj, f.name), device)
                                          for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(move(x, device) for x in obj)
    return obj


class TPWorkers:
    """Rank 0's handle on the worker processes of one tensor-parallel target."""

    def __init__(self, procs, queues, errors, world: int):
        self.procs, self.queues, self.errors, self.world = procs, queues, errors, world
        self.tp = TPInfo(rank=0, world=world)
        self._next_id = 0
        self.closed = False

    @classmethod
    def start(cls, target_dir: str, world: int, dtype: str, device: torch.device) -> "TPWorkers":
        """Spawn ranks 1..world-1 and join them in a process group as rank 0."""
        if dist.is_initialized():
            raise EaglerayError("target.tensor_parallel_size > 1 but this process already has a torch.distributed group\n"
                                "    fix: close the other tensor-parallel engine first (engine.close())")
        ctx = mp.get_context("spawn")
        port, backend = free_port(), backend_for(device)
        queues = [ctx.Queue() for _ in range(world - 1)]
        errors = ctx.Queue()
        procs = [ctx.Process(target=_worker_main, daemon=True, name=f"eagleray-tp{r}",
                             args=(r, world, port, backend, str(target_dir), dtype, device.type, queues[r - 1], errors))
                 for r in range(1, world)]
        for p in procs:
            p.start()
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        return cls(procs, queues, errors, world)

    def new_runner_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def call(self, cmd: str, *args) -> None:
        """Send a command to every worker; rank 0 then does its own part (the collectives pair them)."""
        if self.closed:
            raise EaglerayError(f"tensor-parallel workers are closed; cannot run {cmd!r}\n    fix: do not use an engine after close()")
        self.check()
        payload = move(args, torch.device("cpu"))
        for q in self.queues:
            q.put((cmd, payload))

    def check(self) -> None:
        """Raise the first error a worker reported, or a dead worker."""
        try:
            rank, tb = self.errors.get_nowait()
        except queue_mod.Empty:
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead:
                raise TPWorkerError(f"tensor-parallel workers {dead} exited\n    fix: see their log; restart the engine")
            return
        raise TPWorkerError(f"tensor-parallel rank {rank} failed:\n{tb}\n    fix: see the traceback; restart the engine")

    def close(self, timeout: float = 30.0) -> None:
        """Stop every worker, join it and leave the process group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for q in self.queues:
            q.put(("stop", ()))
        stuck = []
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                stuck.append(p.name)
                p.terminate()
                p.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()
        if stuck:
            raise TPWorkerError(f"tensor-parallel workers {stuck} did not stop within {timeout}s and were terminated\n"
                                f"    fix: a worker is blocked in a collective; check the logs for the failing step")


def _worker_main(rank: int, world: int, port: int, backend: str, target_dir: str, dtype: str, device_type: str,
                 commands, errors) -> None:
    """Worker process: join the group, load this rank's shard, then serve commands until 'stop'."""
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        _serve(rank, target_dir, dtype, rank_device(torch.device(device_type), rank), commands)
    except Exception:  # noqa: BLE001 - reported to rank 0, which raises it as TPWorkerError
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _serve(rank: int, target_dir: str, dtype: str, device: torch.device, commands) -> None:
    from eagleray.platform.models.llama import LlamaModel
    from eagleray.serve.engine.model_runner import TargetRunner

    model = LlamaModel.from_dir(target_dir, dtype=dtype, device=device, tp=TPInfo(rank=rank, world=dist.get_world_size()))
    runners: dict[int, TargetRunner] = {}
    while True:
        cmd, args = commands.get()
        args = move(args, device)
        if cmd == "stop":
            return
        if cmd == "kv":
            rid, num_blocks, block_size = args
            runners[rid] = TargetRunner(model, num_blocks, block_size)
        elif cmd == "forward":
            rid, batch, logits_index = args
            runners[rid].forward(batch, logits_index)
        elif cmd == "move_kv":
            rid, src, dst = args
            runners[rid].move_kv(src, dst)
        elif cmd == "free":
            runners.pop(args[0], None)
        else:
            raise EaglerayError(f"tensor-parallel worker got unknown command {cmd!r} (engine bug)")
