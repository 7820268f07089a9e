"""Strict pydantic configs loaded from YAML, with errors that name the dotted field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from eagleray.platform.errors import ConfigError, Problem

C = TypeVar("C", bound="StrictModel")


class StrictModel(BaseModel):
    """Base of every eagleray config: unknown fields are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def _fix_for(error: dict[str, Any]) -> str:
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        return "remove this field or correct its spelling (see the config's field descriptions)"
    if kind == "missing":
        return "add this required field"
    return "give a value of the expected type/range"


def problems_from_validation(err: ValidationError, prefix: str = "") -> list[Problem]:
    """Turn a pydantic ValidationError into Problems with dotted field paths."""
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        field = f"{prefix}.{loc}" if prefix else loc
        got = e.get("input")
        got_s = "" if e.get("type") == "missing" else f" (got {got!r:.80})"
        out.append(Problem(field=field, message=f"{e['msg']}{got_s}", fix=_fix_for(e)))
    return out


def parse_config(cls: type[C], data: Any, *, source: str | None = None, prefix: str = "") -> C:
    """Validate ``data`` against ``cls``; raise ConfigError naming every bad dotted field."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(problems_from_validation(err, prefix), source=source) from None


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``--set a.b.c=VALUE`` override (VALUE as JSON, else a bare string) to ``data``."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError([Problem("--set", f"{item!r} is not FIELD=VALUE", "write it like --set generation.max_tokens=64")])
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    node = data
    *parents, last = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([Problem(key, f"{part!r} holds {child!r}, not a section", "override a field inside a section")])
        node = child
    node[last] = value


def load_yaml_config(cls: type[C], path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> C:
    """Load a YAML file into the config class ``cls``, then apply ``--set`` overrides."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([Problem("<file>", f"config file {str(p)!r} does not exist", "pass an existing YAML file")])
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise ConfigError([Problem("<file>", f"not valid YAML: {err}", "fix the YAML syntax")], source=str(p)) from None
    if data is None:
        data = {}
    if overrides and isinstance(data, dict):
        for item in overrides:
            apply_override(data, item)
    return parse_config(cls, data, source=str(p))
