"""Tensor-parallel building blocks over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

World size 1 (or no process group) means plain single-process layers: every collective is
skipped. Each parameter carries a ``weight_loader(param, full)`` that takes the *full*
checkpoint tensor and copies this rank's shard, so checkpoints stay unsharded on disk.

Sharding (Megatron style):

- :class:`ColumnParallelLinear`: weight [out/tp, in]; output stays sharded along the last dim.
- :class:`RowParallelLinear`: weight [out, in/tp]; partial outputs are all-reduced, bias added once.
- Attention heads are dealt out by KV group (:func:`split_sizes`): a rank holds whole GQA groups
  (its KV heads and the query heads that read them). When the KV heads do not divide by the TP size
  the shards are uneven (SmolLM2's 3 KV heads over 2 ranks: 2 + 1 groups, i.e. 6 + 3 query heads);
  the row-parallel all-reduce sums uneven partials exactly like even ones.
- :class:`VocabParallelEmbedding`: rows [V_pad/tp, H] per rank; lookups outside the shard give 0,
  then all-reduce.
- :class:`ParallelLMHead`: same row shards as the embedding (so tying shares the Parameter);
  local logits [T, V_pad/tp] are all-gathered and trimmed to [T, V].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from eagleray.kernels import cpu_decode
from eagleray.platform.errors import EaglerayError


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    world: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup, None = the default group

    @classmethod
    def current(cls) -> "TPInfo":
        """The default process group if one is initialised, else a single process."""
        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(), world=dist.get_world_size())
        return cls()


def divide(n: int, world: int, what: str) -> int:
    """``n // world``, or a clear error when ``n`` does not split evenly."""
    if n % world:
        raise EaglerayError(
            f"{what}={n} is not divisible by the tensor-parallel size {world}\n"
            f"    fix: choose a tensor-parallel size that divides {what}"
        )
    return n // world


