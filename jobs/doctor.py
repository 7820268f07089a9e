"""``eagleray doctor --target DIR --draft DIR [--algorithm NAME]``: run the compatibility guard."""

from __future__ import annotations

import argparse
import sys

from eagleray.platform import registry
from eagleray.platform.checkpoints.guard import GuardReport, check_compatibility
from eagleray.platform.checkpoints.target import TargetSpec, resolve_target


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model directory, or 'smollm2' for the packaged model")
    p.add_argument(
        "--draft",
        required=True,
        help="draft checkpoint directory, models:/<name>@<alias> | models:/<name>/<version> "
        "(MLflow registry at MLFLOW_TRACKING_URI, default the sqlite store under $EAGLERAY_HOME), or shipped:<name>",
    )
    p.add_argument(
        "--algorithm",
        default=None,
        help="the speculative algorithm you intend to serve with (eagle3, eagle); "
        "checked against the draft. Default: derived from the draft",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="serving context length (default: the target's)")


def run(args: argparse.Namespace) -> int:
    target = TargetSpec.from_dir(resolve_target(args.target))
    # every kind of source through the one resolver (a registry URI: MLFLOW_TRACKING_URI, else the sqlite store
    # under $EAGLERAY_HOME); a directory is itself, so the guard reports what is wrong inside it
    draft = registry.resolve_draft(args.draft, target).path
    report = check_compatibility(target, draft, algorithm=args.algorithm, max_model_len=args.max_model_len)
    if report.ok:
        print(summary(report, target, args.draft))
        return 0
    print(f"NOT compatible: {len(report.problems)} problem(s) with draft {args.draft} on target {target.path}:", file=sys.stderr)
    for problem in report.problems:
        print(f"- {problem.render()}", file=sys.stderr)
    return 2


def summary(report: GuardReport, target: TargetSpec, draft: str) -> str:
    f = report.facts
    fp = "checked" if f.get("fingerprints_recorded") else "not recorded by the draft (not checked)"
    return "\n".join(
        [
            f"compatible: {draft} can serve {target.path}",
            f"  algorithm       {f['algorithm']} (derived from the draft)",
            f"  aux layers      {f['aux_layer_ids']} of {f['target_layers']} -> fc input {len(f['aux_layer_ids'])} x {f['hidden_size']}",
            f"  vocab           draft {f['draft_vocab_size']} of target {f['vocab_size']}",
            f"  fingerprints    {fp}",
        ]
    )
