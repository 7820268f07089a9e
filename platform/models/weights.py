"""Load safetensors checkpoints into eagleray modules, one full tensor at a time, sharded by rank."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.tp import default_weight_loader


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of every ``*.safetensors`` file in ``path`` (CPU)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise EaglerayError(
            f"no *.safetensors file in {path}\n    fix: point at a HF model directory with safetensors weights "
            f"(convert .bin/.gguf checkpoints with transformers' save_pretrained)"
        )
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def load_weights(
    module: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    rename: Callable[[str], str | None] = lambda n: n,
    what: str = "model",
) -> set[str]:
    """Copy checkpoint tensors into ``module``'s parameters through their ``weight_loader``.

    ``rename`` maps a checkpoint name to a parameter name, or None to skip it. Unknown tensors and
    parameters left unloaded are errors naming them. Returns the loaded parameter names.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unknown: list[str] = []
    for name, tensor in tensors:
        target = rename(name)
        if target is None:
            continue
        param = params.get(target)
        if param is None:
            unknown.append(name)
            continue
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded.add(target)
    required = {n for n, _ in module.named_parameters()}  # shared (tied) parameters once
    missing = sorted(n for n in required if n not in loaded and not _loaded_via_alias(module, n, loaded))
    if unknown or missing:
        raise EaglerayError(
            f"{what}: checkpoint does not match the architecture "
            f"(unexpected tensors: {unknown[:8]}{'...' if len(unknown) > 8 else ''}; "
            f"missing tensors: {missing[:8]}{'...' if len(missing) > 8 else ''})\n"
            f"    fix: check that config.json belongs to these weights"
        )
    return loaded


def _loaded_via_alias(module: nn.Module, name: str, loaded: set[str]) -> bool:
    """True when another name of the same (tied) Parameter was loaded."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return any(params[other] is params[name] for other in loaded)