def split_sizes(n: int, world: int, what: str) -> list[int]:
    """``n`` items dealt to ``world`` ranks as evenly as possible (lower ranks get the extra one)."""
    if n < world:
        raise EaglerayError(
            f"{what}={n} cannot be split over tensor-parallel size {world} (every rank needs at least one)\n"
            f"    fix: choose a tensor-parallel size <= {n}"
        )
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum ``x`` over the group in place (identity at world 1)."""
    if tp.world > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Concatenate every rank's ``x`` [..., n] along the last dim -> [..., n*world]."""
    if tp.world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.world)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def _copy_loader(param: torch.Tensor, full: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(full.shape):
        raise EaglerayError(
            f"weight shape {tuple(full.shape)} does not match the model's {tuple(param.shape)}\n"
            f"    fix: the checkpoint does not belong to this config.json"
        )
    param.data.copy_(full)


def _shard_loader(dim: int, rank: int, sizes: list[int]):
    """A loader that copies this rank's part of ``full`` along ``dim`` (parts of ``sizes``, in rank order)."""
    offset = sum(sizes[:rank])

    def load(param: torch.Tensor, full: torch.Tensor) -> None:
        if full.shape[dim] != sum(sizes) or param.shape[dim] != sizes[rank]:
            raise EaglerayError(
                f"weight shape {tuple(full.shape)} does not shard into {tuple(param.shape)} "
                f"(parts {sizes}) along dim {dim}\n    fix: the checkpoint does not belong to this config.json"
            )
        _copy_loader(param, full.narrow(dim, offset, sizes[rank]))

    return load


def _sizes(n: int, tp: TPInfo, what: str, sizes: list[int] | None) -> list[int]:
    """Per-rank parts of ``n``: ``sizes`` when given (checked), else equal parts (``n`` must divide)."""
    if sizes is None:
        return [divide(n, tp.world, what)] * tp.world
    if len(sizes) != tp.world or sum(sizes) != n or min(sizes) < 1:
        raise EaglerayError(f"{what}: parts {sizes} do not split {n} over {tp.world} ranks (engine bug)")
    return sizes


def new_param(shape: tuple[int, ...], dtype: torch.dtype, device, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def default_weight_loader(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a replicated tensor (shapes must match exactly)."""
    _copy_loader(param, full)


class _ShardedLinear(nn.Module):
    """A linear whose weight [out, in] is split over the tensor-parallel ranks along ``DIM``: 0, output rows
    (column parallel; the bias is split with them), or 1, input columns (row parallel; the bias is whole on
    every rank, added after the all-reduce). ``what`` names the split size in errors; ``sizes``: uneven parts."""

    DIM: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPInfo,
        dtype: torch.dtype,
        device=None,
        what: str | None = None,
        sizes: list[int] | None = None,
    ):
        super().__init__()
        self.tp = tp
        shape = [out_features, in_features]
        parts = _sizes(shape[self.DIM], tp, what or ("out_features", "in_features")[self.DIM], sizes)
        shape[self.DIM] = parts[tp.rank]
        self.weight = new_param(tuple(shape), dtype, device, _shard_loader(self.DIM, tp.rank, parts))
        bias_loader = _shard_loader(0, tp.rank, parts) if self.DIM == 0 else default_weight_loader
        self.bias = new_param((shape[0],), dtype, device, bias_loader) if bias else None


class ColumnParallelLinear(_ShardedLinear):
    """y = x W^T + b with W split by output rows: x [T, in] -> y [T, out/tp]."""

    DIM = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out/tp]
        return cpu_decode.dispatch(x, self.weight, self.bias)


class FusedLinear:
    """Several column-parallel linears over the same input as one GEMM (inference only).

    The parts' weights become views of one [sum(out), in] tensor, so loading into a part still
    lands in the fused weight; a module that trains must not be fused (its parts would get no grads).
    """

    def __init__(self, parts: list[ColumnParallelLinear]):
        biased = [p.bias is not None for p in parts]
        if any(biased) and not all(biased):
            raise EaglerayError("FusedLinear: either every part has a bias or none does (engine bug)")
        self.sizes = [p.weight.shape[0] for p in parts]
        with torch.no_grad():
            self.weight = torch.cat([p.weight for p in parts])  # [sum(out), in]
            self.bias = torch.cat([p.bias for p in parts]) if all(biased) else None  # [sum(out)]
        offset = 0
        for part, n in zip(parts, self.sizes):
            part.weight = _view_param(part.weight, self.weight[offset : offset + n])
            if self.bias is not None:
                part.bias = _view_param(part.bias, self.bias[offset : offset + n])
            offset += n

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # x [T, in] -> one [T, out_i] per part
        return cpu_decode.dispatch(x, self.weight, self.bias).split(self.sizes, dim=-1)


def _view_param(old: nn.Parameter, view: torch.Tensor) -> nn.Parameter:
    p = nn.Parameter(view, requires_grad=False)
    p.weight_loader = old.weight_loader  # type: ignore[attr-defined]
    return p


class RowParallelLinear(_ShardedLinear):
    """y = x W^T + b with W split by input columns: x [T, in/tp] -> y [T, out] (all-reduced)."""

    DIM = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in/tp] -> [T, out]
        y = all_reduce(cpu_decode.dispatch(x, self.weight), self.tp)  # [T, out]
        return y if self.bias is None else y + self.bias


def _vocab_loader(rank: int, local: int, vocab: int):
    """Copy rows [rank*local, rank*local+local) of a [vocab, H] tensor; padding rows become 0."""

    def load(param: torch.Tensor, full: torch.Tensor) -> None:
        if full.shape[0] != vocab or full.shape[1:] != param.shape[1:]:
            raise EaglerayError(
                f"vocab weight shape {tuple(full.shape)} does not match ({vocab}, {param.shape[1]})\n"
                f"    fix: the checkpoint does not belong to this config.json"
            )
        start = rank * local
        rows = full[start : start + local]  # [<=local, H]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    return load


class VocabParallelEmbedding(nn.Module):
    """ids [T] -> [T, H]; each rank holds a contiguous block of ceil(V/tp) rows."""

    def __init__(self, vocab: int, hidden: int, tp: TPInfo, dtype: torch.dtype, device=None):
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.local = -(-vocab // tp.world)  # rows per rank (last rank padded)
        self.start = tp.rank * self.local
        self.weight = new_param((self.local, hidden), dtype, device, _vocab_loader(tp.rank, self.local, vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, H]
        if self.tp.world == 1:
            return nn.functional.embedding(ids, self.weight)
        local_ids = ids - self.start  # [T]
        inside = (local_ids >= 0) & (local_ids < self.local)  # [T]
        out = nn.functional.embedding(torch.where(inside, local_ids, 0), self.weight)  # [T, H]
        out = out * inside.unsqueeze(-1).to(out.dtype)  # [T, H]
        return all_reduce(out, self.tp)


class ParallelLMHead(nn.Module):
    """hidden [T, H] -> logits [T, V] with the vocab rows sharded like :class:`VocabParallelEmbedding`."""

    def __init__(self, vocab: int, hidden: int, tp: TPInfo, dtype: torch.dtype, device=None):
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.local = -(-vocab // tp.world)
        self.weight = new_param((self.local, hidden), dtype, device, _vocab_loader(tp.rank, self.local, vocab))

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's Parameter (tie_word_embeddings)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden [T, H] -> [T, V]
        local = cpu_decode.dispatch(hidden, self.weight)  # [T, V_pad/tp]
        return all_gather_last(local, self.tp)[..., : self.vocab]  # [T, V]
