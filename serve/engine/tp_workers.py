"""Tensor-parallel target ranks for the engine: rank 0 is the engine process, ranks 1..N-1 are workers.

    workers = start_workers(TPLaunch(), target_dir, world=2, dtype="fp32", device=torch.device("cpu"))
    model = LlamaModel.from_dir(target_dir, tp=workers.tp, ...)       # rank 0's shard
    workers.call("kv", runner_id, num_blocks, block_size)            # every rank allocates its KV shard
    workers.call("forward", runner_id, batch, logits_index, rows)    # then rank 0 runs the same forward
    workers.close()

Two backends, chosen explicitly by :class:`TPLaunch` (never a fallback), share one command
protocol (:class:`RankWorker` runs ``kv`` / ``forward`` / ``move_kv`` / ``free`` / ``stop`` on a rank):

- ``"mp"`` (the plain engine): ``torch.multiprocessing`` (spawn) children joined with rank 0 on
  127.0.0.1; commands travel over one multiprocessing queue per worker.
- ``"ray"`` (the Serve replica, :mod:`eagleray.serve.engine.tp_ray`): Ray actors placed in the
  deployment's placement group (bundle ``r`` for rank ``r``); commands are actor method calls.

Either way the ranks join one ``torch.distributed`` group (gloo on CPU, NCCL on GPU); an idle server
never hits a collective timeout (idle time is spent waiting for commands); the model's collectives
(row-parallel all-reduce, vocab all-gather) run over the group. Every rank runs the same target
forward with its shard; only rank 0 keeps logits and aux states. The draft runs replicated on rank 0
only (one small layer), with its own full embedding.
"""

from __future__ import annotations

import dataclasses
import logging
import queue as queue_mod
import traceback
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagleray.platform.errors import EaglerayError
from eagleray.platform.host import free_port
from eagleray.platform.models.tp import TPInfo

logger = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a step's collectives; idle time is spent on the queues


class TPWorkerError(EaglerayError):
    """A tensor-parallel worker failed (its traceback is in the message)."""


@dataclasses.dataclass(frozen=True)
class TPLaunch:
    """How ranks 1..N-1 start: ``"mp"`` (child processes) or ``"ray"`` (actors in ``placement_group``)."""

    backend: Literal["mp", "ray"] = "mp"
    placement_group: Any = None  # ray.util.placement_group.PlacementGroup with >= world bundles ("ray" only)

    def __post_init__(self) -> None:
        if self.backend not in ("mp", "ray"):
            raise EaglerayError(f"tensor-parallel backend {self.backend!r} is unknown\n    fix: use 'mp' or 'ray'")
        if (self.backend == "ray") != (self.placement_group is not None):
            raise EaglerayError(
                f"tensor-parallel backend {self.backend!r} with placement_group={self.placement_group!r}\n"
                f"    fix: the 'ray' backend needs the deployment's placement group; 'mp' takes none"
            )


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, index: int) -> torch.device:
    """The device of one rank: ``cuda:index`` (set current) on GPU; ``device`` itself on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return device


def start_workers(launch: TPLaunch, target_dir: str, world: int, dtype: str, device: torch.device):
    """Start ranks 1..world-1 with ``launch.backend`` and join their group as rank 0."""
    if dist.is_initialized():
        raise EaglerayError(
            "target.tensor_parallel_size > 1 but this process already has a torch.distributed group\n"
            "    fix: close the other tensor-parallel engine first (engine.close())"
        )
    if launch.backend == "ray":
        from eagleray.serve.engine.tp_ray import RayTPWorkers

        return RayTPWorkers.start(launch.placement_group, target_dir, world, dtype, device)
    return TPWorkers.start(target_dir, world, dtype, device)


class RankWorker:
    """One worker rank's side of the command protocol (shared by every backend)."""

    def __init__(self, rank: int, target_dir: str, dtype: str, device: torch.device):
        from eagleray.platform.models.llama import LlamaModel

        self.rank, self.device = rank, device
        self.model = LlamaModel.from_dir(
            target_dir, dtype=dtype, device=device, tp=TPInfo(rank=rank, world=dist.get_world_size())
        )
        self.runners: dict = {}

    def handle(self, cmd: str, args: tuple) -> bool:
        """Run one command; False after 'stop'."""
        from eagleray.serve.engine.model_runner import TargetRunner

        args = move(args, self.device)
        if cmd == "stop":
            return False
        if cmd == "kv":
            rid, num_blocks, block_size = args
            self.runners[rid] = TargetRunner(self.model, num_blocks, block_size)
        elif cmd == "forward":
            rid, batch, logits_index, rows = args
            self.runners[rid].forward_rows(batch, logits_index, rows)
        elif cmd == "move_kv":
            rid, src, dst = args
            self.runners[rid].move_kv(src, dst)
        elif cmd == "free":
            self.runners.pop(args[0], None)
        else:
            raise EaglerayError(f"tensor-parallel worker got unknown command {cmd!r} (engine bug)")
        return True


