"""``python -m eagleray.jobs.adapt --config FILE`` (also ``eagleray adapt``, ``ray job submit ... -- python -m ...``).

The adaptation loop: the draft follows the served traffic. One pass::

    [1/4] window   captured shards under capture_path (platform/capture_store); enough requests captured
                   since the last adaptation's window? (min_new_requests) else: a 'skip' decision
                   -> snapshot (a dataset training reads), held-out requests by request-id hash
    [2/4] train    fine-tune the champion (models:/<name>@<alias>) on the snapshot, replay mixed in
                   (training.replay), registered as a new version (no alias)
    [3/4] gate     champion and candidate with the engine on the held-out captured prompts (shifted
                   domain) and on the fixed control set: τ (and tokens/s vs plain with min_speedup)
    [4/4] decide   promote iff traffic τ gain >= min_tau_gain and control τ change >= -max_control_regression
                   -> tags on the version; alias moved on 'promote' (the Serve app's alias poller hot-swaps);
                   capture_path/adapt/last.json (serving exports it on /metrics)

Every decision, 'skip' included, is an MLflow run of ``mlflow.experiment`` with its numbers. With
``every_s`` the pass repeats forever (a long-running Ray job); ``--once`` runs one pass regardless.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eagleray.jobs.entry import run_job
from eagleray.platform import capture_store, registry
from eagleray.platform.config.load import load_yaml_config, parse_config
from eagleray.platform.config.promotion import AdaptConfig, PromotionConfig
from eagleray.platform.config.schemas import TrainingConfig
from eagleray.platform.errors import EaglerayError

logger = logging.getLogger(__name__)
Emit = Callable[[str], None]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="adaptation YAML config (see jobs/configs/adapt-smollm2-cpu.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="override a config field, dotted")
    p.add_argument("--once", action="store_true", help="one pass, even when the config sets every_s")
    p.add_argument("--force", action="store_true", help="train even when fewer than min_new_requests are new")


@dataclass
class Window:
    """The captured traffic a pass trains on."""

    snapshot: Path
    manifest: dict[str, Any]
    new_requests: int
    held_out: list[list[int]]  # prompt token ids of held-out captured requests


@dataclass
class Decision:
    id: str
    action: str  # 'skip' | 'promote' | 'reject'
    reason: str
    champion: str | None = None  # models:/name/version
    candidate: str | None = None
    tau: dict[str, dict[str, float]] = field(default_factory=dict)  # {'traffic'|'control': {'before', 'after'}}
    numbers: dict[str, float] = field(default_factory=dict)
    window: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


# ---------------------------------------------------------------------- [1/4] window
def trained_until(cfg: AdaptConfig) -> int:
    """The capture time (ms) up to which the last training pass saw traffic (0: never)."""
    status = capture_store.read_adapt_status(cfg.capture_path) or {}
    return int(status.get("window", {}).get("window_last_ms", 0))


def held_out_prompts(snapshot: Path, fraction: float, limit: int) -> list[list[int]]:
    """Prompt token ids (the tokens before the answer) of the held-out captured requests, each prompt once
    (requests of one prompt, e.g. several sampled answers, would weigh it several times in a greedy gate)."""
    from eagleray.training.data import iter_rows, shard_files

    out, seen = [], set()
    for row in iter_rows(shard_files(snapshot), split="eval", eval_fraction=fraction, shuffle=False):
        mask = row["loss_mask"]
        start = next((i for i, m in enumerate(mask) if m), len(mask))
        prompt = tuple(row["input_ids"][:start])
        if start and prompt not in seen:
            seen.add(prompt)
            out.append(list(prompt))
        if len(out) >= limit:
            break
    return out


def window_step(cfg: AdaptConfig, work: Path, vocab_size: int, force: bool) -> Window | str:
    """The snapshot to train on, or why this pass skips."""
    shards = capture_store.list_shards(cfg.capture_path)
    since = trained_until(cfg)
    new = capture_store.count_rows([s for s in shards if s.last_ms > since])
    if new < cfg.min_new_requests and not force:
        return f"{new} requests captured since the last adaptation; min_new_requests is {cfg.min_new_requests}"
    if not shards:
        return f"no captured shards under {cfg.capture_path}"
    manifest = capture_store.snapshot(shards, work / "data", vocab_size)
    held = held_out_prompts(work / "data", cfg.held_out_fraction, cfg.max_held_out)
    if not held:
        return f"none of the {manifest['rows']} captured requests is held out (held_out_fraction {cfg.held_out_fraction})"
    return Window(work / "data", manifest, new, held)


# ---------------------------------------------------------------------- [2/4] train
def train_step(cfg: AdaptConfig, window: Window, champion_dir: Path, champion: str, decision_id: str, emit: Emit) -> str:
    """Fine-tune the champion on the window; returns the registered candidate's models:/name/version."""
    from eagleray.training.trainer import train

    fields = {
        **cfg.train,
        "data_dir": str(window.snapshot),
        "init_from": str(champion_dir),
        "output_dir": str(window.snapshot.parent / "train"),
        "target": cfg.target.model_dump(mode="json"),
        "eval_fraction": cfg.held_out_fraction,
        "register_model": True,
        "alias": None,
        "mlflow": cfg.mlflow.model_dump(mode="json"),
        "run_tags": {"adapt.decision": decision_id, "adapt.champion": champion, **cfg.train.get("run_tags", {})},
    }
    tcfg = parse_config(TrainingConfig, fields, source="adapt config", prefix="train")
    result = train(tcfg, emit=emit, run_name=f"adapt-{decision_id}")
    if result.version is None:
        raise EaglerayError("adapt: the training run registered no version\n    fix: leave train.register_model unset")
    return result.version.uri


