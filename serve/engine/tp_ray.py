"""The ``"ray"`` tensor-parallel backend: ranks 1..N-1 are Ray actors in the deployment's placement group.

The engine replica (rank 0) runs in bundle 0 of its STRICT_PACK placement group; rank ``r`` is an
actor scheduled into bundle ``r`` with that bundle's CPUs/GPUs. The actors join rank 0's
``torch.distributed`` group (127.0.0.1 when every rank is on rank 0's node, rank 0's node IP
otherwise) and run the shared command protocol (:class:`~eagleray.serve.engine.tp_workers.RankWorker`)
through ordered actor method calls. The actors are owned by the replica, so they die with it.
"""

from __future__ import annotations

import logging
import os

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from eagleray.platform.errors import EaglerayError
from eagleray.platform.host import free_port
from eagleray.serve.engine.tp_workers import (
    COLLECTIVE_TIMEOUT,
    Rank0Workers,
    RankWorker,
    TPWorkerError,
    backend_for,
    move,
    rank_device,
)

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # actor placement + shard load


class RankActor:
    """One worker rank as a Ray actor (wrapped with ``ray.remote`` at start)."""

    def __init__(self, rank: int, world: int, target_dir: str, dtype: str, device_type: str):
        torch.set_num_threads(1)
        self.rank, self.world, self.target_dir, self.dtype, self.device_type = rank, world, target_dir, dtype, device_type
        self.worker: RankWorker | None = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def placement(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "actor_id": ctx.get_actor_id(),
            "placement_group": ctx.get_placement_group_id(),
        }

    def join(self, addr: str, port: int, backend: str) -> None:
        """Join rank 0's group, then load this rank's shard (Ray shows each actor only its own GPU: cuda:0)."""
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world, timeout=COLLECTIVE_TIMEOUT
        )
        self.worker = RankWorker(self.rank, self.target_dir, self.dtype, rank_device(torch.device(self.device_type), 0))

    def run(self, cmd: str, args: tuple) -> None:
        if self.worker is None:
            raise EaglerayError(f"tensor-parallel rank {self.rank} got {cmd!r} before joining its group (engine bug)")
        self.worker.handle(cmd, args)

    def leave(self) -> None:
        self.worker = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(pg, world: int, target_dir: str, dtype: str, device: torch.device) -> list:
    bundles = pg.bundle_specs
    if len(bundles) < world:
        raise TPWorkerError(
            f"target.tensor_parallel_size={world} but the placement group has {len(bundles)} bundles\n"
            f"    fix: deploy with eagleray.serve.app.build (one bundle per rank)"
        )
    remote_cls = ray.remote(RankActor)
    actors = []
    for rank in range(1, world):
        bundle = bundles[rank]
        opts = dict(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
        )
        actors.append(remote_cls.options(name=None, **opts).remote(rank, world, target_dir, dtype, device.type))
    return actors


def _master_addr(actors: list) -> str:
    """127.0.0.1 when every rank is on this node; this node's IP otherwise (multi-node)."""
    here = ray.get_runtime_context().get_node_id()
    nodes = ray.get([a.node_id.remote() for a in actors], timeout=START_TIMEOUT_S)
    return "127.0.0.1" if all(n == here for n in nodes) else ray.util.get_node_ip_address()


class RayTPWorkers(Rank0Workers):
    """Rank 0's handle on the worker actors of one tensor-parallel target."""

    def __init__(self, actors: list, world: int, placement_group, placement: list[dict]):
        super().__init__(world)
        self.actors, self.placement_group, self.placement = actors, placement_group, placement
        self.pending: dict = {}  # ObjectRef of an in-flight command -> rank

    @classmethod
    def start(cls, pg, target_dir: str, world: int, dtype: str, device: torch.device) -> "RayTPWorkers":
        """Create the actors in ``pg`` and join their group as rank 0; any failure stops them and raises."""
        if not ray.is_initialized():
            raise EaglerayError(
                "the 'ray' tensor-parallel backend needs a running Ray (the engine is not in a Ray worker)\n"
                "    fix: use TPLaunch('mp') outside Ray Serve"
            )
        actors = _spawn(pg, world, target_dir, dtype, device)
        try:
            addr, backend = _master_addr(actors), backend_for(device)
            port = free_port(addr)
            joins = [a.join.remote(addr, port, backend) for a in actors]
            dist.init_process_group(
                backend, init_method=f"tcp://{addr}:{port}", rank=0, world_size=world, timeout=COLLECTIVE_TIMEOUT
            )
            ray.get(joins, timeout=START_TIMEOUT_S)
            placement = ray.get([a.placement.remote() for a in actors], timeout=START_TIMEOUT_S)
        except (ray.exceptions.RayError, RuntimeError, OSError) as err:
            _kill(actors)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise TPWorkerError(
                f"tensor-parallel worker actors failed to start: {err}\n"
                f"    fix: check the placement group's resources and the actors' logs"
            ) from err
        logger.info("tensor-parallel ranks 1..%d started as Ray actors in placement group %s", world - 1, pg.id.hex())
        return cls(actors, world, pg, placement)

    def describe(self) -> dict:
        return {
            "backend": "ray",
            "world": self.world,
            "placement_group": self.placement_group.id.hex(),
            "ranks": list(self.placement),
        }

    def _send(self, cmd: str, payload: tuple) -> None:
        ref = ray.put(move(payload, torch.device("cpu")))  # serialised now, one copy for every rank
        for rank, actor in enumerate(self.actors, start=1):
            self.pending[actor.run.remote(cmd, ref)] = rank

    def check(self) -> None:
        """Raise the first failed command (a worker exception or a dead actor); forget finished ones."""
        if not self.pending:
            return
        ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
        for ref in ready:
            rank = self.pending.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                raise TPWorkerError(
                    f"tensor-parallel rank {rank} (Ray actor) failed:\n{err}\n    fix: see the traceback; restart the engine"
                ) from err

    def close(self, timeout: float = 30.0) -> None:
        """Leave the group on every rank and kill the actors (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if not ray.is_initialized():  # Ray is already down: the actors went with it
            if dist.is_initialized():
                dist.destroy_process_group()
            return
        leaves = [a.leave.remote() for a in self.actors]
        if dist.is_initialized():
            dist.destroy_process_group()
        try:
            ray.get(leaves, timeout=timeout)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            raise TPWorkerError(
                f"tensor-parallel worker actors did not leave their group within {timeout}s: {err}\n"
                f"    fix: a worker is blocked in a collective; check the logs for the failing step"
            ) from err
        finally:
            _kill(self.actors)
            self.pending.clear()


def _kill(actors: list) -> None:
    for actor in actors:
        ray.kill(actor, no_restart=True)
