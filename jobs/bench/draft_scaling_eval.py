"""The evaluation stage of the data-scaling run (:mod:`eagleray.jobs.bench.draft_scaling`): plain baselines once,
then each draft in its own process with ``LLMEngine`` (τ on MT-bench and HumanEval, lossless, the batch-1 speedup;
the tree and T=1 for the largest draft)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from eagleray.jobs.bench.draft_scaling import _draft_dir, _fractions, _shared_options, _write, log


def _eval_setup(args: argparse.Namespace):
    from eagleray.platform.config.schemas import TargetConfig
    from eagleray.platform.prompts import load_prompts
    from eagleray.serve.engine import SamplingParams

    mt_src, he_src = args.eval_prompts.split(",")
    suites = {
        "mtbench": [r.to_dict()["messages"] for r in load_prompts(mt_src)],
        "humaneval": [r.to_dict()["messages"] for r in load_prompts(he_src)],
    }
    tcfg = TargetConfig(model=args.target, dtype=args.dtype, device=args.device, max_model_len=args.eval_max_model_len)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.eval_max_tokens)
    sampled = SamplingParams(temperature=1.0, max_tokens=args.eval_max_tokens, seed=0)
    return suites, tcfg, greedy, sampled


def evaluate(args: argparse.Namespace) -> list[dict]:
    """Plain baselines once (saved), then each draft in its own process (a CUDA failure costs that draft only:
    it is measured again with ``engine.decode_path: varlen``, and the record says so)."""
    import pickle

    from eagleray.serve.engine import EngineConfig, close_target, load_models
    from eagleray.serve.measure import plain_run

    suites, tcfg, greedy, sampled = _eval_setup(args)
    baselines = args.work / "plain.pkl"
    if not baselines.is_file():
        target, _, tok, _ = load_models(tcfg, None)
        plain = {}  # (suite, batch, sampled) -> (token prompts, outputs, seconds)
        for suite, b, smp in (("mtbench", 8, False), ("mtbench", 1, False), ("humaneval", 8, False), ("mtbench", 8, True)):
            run_cfg = EngineConfig(target=tcfg, max_num_seqs=b, kv_cache_gib=8.0)
            tp, outs, sec, _ = plain_run(target, tok, run_cfg, suites[suite], sampled if smp else greedy)
            plain[(suite, b, smp)] = (tp, outs, sec)
            log(f"eval plain {suite} b{b}{' T=1' if smp else ''}: {sum(len(o.token_ids) for o in outs) / sec:.0f} tok/s")
        close_target(target)
        baselines.write_bytes(pickle.dumps(plain))
    records = []
    for f in _fractions(args):
        out = args.work / f"eval-{f:g}.json"
        if out.is_file():  # measured by an earlier `eval` of this run (a resumed run measures only what is missing)
            records.append(json.loads(out.read_text()))
        elif (_draft_dir(args, f) / "final-draft").is_dir():
            records += _measure(args, f, out)
        _write(args.work / "scaling.json", records)
    return records


def _measure(args: argparse.Namespace, f: float, out) -> list[dict]:
    """One draft in its own process: the row path, then (after a failure) the eager varlen path."""
    for path in ("auto", "varlen"):
        cmd = [sys.executable, "-m", "eagleray.jobs.bench.draft_scaling", "eval-one", "--fraction", str(f)]
        cmd += ["--decode-path", path] + _shared_options(args) + (["--tree"] if f == max(_fractions(args)) else [])
        with open(args.work / f"eval-{f:g}-{path}.log", "w") as log_file:
            code = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT).returncode
        if code == 0:
            return [json.loads(out.read_text())]
        log(f"eval {f:g}: decode_path {path} failed (exit {code}; eval-{f:g}-{path}.log)")
    return []


def evaluate_one(args: argparse.Namespace) -> dict:
    import pickle

    from eagleray.platform.config.schemas import DraftConfig, PolicyConfig, TreeConfig
    from eagleray.serve.engine import EngineConfig, load_models
    from eagleray.serve.measure import spec_run

    suites, tcfg, greedy, sampled = _eval_setup(args)
    plain = pickle.loads((args.work / "plain.pkl").read_bytes())
    f, src = args.fraction, _draft_dir(args, args.fraction) / "final-draft"
    chain = DraftConfig(source=str(src), num_speculative_tokens=args.k, policy=PolicyConfig(adaptive=False))
    target, draft, tok, _ = load_models(tcfg, chain)

    def spec(suite: str, b: int, smp: bool, dcfg=chain) -> dict:
        tp, outs, sec = plain[(suite, b, smp)]
        params = sampled if smp else greedy
        cfg = EngineConfig(target=tcfg, draft=dcfg, max_num_seqs=b, kv_cache_gib=8.0, decode_path=args.decode_path)
        return spec_run(target, draft, tok, cfg, tp, params, outs, sec)

    rec = {"data_fraction": f, "decode_path": args.decode_path, **_train_facts(args, f)}
    rec.update({k: v for k, v in (("init_from", args.init_from), ("extra_prompts", args.extra_prompts)) if v})
    rec.update(dict.fromkeys(("speedup_h200_b1", "lossless_b1", "spec_tok_s_b1", "plain_tok_s_b1", "tau_mtbench_b1")))
    if args.b1 == "all" or args.tree:  # first: the number the run is for (--b1 largest: the largest draft only)
        r = spec("mtbench", 1, False)
        rec.update(speedup_h200_b1=r["speedup"], lossless_b1=r["lossless"], spec_tok_s_b1=r["spec"]["tokens_per_s"])
        rec.update(plain_tok_s_b1=r["plain"]["tokens_per_s"], tau_mtbench_b1=r["tau"])
    for suite in suites:
        r = spec(suite, 8, False)
        rec[f"tau_{suite}_chain"], rec[f"lossless_{suite}_chain"] = r["tau"], r["lossless"]
        rec[f"acceptance_{suite}_chain"] = r["acceptance_per_pos"]
    rec["lossless"] = bool(rec["lossless_mtbench_chain"] and rec["lossless_humaneval_chain"] and rec["lossless_b1"] is not False)
    rec["tau_mtbench_chain_t1"] = rec["tau_mtbench_tree"] = rec["lossless_mtbench_tree"] = None
    if args.tree:  # the largest draft only: the tree verifies on the eager path (slow)
        rec["tau_mtbench_chain_t1"] = spec("mtbench", 8, True)["tau"]
        tree = DraftConfig(source=str(src), tree=TreeConfig(), policy=PolicyConfig(adaptive=False))
        r = spec("mtbench", 8, False, tree)
        rec["tau_mtbench_tree"], rec["lossless_mtbench_tree"], rec["tree"] = r["tau"], r["lossless"], TreeConfig().model_dump()
    _write(args.work / f"eval-{f:g}.json", rec)
    log(
        f"eval {f:g}: τ MT-bench {rec['tau_mtbench_chain']} (tree {rec['tau_mtbench_tree']}, T=1 {rec['tau_mtbench_chain_t1']}), "
        f"HumanEval {rec['tau_humaneval_chain']}, b1 speedup {rec['speedup_h200_b1']}x, lossless {rec['lossless']}"
    )
    return rec


def _loss_tokens(args) -> dict:
    path = args.work / "loss_tokens.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _train_facts(args, f: float) -> dict:
    path = _draft_dir(args, f) / "train.json"
    if not path.is_file():
        return {}
    t = json.loads(path.read_text())
    m = t.get("metrics", {})
    return {
        "conversations": t.get("conversations"),
        "steps": t.get("steps"),
        "train_s": t.get("train_s"),
        "sim_tau_heldout": m.get("eval/sim_tau"),
        "loss_tokens": _loss_tokens(args).get(f"{f:g}"),
        "train_tokens_per_s": m.get("tokens_per_s"),
        **({"given": t["given"]} if "given" in t else {}),
    }


# ----------------------------------------------------------------------------------------------- shared
