"""The datagen run: prompts -> resume filter -> estimate -> Ray Data stages -> manifest.

Fault tolerance: each chunk is one shard named by its content (chunks.chunk_id_for) and written
atomically, the model stages are restartable actors whose tasks are retried (a killed worker's
chunk is redone and rewrites the same file), and a rerun skips every prompt id already in a shard
or in the errors table, so a killed driver resumes without redoing finished shards.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagleray.datagen import manifest as mf
from eagleray.datagen import shards
from eagleray.datagen.answers_only import check_given_sources
from eagleray.datagen.chunks import make_chunks, select_prompts
from eagleray.datagen.estimate import check_space, estimate, human_bytes, human_seconds
from eagleray.platform.checkpoints.target import TargetSpec, resolve_target
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.errors import EaglerayError

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Running totals of finished chunks; prints a line every ``every`` seconds."""

    total_rows: int
    every: float
    emit: Callable[[str], None]
    started: float = field(default_factory=time.perf_counter)
    last: float = field(default_factory=time.perf_counter)
    rows: int = 0
    errors: int = 0
    tokens: int = 0
    bytes: int = 0
    chunks: int = 0

    def add(self, summary: dict[str, Any]) -> None:
        self.chunks += 1
        self.rows += summary["rows"]
        self.errors += summary["errors"]
        self.tokens += summary["tokens"]
        self.bytes += summary["bytes"]
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self.emit(self.line())

    def line(self) -> str:
        el = max(1e-9, time.perf_counter() - self.started)
        done = self.rows + self.errors
        rate = done / el
        eta = (self.total_rows - done) / rate if rate > 0 else float("inf")
        eta_s = human_seconds(eta) if eta != float("inf") else "?"
        return (
            f"progress: {done}/{self.total_rows} prompts ({self.errors} errors), {rate:.2f} rows/s, "
            f"{self.tokens / el:.0f} tokens/s, {human_bytes(self.bytes)} written, ETA {eta_s}"
        )


def ray_address(cfg: DatagenConfig) -> tuple[str, str]:
    """(address, where it came from): ``ray_address``, else RAY_ADDRESS, else ``local`` (a private instance).

    Never Ray's own default (``None``/``auto``), which joins whatever cluster /tmp/ray's address file
    names, even one whose processes are long gone.
    """
    if cfg.ray_address:
        return cfg.ray_address, "ray_address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return "local", "default"


