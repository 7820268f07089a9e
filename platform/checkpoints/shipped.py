"""Drafts shipped in the repository, one folder each under ``platform/checkpoints/shipped/``: trained by eagleray's
own runs, in the vLLM EAGLE-3 format (config.json + bf16 model.safetensors), each with a MODEL_CARD.md saying how it
was trained and what it measured. A draft source ``shipped:<name>`` resolves to one of them
(:func:`eagleray.platform.registry.resolve_draft`)."""

from __future__ import annotations

from pathlib import Path

from eagleray.platform.errors import EaglerayError

SHIPPED_DIR = Path(__file__).parent / "shipped"
PREFIX = "shipped:"
SMOLLM2_CHAMPION = "smollm2-135m-instruct-eagle3-sharegpt"  # the SmolLM2 quickstart's champion


def shipped_names() -> list[str]:
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file())


def shipped_draft(name: str) -> Path:
    """The directory of the shipped draft ``name``."""
    path = SHIPPED_DIR / name
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise EaglerayError(
            f"draft: no shipped draft {name!r} (shipped: {', '.join(shipped_names()) or 'none'})\n"
            f"    fix: use one of those names after '{PREFIX}', a draft directory, or models:/<name>@<alias>"
        )
    return path