# ---------------------------------------------------------------------- [3/4] gate
def gate_step(cfg: AdaptConfig, champion_dir: Path, candidate_dir: Path, traffic: list[list[int]], emit: Emit) -> dict[str, Any]:
    """τ (and tokens/s) of champion and candidate on held-out traffic and on the control set (one loaded target)."""
    from eagleray.serve.promotion import DraftTrial

    pcfg = PromotionConfig(
        candidate=str(candidate_dir),
        target=cfg.target,
        prompts=cfg.control,
        limit=cfg.control_limit,
        max_tokens=cfg.max_tokens,
        num_speculative_tokens=cfg.num_speculative_tokens,
    )
    trial = DraftTrial(pcfg)
    plan = [("traffic", "before", champion_dir), ("traffic", "after", candidate_dir)]
    plan += [("control", "before", champion_dir), ("control", "after", candidate_dir)]
    out: dict[str, Any] = {"traffic": {}, "control": {}, "tokens_per_s": {}}
    t0 = time.monotonic()
    for i, (domain, when, draft) in enumerate(plan):
        prompts = traffic if domain == "traffic" else trial.prompts
        m = trial.measure(f"{domain}-{when}", draft, None, prompts)
        out[domain][when] = m.tau
        out["tokens_per_s"][f"{domain}_{when}"] = m.tokens_per_s
        done = time.monotonic() - t0
        emit(
            f"  gate {i + 1}/{len(plan)}: {domain} {'champion' if when == 'before' else 'candidate'} "
            f"τ {m.tau:.3f}, {m.tokens_per_s:.1f} tok/s on {len(prompts)} prompts; ETA {done / (i + 1) * (len(plan) - i - 1):.0f}s"
        )
    if cfg.min_speedup is not None:
        plain = trial.measure("traffic-plain", None, None, traffic)
        out["tokens_per_s"]["traffic_plain"] = plain.tokens_per_s
    out["prompts"] = {"traffic": len(traffic), "control": len(trial.prompts)}
    return out


def decide(cfg: AdaptConfig, gate: dict[str, Any]) -> tuple[bool, str, dict[str, float]]:
    """Promote iff the shifted domain gains enough and the control does not regress (and, if asked, it is fast)."""
    t, c = gate["traffic"], gate["control"]
    numbers = {
        "traffic_tau_gain": t["after"] / t["before"] - 1.0 if t["before"] else 0.0,
        "control_tau_change": c["after"] / c["before"] - 1.0 if c["before"] else 0.0,
    }
    reasons = []
    if numbers["traffic_tau_gain"] < cfg.min_tau_gain:
        reasons.append(
            f"traffic τ {t['after']:.3f} vs champion {t['before']:.3f} ({numbers['traffic_tau_gain']:+.1%}); needs >= +{cfg.min_tau_gain:.0%}"
        )
    if numbers["control_tau_change"] < -cfg.max_control_regression:
        reasons.append(
            f"control τ {c['after']:.3f} vs champion {c['before']:.3f} ({numbers['control_tau_change']:+.1%}); may drop at most {cfg.max_control_regression:.0%}"
        )
    if cfg.min_speedup is not None:
        tps = gate["tokens_per_s"]
        numbers["traffic_speedup"] = tps["traffic_after"] / tps["traffic_plain"] if tps["traffic_plain"] else 0.0
        if numbers["traffic_speedup"] < cfg.min_speedup:
            reasons.append(f"candidate is {numbers['traffic_speedup']:.2f}x plain decoding; needs >= {cfg.min_speedup:.2f}x")
    if reasons:
        return False, "; ".join(reasons), numbers
    return (
        True,
        f"traffic τ {t['before']:.3f} -> {t['after']:.3f} ({numbers['traffic_tau_gain']:+.1%}), control τ "
        f"{c['before']:.3f} -> {c['after']:.3f} ({numbers['control_tau_change']:+.1%})",
        numbers,
    )


