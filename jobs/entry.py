"""What every entry point shares: ``python -m eagleray.jobs.X`` and ``eagleray X`` parse, log and exit alike.

A user error (:class:`EaglerayError`) prints ``PROG: error: ...`` with its fix and exits 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from eagleray.platform.errors import EaglerayError


def run_reporting_errors(
    prog: str, run: Callable[[argparse.Namespace], int | None], args: argparse.Namespace, level: int = logging.WARNING
) -> int:
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(run(args) or 0)
    except EaglerayError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2


def run_job(prog: str, add_arguments: Callable, run: Callable, argv: list[str] | None = None) -> int:
    """``python -m eagleray.jobs.X``: the same arguments, errors and exit codes as ``eagleray X``."""
    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    return run_reporting_errors(prog, run, parser.parse_args(argv))


def add_set_argument(p: argparse.ArgumentParser, example: str) -> None:
    """``--set FIELD=JSON`` (repeatable): the config overrides every config-driven job takes; ``example`` e.g. 'limit=100'."""
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help=f"override a config field, dotted, value as JSON or a bare string (e.g. --set {example})",
    )
