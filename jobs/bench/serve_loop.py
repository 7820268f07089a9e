"""``bench serve-loop``: the Serve engine replica's step loop under concurrent streaming clients, without Ray or HTTP.

What the engine deployment does for each request (``EngineServer.generate`` streams ``AsyncEngine.stream_batched``
over ``LLMEngine``), driven by ``--concurrency`` client coroutines that take prompts from one queue, as vLLM's load
generator does at a fixed max concurrency; the Serve app's ingress, proxy and HTTP are left out. For a machine
where Ray Serve is not installed (the lent H200 image); on a machine with Ray, ``bench serve`` loads the whole app.
One difference from the replica: the models are loaded here in the main thread and shared by both servers, where the
replica builds its engine in the thread that steps it (``AsyncEngine.build``); on a CPU that costs some prefills up
to ~3x (libgomp's second thread team, see :mod:`eagleray.serve.engine.async_engine`), so on CPU use ``bench serve``.
Two servers on the same prompts, one after the other: plain (no draft) and with a draft (adaptive policy). Greedy,
EOS ignored. Per server: output tok/s (tokens / wall), TTFT (request sent -> first token) and TPOT ((last token -
first token) / (tokens - 1)) median and p99, failed requests; ``lossless``: the draft server's outputs equal the
plain server's, request by request.

    python -m eagleray.jobs.bench serve-loop --concurrency 32 --num-prompts 160 --max-tokens 128 \\
        --draft shipped:smollm2-135m-instruct-eagle3-sharegpt --json OUT
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from eagleray.jobs.bench.common import log, print_rows, run_suite
from eagleray.platform.config.schemas import DraftConfig, PolicyConfig, TargetConfig
from eagleray.platform.errors import EaglerayError
from eagleray.platform.host import pick_device
from eagleray.platform.prompts import load_prompts
from eagleray.serve.engine import AsyncEngine, EngineConfig, LLMEngine, RequestFailed, SamplingParams, load_models


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="mtbench", help="prompt source (mtbench, humaneval or a file)")
    p.add_argument("--num-prompts", type=int, default=160, help="requests per server (prompts repeated to reach it)")
    p.add_argument("--concurrency", type=int, default=32, help="clients streaming at once (= engine.max_num_seqs)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (EOS ignored)")
    p.add_argument("--draft", default="random", help="the draft server's draft: a directory, shipped:NAME or random")
    p.add_argument("--k", type=int, default=4, help="the draft server's k_max")
    p.add_argument("--dtype", default=None, help="target dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="engine.kv_cache_gib (default: the engine's)")
    p.add_argument("--json", default=None, help="write the results here")


async def _client(loop: AsyncEngine, queue: asyncio.Queue, params: SamplingParams, out: dict) -> None:
    """Take (index, prompt ids) from ``queue`` until it is empty; stream each request as the engine replica does."""
    while not queue.empty():
        i, ids = queue.get_nowait()
        sent, first, last, tokens = time.perf_counter(), None, None, []
        try:
            async for outs in loop.stream_batched(ids, params, f"r{i}"):
                now = time.perf_counter()
                first = now if first is None else first
                last, tokens = now, outs[-1].token_ids
        except RequestFailed as err:
            out[i] = {"failed": str(err)}
            continue
        out[i] = {"ttft": first - sent, "tpot": (last - first) / max(len(tokens) - 1, 1), "tokens": list(tokens)}


async def _serve(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict:
    """All ``prompts`` through one AsyncEngine with ``concurrency`` clients -> per-request results and wall seconds."""
    loop = AsyncEngine(engine)
    try:
        warm = asyncio.Queue()
        for i, ids in enumerate(prompts[:concurrency]):  # graphs captured, kernels compiled: not in the timing
            warm.put_nowait((i, ids))
        await asyncio.gather(*(_client(loop, warm, params.model_copy(update={"max_tokens": 4}), {}) for _ in range(concurrency)))
        engine.metrics = type(engine.metrics)()
        queue, results = asyncio.Queue(), {}
        for i, ids in enumerate(prompts):
            queue.put_nowait((i, ids))
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(loop, queue, params, results) for _ in range(concurrency)))
        return {"results": results, "seconds": time.perf_counter() - t0}
    finally:
        loop.shutdown()


def _summary(name: str, run: dict, engine: LLMEngine) -> dict:
    ok = [r for r in run["results"].values() if "failed" not in r]
    ttft = sorted(1e3 * r["ttft"] for r in ok)
    tpot = sorted(1e3 * r["tpot"] for r in ok)
    tokens = sum(len(r["tokens"]) for r in ok)

    def p99(xs: list[float]) -> float | None:
        return round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 2) if xs else None

    spec = engine.metrics.spec
    return {
        "server": name,
        "completed": len(ok),
        "failed": len(run["results"]) - len(ok),
        "output_tok_s": round(tokens / run["seconds"], 2),
        "median_ttft_ms": round(statistics.median(ttft), 2) if ttft else None,
        "p99_ttft_ms": p99(ttft),
        "median_tpot_ms": round(statistics.median(tpot), 3) if tpot else None,
        "p99_tpot_ms": p99(tpot),
        "seconds": round(run["seconds"], 3),
        "tokens": tokens,
        "tau": round(spec.mean_acceptance_length, 3) if spec.num_drafts else None,
        "spec_steps": engine.metrics.speculative.steps,
        "plain_steps": engine.metrics.plain.steps,
    }


def measure(args: argparse.Namespace) -> dict:
    device = pick_device()
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    records = [r.to_dict() for r in load_prompts(args.prompts)]
    if not records or args.num_prompts < 1 or args.concurrency < 1:
        raise EaglerayError(
            f"--prompts {args.prompts!r}, --num-prompts {args.num_prompts}, --concurrency {args.concurrency}: "
            "nothing to send\n    fix: a prompt source with prompts, and counts >= 1"
        )
    tcfg = TargetConfig(model="smollm2", dtype=dtype, device=device.type, max_model_len=2048)
    dcfg = DraftConfig(source=args.draft, num_speculative_tokens=args.k, policy=PolicyConfig(adaptive=True))
    target, draft, tok, _ = load_models(tcfg, dcfg)
    extra = {} if args.kv_cache_gib is None else {"kv_cache_gib": args.kv_cache_gib}
    cfg = EngineConfig(target=tcfg, max_num_seqs=args.concurrency, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    servers, outputs, prompts = [], {}, None
    for name in ("plain", "draft"):
        aux = target.aux_layer_ids
        if name == "plain":
            target.set_aux_layers([])  # a server without a draft captures nothing
        try:
            engine = (
                LLMEngine(target, tok, cfg)
                if name == "plain"
                else LLMEngine(target, tok, cfg.model_copy(update={"draft": dcfg}), draft)
            )
            if prompts is None:
                prompts = [engine.tokenize(r["messages"]) for r in records]
                prompts = (prompts * -(-args.num_prompts // len(prompts)))[: args.num_prompts]
            run = asyncio.run(_serve(engine, prompts, params, args.concurrency))
        finally:
            target.set_aux_layers(aux)
        servers.append(_summary(name, run, engine))
        outputs[name] = run["results"]
        del engine
        log(f"serve-loop {name}: {servers[-1]['output_tok_s']} tok/s, median TTFT {servers[-1]['median_ttft_ms']} ms")
    same = [outputs["plain"][i].get("tokens") == outputs["draft"][i].get("tokens") for i in range(len(prompts))]
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "path": "AsyncEngine (the Serve engine replica's loop), no Ray, no HTTP",
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "draft": args.draft,
        "k": args.k,
        "servers": servers,
        "draft_vs_plain": round(servers[1]["output_tok_s"] / servers[0]["output_tok_s"], 3),
        "lossless": all(same),
    }


COLUMNS = [
    ("server", "<7"),
    ("done", ">5"),
    ("failed", ">7"),
    ("tok/s", ">10"),
    ("TTFT med", ">10"),
    ("TTFT p99", ">10"),
    ("TPOT med", ">10"),
    ("TPOT p99", ">10"),
    ("tau", ">6"),
]
KEYS = ("server", "completed", "failed", "output_tok_s", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "tau")


def print_table(result: dict) -> None:
    print_rows(COLUMNS, ([s.get(k) for k in KEYS] for s in result["servers"]))
    print(f"draft / plain output tok/s: {result['draft_vs_plain']}x; outputs equal: {result['lossless']}")


def run(args: argparse.Namespace | list[str] | None = None) -> dict:
    return run_suite(args, "eagleray bench serve-loop", __doc__, add_arguments, measure, print_table)
