"""Run settings a rerun must match (run.json), and the manifest + vocab counts + errors table at the end."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagleray.datagen import shards
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.errors import DataError, EaglerayError
from eagleray.platform.shard_format import MANIFEST, VOCAB_COUNTS, ids_and_mask, read_vocab_counts  # noqa: F401  (re-exported)

RUN, ERRORS_TABLE = "run.json", "errors.parquet"
FORMAT_VERSION = 1


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def compat_settings(cfg: DatagenConfig, target_fp: str, tokenizer_fp: str, aux_ids: list[int]) -> dict[str, Any]:
    """What decides the content of a row: rows written under other settings must not be mixed in."""
    return {
        "format": FORMAT_VERSION,
        "target_fingerprint": target_fp,
        "tokenizer_fingerprint": tokenizer_fp,
        "target_dtype": cfg.target.dtype,
        "aux_layer_ids": aux_ids,
        "backend": cfg.backend,
        "generation": cfg.generation.model_dump(),
        "max_seq_len": cfg.max_seq_len,
    }


def config_hash(cfg: DatagenConfig) -> str:
    """Hash of the whole config except how it runs (workers, batch sizes, progress, testing hooks)."""
    skip = {
        "num_workers",
        "cpus_per_worker",
        "gpus_per_worker",
        "batch_size",
        "forward_tokens",
        "progress_seconds",
        "est_tokens_per_second",
        "disk_headroom",
        "ray_address",
        "testing",
        "retry_failed",
        "prefer_resource",
    }
    return _sha(cfg.model_dump(exclude=skip))


def check_or_write_run(output_dir: str, settings: dict[str, Any], write: bool = True) -> str:
    """Write run.json (when ``write``), or check that an existing one has the same settings. Returns the compat hash."""
    path = Path(output_dir) / RUN
    compat = _sha(settings)
    if path.is_file():
        old = json.loads(path.read_text())
        if old.get("compat_hash") != compat:
            diff = sorted(k for k in settings if old.get("settings", {}).get(k) != settings[k])
            raise EaglerayError(
                f"{output_dir} holds data generated with other settings (differs in: {', '.join(diff)})\n"
                f"    fix: use a new output_dir, or restore the settings of run.json to resume"
            )
        return compat
    if not write:
        return compat
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_text(path, json.dumps({"compat_hash": compat, "settings": settings}, indent=2))
    return compat


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)


def scan_shards(output_dir: str, vocab_size: int) -> dict[str, Any]:
    """Rows, tokens, bytes, token counts over loss-masked tokens, and duplicate ids of all shards."""
    counts = np.zeros(vocab_size, dtype=np.int64)  # [V]
    seen: dict[str, str] = {}
    dups: list[tuple[str, str, str]] = []
    rows = tokens = loss_tokens = nbytes = 0
    files = shards.shard_files(output_dir)
    for p in files:
        t = pq.read_table(p, columns=["prompt_id", "input_ids", "loss_mask"])
        ids, mask = ids_and_mask(t)  # [sum T] each
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
        for pid in t.column("prompt_id").to_pylist():
            if pid in seen:
                dups.append((pid, seen[pid], p.name))
            seen[pid] = p.name
        rows += t.num_rows
        tokens += int(ids.size)
        loss_tokens += int(mask.sum())
        nbytes += p.stat().st_size
    return {
        "rows": rows,
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "bytes": nbytes,
        "shards": len(files),
        "counts": counts,
        "ids": set(seen),
        "duplicates": dups,
    }


def write_errors_table(output_dir: str) -> int:
    errors = shards.read_errors(output_dir)
    cols = {k: pa.array([e[k] for e in errors], pa.string()) for k in shards.ERROR_FIELDS}
    pq.write_table(pa.table(cols), Path(output_dir) / ERRORS_TABLE)
    return len(errors)


def finalize(
    output_dir: str,
    cfg: DatagenConfig,
    settings: dict[str, Any],
    compat: str,
    vocab_size: int,
    hidden_size: int,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Scan every shard, write vocab_counts.npy, errors.parquet and manifest.json; return the manifest.

    ``provenance``: facts about where the answers came from that do not decide row content
    (backend 'given': the regeneration manifests of its sources), kept in the manifest as is.
    """
    shards.remove_tmp_files(output_dir)
    scan = scan_shards(output_dir, vocab_size)
    if scan["duplicates"]:
        pid, a, b = scan["duplicates"][0]
        raise DataError(
            f"{len(scan['duplicates'])} prompt id(s) occur in two shards (e.g. {pid} in {a} and {b})\n"
            f"    fix: delete the newer of each pair of shards and rerun (it resumes)"
        )
    np.save(Path(output_dir) / VOCAB_COUNTS, scan["counts"])
    n_errors = write_errors_table(output_dir)
    manifest = {
        **settings,
        "compat_hash": compat,
        "config_hash": config_hash(cfg),
        "dataset_id": _sha([compat, sorted(scan["ids"])]),
        "hidden_size": hidden_size,
        "num_aux_layers": len(settings["aux_layer_ids"]),
        "dtype": "bf16",
        "encoding": "aux_hidden/final_hidden: large_binary of little-endian bf16, row-major [T, n_aux*H] / [T, H]; "
        "final_hidden is after the target's final norm (apply lm_head only)",
        "rows": scan["rows"],
        "tokens": scan["tokens"],
        "loss_tokens": scan["loss_tokens"],
        "bytes": scan["bytes"],
        "shards": scan["shards"],
        "errors": n_errors,
        "vocab_size": vocab_size,
        "vocab_counts": VOCAB_COUNTS,
        "errors_table": ERRORS_TABLE,
        "prompts": cfg.prompts,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(provenance or {}),
    }
    _atomic_text(Path(output_dir) / MANIFEST, json.dumps(manifest, indent=2))
    return manifest