class Rank0Workers:
    """Rank 0's handle on ranks 1..N-1; a backend implements ``_send``, ``check`` and ``close``."""

    def __init__(self, world: int):
        self.world = world
        self.tp = TPInfo(rank=0, world=world)
        self._next_id = 0
        self.closed = False
        self.target_dir: str | None = None

    def new_runner_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def call(self, cmd: str, *args) -> None:
        """Send a command to every worker; rank 0 then does its own part (the collectives pair them)."""
        if self.closed:
            raise EaglerayError(
                f"tensor-parallel workers are closed; cannot run {cmd!r}\n    fix: do not use an engine after close()"
            )
        self.check()
        self._send(cmd, args)

    def _send(self, cmd: str, payload: tuple) -> None:
        """Deliver ``payload`` (tensors on any device) to ranks 1..N-1 as CPU tensors."""
        raise NotImplementedError

    def describe(self) -> dict:
        """Backend and where ranks 1..N-1 run (for /health and tests)."""
        raise NotImplementedError

    def check(self) -> None:
        raise NotImplementedError

    def close(self, timeout: float = 30.0) -> None:
        raise NotImplementedError


def move(obj, device: torch.device, copy: bool = False):
    """Tensors inside (nested) dataclasses, lists and tuples -> ``device`` (always a new tensor when
    ``copy``); other values unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=copy)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: move(getattr(obj, f.name), device, copy) for f in dataclasses.fields(obj) if f.init}
        )
    if isinstance(obj, (list, tuple)):
        return type(obj)(move(x, device, copy) for x in obj)
    return obj


class TPWorkers(Rank0Workers):
    """The ``"mp"`` backend: rank 0's handle on the worker processes of one tensor-parallel target."""

    def __init__(self, procs, queues, errors, world: int):
        super().__init__(world)
        self.procs, self.queues, self.errors = procs, queues, errors

    @classmethod
    def start(cls, target_dir: str, world: int, dtype: str, device: torch.device) -> "TPWorkers":
        """Spawn ranks 1..world-1 and join them in a process group as rank 0."""
        ctx = mp.get_context("spawn")
        port, backend = free_port(), backend_for(device)
        queues = [ctx.Queue() for _ in range(world - 1)]
        errors = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker_main,
                daemon=True,
                name=f"eagleray-tp{r}",
                args=(r, world, port, backend, str(target_dir), dtype, device.type, queues[r - 1], errors),
            )
            for r in range(1, world)
        ]
        for p in procs:
            p.start()
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world, timeout=COLLECTIVE_TIMEOUT
        )
        return cls(procs, queues, errors, world)

    def describe(self) -> dict:
        return {"backend": "mp", "world": self.world, "ranks": [{"rank": r, "pid": p.pid} for r, p in enumerate(self.procs, 1)]}

    def _send(self, cmd: str, payload: tuple) -> None:
        # A queue pickles in its feeder thread, later, and pickling a CPU tensor moves its storage into
        # shared memory in place. Rank 0 keeps using its own tensors meanwhile (the forward, the KV
        # slot copy), so each queue gets private copies: rank 0's tensors are never swapped under it.
        for q in self.queues:
            q.put((cmd, move(payload, torch.device("cpu"), copy=True)))

    def check(self) -> None:
        """Raise the first error a worker reported, or a dead worker."""
        try:
            rank, tb = self.errors.get_nowait()
        except queue_mod.Empty:
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead:
                raise TPWorkerError(
                    f"tensor-parallel workers {dead} exited\n    fix: see their log; restart the engine"
                ) from None
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
            raise TPWorkerError(
                f"tensor-parallel workers {stuck} did not stop within {timeout}s and were terminated\n"
                f"    fix: a worker is blocked in a collective; check the logs for the failing step"
            )


def _worker_main(
    rank: int, world: int, port: int, backend: str, target_dir: str, dtype: str, device_type: str, commands, errors
) -> None:
    """Worker process: join the group, load this rank's shard, then serve commands until 'stop'."""
    torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        _serve(rank, target_dir, dtype, rank_device(torch.device(device_type), rank), commands)
    except Exception:  # noqa: BLE001 - reported to rank 0, which raises it as TPWorkerError
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _serve(rank: int, target_dir: str, dtype: str, device: torch.device, commands) -> None:
    worker = RankWorker(rank, target_dir, dtype, device)
    while worker.handle(*commands.get()):
        pass
