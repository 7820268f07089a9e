"""``eagleray promote --config FILE`` / ``python -m eagleray.jobs.promote --config FILE``.

Measures the candidate draft and the current champion (``models:/<name>@<alias>``) with the
engine on held-out prompts, against plain decoding; moves the alias only when the candidate is
better by the configured margin and faster than no speculation; writes the decision and the
numbers as tags on the candidate's model version (see eagleray.serve.promotion).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from eagleray.jobs.entry import run_job
from eagleray.platform import registry
from eagleray.platform.config.load import load_yaml_config
from eagleray.platform.config.promotion import PromotionConfig
from eagleray.platform.errors import EaglerayError

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="promotion YAML config (see jobs/configs/promote-smollm2-cpu.yaml)")
    p.add_argument("--candidate", default=None, help="override the config's candidate (models:/<name>/<version> or a directory)")
    p.add_argument("--dry-run", action="store_true", help="measure and print the decision; set no alias, write no tags")


def champion_of(cfg: PromotionConfig, candidate_version: str | None) -> registry.DraftVersion | None:
    """The version the alias points at now; None when the alias is not set yet or is the candidate itself."""
    name = cfg.mlflow.registered_model
    try:
        champ = registry.get_alias(name, cfg.alias)
    except EaglerayError as err:  # no champion yet: the candidate only has to beat plain decoding
        logger.warning("no champion to compare with: %s", str(err).splitlines()[0])
        return None
    return None if champ.version == candidate_version else champ


def tags_of(result: dict) -> dict[str, str]:
    d, cand, plain = result["decision"], result["candidate"], result["plain"]
    champ = result.get("champion") or {}
    return {
        "promotion.decision": "promote" if d["promote"] else "reject",
        "promotion.reason": d["reason"][:4000],
        "promotion.tau": str(cand["tau"]),
        "promotion.accept_rate_per_pos": json.dumps(cand["accept_rate_per_pos"]),
        "promotion.tokens_per_s": str(cand["tokens_per_s"]),
        "promotion.plain_tokens_per_s": str(plain["tokens_per_s"]),
        "promotion.speedup": f"{d['speedup']:.4f}",
        "promotion.champion_version": str(champ.get("version")),
        "promotion.champion_tau": str(champ.get("tau")),
        "promotion.prompts": ",".join(result["prompts"]),
        "promotion.num_prompts": str(result["num_prompts"]),
    }


def promote(cfg: PromotionConfig) -> dict:
    """Measure, decide, record; returns everything measured and decided."""
    from eagleray.serve.promotion import DraftTrial, decide

    registry.configure(cfg.mlflow.tracking_uri)
    cand = registry.resolve_draft(cfg.candidate, tracking_uri=cfg.mlflow.tracking_uri)
    cand_name, cand_version = cand.version.split("/", 1) if registry.is_registry_uri(cfg.candidate) else (None, None)
    champ = champion_of(cfg, cand_version if cand_name == cfg.mlflow.registered_model else None)
    trial = DraftTrial(cfg)
    plain_before = trial.measure("plain", None, None)
    champion = None
    if champ is not None:
        champion = trial.measure(
            "champion", registry.resolve_draft(champ.uri, tracking_uri=cfg.mlflow.tracking_uri).path, champ.version
        )
    candidate = trial.measure("candidate", cand.path, cand.version)
    # plain again, last: a baseline slowed by whatever ran before the job (a training run's workers winding down)
    # would flatter every draft; the gate takes the faster of the two
    plain_after = trial.measure("plain", None, None)
    plain = max(plain_before, plain_after, key=lambda m: m.tokens_per_s)
    decision = decide(candidate, champion, plain, cfg)
    result = {
        "candidate": candidate.to_dict(),
        "champion": champion.to_dict() if champion else None,
        "plain": plain.to_dict(),
        "plain_runs_tokens_per_s": [round(plain_before.tokens_per_s, 3), round(plain_after.tokens_per_s, 3)],
        "decision": decision.__dict__,
        "prompts": cfg.prompts,
        "num_prompts": len(trial.prompts),
        "alias_set": False,
    }
    if cfg.dry_run:
        return result
    if cand_version is None:
        result["note"] = "candidate is a directory, not a registry version: nothing tagged, no alias set"
        return result
    from mlflow import MlflowClient

    client = MlflowClient()
    for k, v in tags_of(result).items():
        client.set_model_version_tag(cand_name, cand_version, k, v)
    if decision.promote:
        registry.set_alias(cand_name, cfg.alias, cand_version)
        result["alias_set"] = True
    return result


def run(args: argparse.Namespace) -> int:
    cfg = load_yaml_config(PromotionConfig, args.config)
    updates = {k: v for k, v in (("candidate", args.candidate), ("dry_run", True if args.dry_run else None)) if v is not None}
    cfg = cfg.model_copy(update=updates)
    result = promote(cfg)
    d = result["decision"]
    print(json.dumps(result, indent=2))
    print(f"\n{'PROMOTED' if result['alias_set'] else 'NOT promoted'}: {cfg.candidate} -> @{cfg.alias}: {d['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(run_job("python -m eagleray.jobs.promote", add_arguments, run))
