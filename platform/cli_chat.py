"""``eagleray chat --target smollm2 "prompt"``: one chat answer from the real model (transformers)."""

from __future__ import annotations

import argparse

from eagleray.platform.chat import chat_once
from eagleray.platform.smollm2 import resolve_target
from eagleray.platform.target import TargetSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message")
    p.add_argument("--target", default="smollm2", help="target model directory, or 'smollm2'")
    p.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens")
    p.add_argument("--system", default=None, help="optional system message")


def run(args: argparse.Namespace) -> int:
    target = TargetSpec.from_dir(resolve_target(args.target))  # clear error for a bad directory
    print(chat_once(target.path, args.prompt, max_tokens=args.max_tokens, system=args.system))
    return 0
