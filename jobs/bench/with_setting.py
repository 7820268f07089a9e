"""Run a bench suite with class attributes set first (the lent-GPU A/B scripts' variants), in this process:

    python3 -m eagleray.jobs.bench.with_setting "mod:Class.ATTR[,mod2:Class2.ATTR2]" VALUE SUITE ARGS...

sets each named attribute to VALUE (a Python literal), then runs ``python -m eagleray.jobs.bench SUITE ARGS...``; an
empty first argument sets nothing. Used by step_variants_h200.sh and base_ab_h200.sh.
"""

from __future__ import annotations

import ast
import importlib
import runpy
import sys


def apply(settings: str, value: str) -> None:
    """Set every ``mod:Class.ATTR`` of the comma-separated ``settings`` to the literal ``value``."""
    for setting in filter(None, settings.split(",")):
        mod, attr = setting.split(":")
        cls, name = attr.split(".")
        setattr(getattr(importlib.import_module(mod), cls), name, ast.literal_eval(value))


if __name__ == "__main__":
    apply(sys.argv[1], sys.argv[2])
    sys.argv = ["eagleray.jobs.bench"] + sys.argv[3:]
    runpy.run_module("eagleray.jobs.bench", run_name="__main__")
