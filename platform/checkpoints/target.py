"""What eagleray needs to know about a target model directory (HF config.json + safetensors)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from eagleray.platform.checkpoints.fingerprint import target_fingerprint, tokenizer_fingerprint, weight_shapes
from eagleray.platform.errors import ConfigError, EaglerayError, Problem

SUPPORTED_TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def read_model_dir(path: str | Path, what: str, fix: str) -> tuple[Path, dict[str, Any]]:
    """(directory, its config.json) of a model directory; not a directory or a bad config.json is a clear error."""
    p = Path(path)
    if not p.is_dir():
        raise EaglerayError(f"{what}: {p} is not a directory\n    fix: {fix}")
    return p, read_json(p / "config.json", what)


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Read a JSON object from ``path``; a missing or malformed file is a clear error."""
    if not path.is_file():
        raise EaglerayError(f"{what}: {path} does not exist\n    fix: point at a directory that contains {path.name}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise EaglerayError(
            f"{what}: {path} is not valid JSON ({err})\n    fix: restore the file from the original checkpoint"
        ) from None
    if not isinstance(data, dict):
        raise EaglerayError(f"{what}: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def rope_of(config: dict[str, Any]) -> dict[str, Any]:
    """Rope settings in one shape whether the config uses ``rope_theta``/``rope_scaling`` or ``rope_parameters``."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    theta = params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
    kind = params.pop("rope_type", None) or scaling.get("rope_type") or scaling.get("type") or "default"
    extra = {k: v for k, v in {**scaling, **params}.items() if k not in ("type", "rope_type")}
    return {"rope_theta": float(theta), "rope_type": kind, **extra}


REQUIRED_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "intermediate_size")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_target_config(config: dict[str, Any]) -> list[Problem]:
    """The architecture fields eagleray reads from a target's config.json: present, positive integers, consistent."""
    fix = "restore config.json from the original checkpoint (a Hugging Face Llama-family config)"
    out = []
    for key in REQUIRED_INTS:
        if key not in config:
            out.append(Problem(f"target.config.{key}", "is missing", fix))
        elif not _positive_int(config[key]):
            out.append(Problem(f"target.config.{key}", f"is {config[key]!r}, not a positive integer", fix))
    for key in OPTIONAL_INTS:
        if config.get(key) is not None and not _positive_int(config[key]):
            out.append(Problem(f"target.config.{key}", f"is {config[key]!r}, not a positive integer", fix))
    if out:
        return out
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv:
        out.append(
            Problem(
                "target.config.num_key_value_heads",
                f"{heads} attention heads cannot be split into {kv} "
                "key/value groups (num_attention_heads must be a multiple of num_key_value_heads)",
                fix,
            )
        )
    if config.get("head_dim") is None and config["hidden_size"] % heads:
        out.append(
            Problem(
                "target.config.head_dim",
                f"is not set and hidden_size {config['hidden_size']} is not a multiple of num_attention_heads {heads}",
                "set head_dim, or " + fix,
            )
        )
    return out


@dataclass
class TargetSpec:
    """A target model directory and the architecture facts the guard and engine use."""

    path: Path
    config: dict[str, Any] = field(repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> "TargetSpec":
        p, config = read_model_dir(
            path, "target", "pass a Hugging Face model directory (config.json + *.safetensors) or 'smollm2'"
        )
        problems = check_target_config(config)
        if problems:
            raise ConfigError(problems, source=str(p / "config.json"))
        return cls(path=p, config=config)

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.hidden_size // self.num_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_positions(self) -> int:
        return int(self.config.get("max_position_embeddings") or 0)

    @property
    def rope(self) -> dict[str, Any]:
        return rope_of(self.config)

    @property
    def default_aux_layer_ids(self) -> list[int]:
        """EAGLE-3's default: the inputs of layers 2, N//2 and N-3 (vLLM's convention)."""
        n = self.num_layers
        return sorted({min(2, n), n // 2, max(n - 3, 0)})

    @cached_property
    def weight_shapes(self) -> dict[str, list[int]]:
        return weight_shapes(self.path)

    @cached_property
    def fingerprint(self) -> str:
        return target_fingerprint(self.config, self.weight_shapes)

    @cached_property
    def tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.path)


def resolve_target(name_or_dir: str | Path, dtype: str = "fp32") -> Path:
    """A target model directory: ``smollm2`` means the packaged model (converted once to ``dtype``); anything
    else is a model directory."""
    if str(name_or_dir).lower() in ("smollm2", "smollm2-135m-instruct"):
        from eagleray.platform.checkpoints.smollm2 import smollm2_dir

        return smollm2_dir(dtype)
    return Path(name_or_dir)
