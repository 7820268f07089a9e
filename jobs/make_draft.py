"""``eagleray draft random --target T --out DIR``: an untrained EAGLE-3 draft (τ≈1, for checks)."""

from __future__ import annotations

import argparse

from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec, resolve_target


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=["random"], help="how to initialise the draft")
    p.add_argument("--target", required=True, help="target model directory, or 'smollm2'")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--aux-layers", type=int, nargs="+", default=None, help="aux layer ids (default 2, N//2, N-3)")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="draft vocabulary size (default: the target's)")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed")


def run(args: argparse.Namespace) -> int:
    target = TargetSpec.from_dir(resolve_target(args.target))
    print(
        make_random_draft(target, args.out, aux_layer_ids=args.aux_layers, draft_vocab_size=args.draft_vocab_size, seed=args.seed)
    )
    return 0
