"""``python -m eagleray.jobs.regenerate --config FILE --out FILE.jsonl`` (also ``eagleray regenerate``).

Regenerates the target's answers to a datagen config's prompts in this process (no Ray): for a GPU
box without a cluster, or to split datagen into regeneration here and hidden states elsewhere
(``eagleray datagen`` with ``backend: given`` and ``prompts: [FILE.jsonl]``, ``split_turns: false``).
Rerun the same command to resume. ``--prompts-only`` writes the selected prompts and stops.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagleray.jobs.entry import add_set_argument, run_job
from eagleray.platform.config.load import load_yaml_config
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.errors import EaglerayError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="datagen YAML config: prompts, limit, target, backend, generation")
    p.add_argument("--out", required=True, type=Path, help="JSONL to append the answered conversations to")
    add_set_argument(p, "limit=100")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the config's target.device; auto = cuda when available)")
    p.add_argument(
        "--prompts-only", action="store_true", help="write the selected prompts (messages JSONL) to --out without generating"
    )
    p.add_argument(
        "--shard",
        type=parse_shard,
        default=(0, 1),
        metavar="I/N",
        help="answer_turns 'all': take the conversations whose id hashes to shard I of N (run N processes: one GPU or many)",
    )


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' with 0 <= I < N -> (I, N)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r} is not I/N (e.g. 0/4)") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: need 0 <= I < N")
    return i, n


def run(args: argparse.Namespace) -> int:
    from eagleray.datagen.answers_only import regenerate, regenerate_conversations, write_prompts
    from eagleray.platform.host import pick_device

    cfg = load_yaml_config(DatagenConfig, args.config, args.set)
    if args.prompts_only:
        write_prompts(cfg, args.out, emit=lambda s: print(s, flush=True))
        return 0
    device = pick_device(args.device or cfg.target.device).type
    emit = lambda s: print(s, flush=True)  # noqa: E731
    if cfg.answer_turns == "all":
        manifest = regenerate_conversations(cfg, args.out, device, emit, shard=args.shard)
        return 0 if manifest["lost"] == 0 and manifest["answered"] > 0 else 1
    if args.shard != (0, 1):
        raise EaglerayError(
            "--shard splits conversations: it needs answer_turns: all\n    fix: --set answer_turns=all or drop --shard"
        )
    manifest = regenerate(cfg, args.out, device, emit=emit)
    return 0 if manifest["rows"] > 0 else 1


if __name__ == "__main__":
    sys.exit(run_job("python -m eagleray.jobs.regenerate", add_arguments, run))
