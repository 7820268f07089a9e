"""The ``eagleray`` command line: one subcommand per entry point in ``jobs/``.

Each command's module is imported only when that command runs, so start-up stays fast and a
command's heavy dependencies (Ray, vLLM, MLflow) load only for the commands that use them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable

from eagleray.jobs.entry import run_reporting_errors

# command -> (module with `add_arguments(parser)` and `run(args) -> int`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("eagleray.jobs.prepare_model", "prepare a packaged model and print its directory"),
    "doctor": ("eagleray.jobs.doctor", "check that a draft can serve a target (the compatibility guard)"),
    "chat": ("eagleray.jobs.chat", "one chat answer from a target model"),
    "draft": ("eagleray.jobs.make_draft", "write an untrained EAGLE-3 draft for a target"),
    "datagen": ("eagleray.jobs.datagen", "regenerate responses and write aux hidden-state shards (Ray Data, resumable)"),
    "regenerate": ("eagleray.jobs.regenerate", "regenerate the target's answers in one process (no Ray) to a JSONL, resumable"),
    "train": ("eagleray.jobs.train", "train an EAGLE-3 draft (Ray Train) with MLflow tracking and registry"),
    "serve": ("eagleray.jobs.serve", "serve the target + draft behind OpenAI-compatible HTTP on Ray Serve"),
    "promote": (
        "eagleray.jobs.promote",
        "measure a candidate draft against the champion and plain decoding; set the alias if it wins",
    ),
    "adapt": (
        "eagleray.jobs.adapt",
        "the adaptation loop: fine-tune the champion on captured traffic, gate it, move the alias on a pass",
    ),
    "bench": ("eagleray.jobs.bench", "benchmarks (verify, spec, gpu) that print a table and write JSON"),
    "quickstart": ("eagleray.jobs.quickstart", "the whole loop on this machine with defaults"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser; only the chosen command's module is imported (start-up stays fast)."""
    parser = argparse.ArgumentParser(prog="eagleray", description="EAGLE-3 speculative decoding on Ray.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if name == chosen:
            _load(module, "add_arguments")(p)
    return parser


def _load(module: str, attr: str) -> Callable:
    return getattr(importlib.import_module(module), attr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    return run_reporting_errors(
        f"eagleray {args.command}", _load(args._module, "run"), args, logging.INFO if args.verbose else logging.WARNING
    )


if __name__ == "__main__":
    sys.exit(main())