# ---------------------------------------------------------------------- [4/4] record
def record(cfg: AdaptConfig, d: Decision) -> None:
    """The decision as an MLflow run; on a train pass, tags on the candidate, the alias on 'promote', last.json."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient()
    exp = client.get_experiment_by_name(cfg.mlflow.experiment)
    run = client.create_run(
        exp.experiment_id,
        run_name=f"decision-{d.id}",
        tags={"eagleray.job": "adapt", "adapt.decision": d.id, "adapt.action": d.action, "adapt.reason": d.reason[:4000]},
    )
    params = {
        "capture_path": cfg.capture_path,
        "alias": cfg.alias,
        "min_new_requests": cfg.min_new_requests,
        "min_tau_gain": cfg.min_tau_gain,
        "max_control_regression": cfg.max_control_regression,
        "control": ",".join(cfg.control),
        "champion": d.champion,
        "candidate": d.candidate,
        **{f"window.{k}": v for k, v in d.window.items()},
    }
    now = int(time.time() * 1000)
    metrics = {**d.numbers, **{f"tau_{dom}_{w}": v for dom, ws in d.tau.items() for w, v in ws.items() if v is not None}}
    client.log_batch(
        run.info.run_id,
        params=[Param(k, str(v)[:500]) for k, v in params.items()],
        metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
    )
    client.set_terminated(run.info.run_id)
    d.run_id = run.info.run_id
    if d.action == "skip":
        return
    name, version = d.candidate.split(":/", 1)[1].split("/", 1)
    for k, v in {
        "adapt.decision": d.id,
        "adapt.action": d.action,
        "adapt.reason": d.reason[:4000],
        **{f"adapt.{k}": f"{v:.4f}" for k, v in metrics.items()},
    }.items():
        client.set_model_version_tag(name, version, k, v)
    if d.action == "promote":
        registry.set_alias(name, cfg.alias, version)
    capture_store.write_adapt_status(cfg.capture_path, {"at": time.time(), "promoted": d.action == "promote", **d.to_dict()})


# ---------------------------------------------------------------------- the pass
def adapt_once(cfg: AdaptConfig, emit: Emit = print, force: bool = False) -> Decision:
    from eagleray.platform.checkpoints.target import TargetSpec, resolve_target

    registry.configure(cfg.mlflow.tracking_uri, cfg.mlflow.experiment)
    name = cfg.mlflow.registered_model
    champ = registry.get_alias(name, cfg.alias)  # raises with the fix when there is no champion yet
    spec = TargetSpec.from_dir(resolve_target(cfg.target.model, cfg.target.dtype))
    champion_dir = registry.resolve_draft(champ.uri, spec, tracking_uri=cfg.mlflow.tracking_uri).path
    d = Decision(time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6], "skip", "", champion=champ.uri)
    work = Path(cfg.work_dir) / d.id
    t0 = time.monotonic()
    emit(f"[1/4] window: captured traffic under {cfg.capture_path}")
    window = window_step(cfg, work, spec.vocab_size, force)
    if isinstance(window, str):
        d.reason = window
        emit(f"  skip: {window}")
        record(cfg, d)
        return d
    d.window = {k: window.manifest[k] for k in ("rows", "loss_tokens", "shards", "window_first_ms", "window_last_ms")}
    d.window["new_requests"] = window.new_requests
    d.window["held_out"] = len(window.held_out)
    emit(f"  {window.manifest['rows']} requests ({window.new_requests} new), {len(window.held_out)} held out for the gate")
    emit(f"[2/4] train: fine-tune {champ.uri} on them ({time.monotonic() - t0:.0f}s so far)")
    d.candidate = train_step(cfg, window, champion_dir, champ.uri, d.id, emit)
    cand_dir = registry.resolve_draft(d.candidate, spec, tracking_uri=cfg.mlflow.tracking_uri).path
    emit(f"[3/4] gate: {champ.uri} vs {d.candidate} on held-out traffic and {cfg.control} ({time.monotonic() - t0:.0f}s so far)")
    gate = gate_step(cfg, champion_dir, cand_dir, window.held_out, emit)
    ok, d.reason, d.numbers = decide(cfg, gate)
    d.action = "promote" if ok else "reject"
    d.tau = {"traffic": gate["traffic"], "control": gate["control"]}
    record(cfg, d)
    emit(f"[4/4] {d.action.upper()}: {d.reason} (MLflow run {d.run_id}; {time.monotonic() - t0:.0f}s)")
    (work / "decision.json").write_text(json.dumps(d.to_dict(), indent=2))
    return d


def run(args: argparse.Namespace) -> int:
    cfg = load_yaml_config(AdaptConfig, args.config, args.set)
    while True:
        adapt_once(cfg, force=args.force)
        if cfg.every_s is None or args.once:
            return 0
        print(f"next pass in {cfg.every_s:.0f}s", flush=True)
        time.sleep(cfg.every_s)


if __name__ == "__main__":
    sys.exit(run_job("python -m eagleray.jobs.adapt", add_arguments, run))
