"""Scale check of datagen on CPU: 83,288 prompt records through the full pipeline with a tiny target.

``python -m eagleray.jobs.bench.datagen_scale --workdir DIR [--records 83288] [--json docs/bench/datagen-scale-cpu.json]``

Input: ShareGPT prompt turns (unique by content) topped up to ``--records`` with marked repeats
("[repeat k] " + the user text, so each repeat is its own prompt id). Target: a tiny random Llama
(hidden 32, 4 layers) with 8-token answers, so the run measures the pipeline (Ray Data stages,
tokenization, shard writes, resume bookkeeping), not a model. Writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from pathlib import Path

import psutil


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", required=True, help="where the input, tiny target and output go")
    p.add_argument("--records", type=int, default=83288, help="prompt records to run")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance")
    p.add_argument("--json", default=None, help="write the numbers here")


def build_input(path: Path, records: int) -> dict:
    """Write the prompt JSONL; returns how many records are unique ShareGPT turns and repeats."""
    from eagleray.platform.prompts import iter_prompts, prompt_turns

    seen, turns = set(), []
    for rec in iter_prompts("sharegpt"):
        for t in prompt_turns(rec):
            if t.prompt_id not in seen:
                seen.add(t.prompt_id)
                turns.append([m.to_dict() for m in t.messages])
    with path.open("w") as f:
        for i in range(records):
            msgs = turns[i % len(turns)]
            if i >= len(turns):
                last = {**msgs[-1], "content": f"[repeat {i // len(turns)}] {msgs[-1]['content']}"}
                msgs = [*msgs[:-1], last]
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
    return {
        "sharegpt_unique_turns": len(turns),
        "records": records,
        "unique_content": min(records, len(turns)),
        "repeats": max(0, records - len(turns)),
    }


class PeakRSS(threading.Thread):
    """Samples the RSS of this process and all its children (Ray's raylet and workers) every second."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = 0, threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.wait(1.0):
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:  # a worker exited between listing and reading; skip it
                    continue
            self.peak = max(self.peak, total)


def run(args: argparse.Namespace) -> int:
    import ray

    from eagleray.datagen.pipeline import run_datagen
    from eagleray.platform.config.schemas import DatagenConfig
    from eagleray.tests.support.tiny import make_tiny_llama

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    counts = build_input(work / "prompts.jsonl", args.records)
    target = make_tiny_llama(
        work / "tiny", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=1024
    )
    cfg = DatagenConfig(
        prompts=[str(work / "prompts.jsonl")],
        output_dir=str(work / "out"),
        backend="transformers",
        target={"model": str(target), "dtype": "fp32", "device": "cpu"},
        hold_out_eval=True,
        generation={"max_tokens": 8},
        max_seq_len=512,
        rows_per_shard=1024,
        batch_size=64,
        num_workers=1,
        cpus_per_worker=1,
        progress_seconds=30,
    )
    ray.init(address="local", num_cpus=args.num_cpus, object_store_memory=500 * 1024**2, include_dashboard=False)
    mon = PeakRSS()
    mon.start()
    t0 = time.perf_counter()
    manifest = run_datagen(cfg, emit=lambda s: print(s, flush=True))
    wall = time.perf_counter() - t0
    mon.stop.set()
    ray.shutdown()
    run_ = manifest["run"]
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {psutil.cpu_count()} cores (shared)",
        "command": f"python -m eagleray.jobs.bench.datagen_scale --workdir {args.workdir} --records {args.records}",
        "input": counts,
        "target": "tiny random Llama hidden 32, 4 layers, vocab 384",
        "max_tokens": 8,
        "rows_written": manifest["rows"],
        "errors": manifest["errors"],
        "shards": manifest["shards"],
        "tokens": manifest["tokens"],
        "bytes": manifest["bytes"],
        "wall_s": round(wall, 1),
        "pipeline_s": round(run_["seconds"], 1),
        "rows_per_s": round((run_["rows"] + run_["errors"]) / run_["seconds"], 1),
        "tokens_per_s": round(run_["tokens"] / run_["seconds"], 1),
        "peak_rss_bytes": mon.peak,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m eagleray.jobs.bench.datagen_scale")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