def check_reachable(address: str, source: str, timeout_s: float = 5.0) -> None:
    """A ``host:port`` (or ``ray://host:port``) cluster address must accept connections (ray.init would hang for minutes)."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if address in ("local", "auto") or not host or not port.isdigit() or "/" in hostport:
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise EaglerayError(
            f"{source}: the Ray cluster at {address} does not answer ({err.strerror or err})\n"
            f"    fix: start it (ray start --head) or point {source} at a live cluster; unset ray_address "
            f"and RAY_ADDRESS to run on a private local instance"
        ) from None


def _ray_init(cfg: DatagenConfig, emit: Callable[[str], None] = print) -> None:
    import ray

    if ray.is_initialized():
        return
    address, source = ray_address(cfg)
    check_reachable(address, source)
    ray.init(address=address, log_to_driver=True)
    if address != "local":
        res = ray.cluster_resources()
        emit(
            f"ray: joined the cluster at {address} (from {source}): {len(ray.nodes())} node(s), "
            f"{res.get('CPU', 0):.0f} CPUs, {res.get('GPU', 0):.0f} GPUs"
        )


def _model_stage_args(cfg: DatagenConfig) -> dict[str, Any]:
    import ray.data

    # Ray Data gives actor-pool workers max_restarts=-1 and max_task_retries=-1 by default (Ray 2.60,
    # actor_pool_map_operator.py): a killed worker is restarted and its chunk redone. The
    # killed-worker test (tests/unit/datagen/test_pipeline.py) guards that default.
    args = {
        "batch_size": 1,
        "batch_format": "pyarrow",
        "compute": ray.data.ActorPoolStrategy(size=cfg.num_workers),
        "num_cpus": cfg.cpus_per_worker,
        "num_gpus": cfg.gpus_per_worker or None,
    }
    if cfg.prefer_resource:
        args["scheduling_strategy"] = preferred_node(cfg.prefer_resource)
    return args


def preferred_node(resource: str):
    """Soft node affinity to the first alive node with ``resource`` (a lost node's actors restart elsewhere)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    having = [n for n in nodes if resource in n.get("Resources", {})]
    if not having:
        known = sorted({r for n in nodes for r in n.get("Resources", {}) if not r.startswith("node:")})
        raise EaglerayError(
            f"prefer_resource: no alive node of the cluster has the resource {resource!r} "
            f"(the {len(nodes)} alive node(s) have {known})\n"
            f"    fix: start a node with `ray start --resources '{{\"{resource}\": 1}}'` or unset prefer_resource"
        )
    return NodeAffinitySchedulingStrategy(having[0]["NodeID"], soft=True)


def build_dataset(cfg: DatagenConfig, chunks: list[dict], model_dir: str, meta: dict[str, str]):
    """The Ray Data pipeline over chunk rows; yields one summary row per chunk."""
    import ray

    from eagleray.datagen.stages import ExtractStage, GivenAnswersStage, RegenerateStage

    cfg_json = cfg.model_dump_json()
    ds = ray.data.from_items(chunks, override_num_blocks=len(chunks))
    if cfg.backend == "vllm":
        from eagleray.datagen.vllm_stage import regenerate_with_vllm

        ds = regenerate_with_vllm(ds, cfg, model_dir)
    elif cfg.backend == "given":
        import ray.data

        # One tokenizer-only actor with no CPU reserved: the hidden-state actors keep every core.
        ds = ds.map_batches(
            GivenAnswersStage,
            fn_constructor_args=(cfg_json,),
            batch_size=1,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=0,
        )
    else:
        ds = ds.map_batches(RegenerateStage, fn_constructor_args=(cfg_json,), **_model_stage_args(cfg))
    return ds.map_batches(ExtractStage, fn_constructor_args=(cfg_json, json.dumps(meta)), **_model_stage_args(cfg))


def _done_ids(cfg: DatagenConfig, clean: bool) -> set[str]:
    """Prompt ids a rerun skips: rows in shards, and failed rows unless retry_failed."""
    out = cfg.output_dir
    if not clean:
        skip = set() if cfg.retry_failed else {e["prompt_id"] for e in shards.read_errors(out)}
        return set(shards.written_ids(out)) | skip
    removed = shards.remove_tmp_files(out)
    if removed:
        log.info("removed %d half-written files from an interrupted run", removed)
    if cfg.retry_failed:
        for p in (Path(out) / shards.ERRORS_DIR).glob("part-*.jsonl"):
            p.unlink()
    return set(shards.written_ids(out)) | {e["prompt_id"] for e in shards.read_errors(out)}


@dataclass
class Plan:
    """Everything decided before the Ray pipeline starts."""

    model_dir: str
    spec: TargetSpec
    aux_ids: list[int]
    settings: dict[str, Any]
    compat: str
    todo: list  # [PromptRecord] still to run, in run order
    estimate: Any
    provenance: dict[str, Any]  # kept in the manifest (backend 'given': where the answers came from)


def plan(cfg: DatagenConfig, emit: Callable[[str], None], write: bool = True) -> Plan:
    """Resolve the target, check/record run.json, select prompts, drop done ones, estimate, check space."""
    from transformers import AutoTokenizer

    model_dir = str(resolve_target(cfg.target.model, cfg.target.dtype))
    spec = TargetSpec.from_dir(model_dir)
    aux_ids = sorted(set(cfg.aux_layer_ids if cfg.aux_layer_ids is not None else spec.default_aux_layer_ids))
    bad = [i for i in aux_ids if not 0 <= i <= spec.num_layers]
    if bad:
        raise EaglerayError(f"aux_layer_ids: {bad} outside [0, {spec.num_layers}]\n    fix: use ids of the target's layers")
    given = check_given_sources(cfg, spec, emit) if cfg.backend == "given" else None
    settings = mf.compat_settings(cfg, spec.fingerprint, spec.tokenizer_fingerprint, aux_ids)
    compat = mf.check_or_write_run(cfg.output_dir, settings, write=write)
    records, pstats = select_prompts(cfg)
    done = _done_ids(cfg, clean=write)
    todo = [r for r in records if r.prompt_id not in done]
    emit(
        f"prompts: {pstats.records} conversations -> {pstats.turns} turns, {pstats.duplicates} duplicates, "
        f"{pstats.held_out} held out (MT-bench/HumanEval), {pstats.kept} selected; "
        f"{len(records) - len(todo)} already done, {len(todo)} to run"
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    device = "cuda" if cfg.gpus_per_worker > 0 else "cpu"
    est = estimate(cfg, spec, tok, [[m.to_dict() for m in r.messages] for r in todo], len(aux_ids), device)
    for line in est.lines():
        emit(line)
    check_space(est, cfg.output_dir)
    return Plan(model_dir, spec, aux_ids, settings, compat, todo, est, {"given_answers": given} if given is not None else {})


def dry_run(cfg: DatagenConfig, emit: Callable[[str], None] = print) -> Plan:
    """Print the prompt counts and the estimate; write nothing."""
    return plan(cfg, emit, write=False)


def run_datagen(cfg: DatagenConfig, emit: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) a datagen job; returns the manifest. ``emit`` prints the progress lines."""
    p = plan(cfg, emit)
    started = time.perf_counter()
    progress = Progress(len(p.todo), cfg.progress_seconds, emit)
    if p.todo:
        meta = {
            "compat_hash": p.compat,
            "aux_layer_ids": json.dumps(p.aux_ids),
            "target_fingerprint": p.spec.fingerprint,
            "tokenizer_fingerprint": p.spec.tokenizer_fingerprint,
            "hidden_size": str(p.spec.hidden_size),
            "encoding": "bf16-le-rowmajor",
        }
        _ray_init(cfg, emit)
        ds = build_dataset(cfg, make_chunks(p.todo, cfg.rows_per_shard, p.compat), p.model_dir, meta)
        for summary in ds.iter_rows():
            progress.add(summary)
        emit(progress.line())
    manifest = mf.finalize(cfg.output_dir, cfg, p.settings, p.compat, p.spec.vocab_size, p.spec.hidden_size, p.provenance)
    manifest["run"] = {
        "seconds": time.perf_counter() - started,
        "rows": progress.rows,
        "errors": progress.errors,
        "tokens": progress.tokens,
        "chunks": progress.chunks,
        "estimate": json.loads(p.estimate.to_json()),
    }
    emit(summary_table(manifest))
    return manifest


def summary_table(m: dict[str, Any]) -> str:
    run = m.get("run", {})
    secs = run.get("seconds", 0.0) or 1e-9
    rows = [
        ("rows (total)", m["rows"]),
        ("errors (total)", m["errors"]),
        ("shards", m["shards"]),
        ("tokens", m["tokens"]),
        ("loss tokens", m["loss_tokens"]),
        ("bytes", human_bytes(m["bytes"])),
        ("this run: rows", run.get("rows", 0)),
        ("this run: seconds", f"{secs:.1f}"),
        ("this run: rows/s", f"{run.get('rows', 0) / secs:.2f}"),
        ("this run: tokens/s", f"{run.get('tokens', 0) / secs:.0f}"),
        ("aux layers", m["aux_layer_ids"]),
        ("dataset id", m["dataset_id"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["datagen summary", "-" * (width + 24)] + [f"{k:<{width}}  {v}" for k, v in rows])
