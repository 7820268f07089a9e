"""Measuring drafts with the engine: plain vs speculative decoding of the same prompts on one target.

Used by training (``evaluate_with_engine``: :func:`measure_draft`), promotion
(:class:`eagleray.serve.promotion.DraftTrial`) and the benchmarks (``eagleray bench spec|scaling|vllm``).
"""

from __future__ import annotations

import time

from eagleray.platform.config.schemas import DraftConfig, PolicyConfig, TargetConfig
from eagleray.platform.errors import EaglerayError
from eagleray.platform.prompts import load_prompts
from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams, bucket, close_target, load_models


def timed_generate(engine: LLMEngine, prompts, params: SamplingParams) -> tuple[list, float]:
    """Warm up, reset the counters, then time ``engine.generate`` of all the prompts."""
    # warm-up: on CUDA a full batch, so the timed run's prefill shapes have their kernels chosen already
    n = engine.config.max_num_seqs if engine.device.type == "cuda" else 1
    engine.generate(prompts[:n], params.model_copy(update={"max_tokens": 4}))
    engine.metrics = type(engine.metrics)()  # counters (τ, acceptance) cover the timed run only
    engine.prof.reset()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t0


def plain_run(target, tok, cfg: EngineConfig, prompts: list, params: SamplingParams):
    """Plain decoding of ``prompts`` (messages or token ids) with the engine settings ``cfg`` (its draft unused)
    -> (token prompts, outputs, seconds, engine); the target captures nothing. ``cfg.profile_steps``: time each
    step's phases (on CUDA a sync per phase)."""
    aux_ids = target.aux_layer_ids
    target.set_aux_layers([])
    try:
        engine = LLMEngine(target, tok, cfg.model_copy(update={"draft": None}))
        token_prompts = [engine.tokenize(m) for m in prompts]
        outs, seconds = timed_generate(engine, token_prompts, params)
    finally:
        target.set_aux_layers(aux_ids)
    return token_prompts, outs, seconds, engine


def spec_run(
    target, draft, tok, cfg: EngineConfig, token_prompts: list, params: SamplingParams, plain: list, t_plain: float
) -> dict:
    """Speculative decoding (draft ``cfg.draft``) of the same token prompts, compared with the plain run (outputs and speed)."""
    engine = LLMEngine(target, tok, cfg, draft)
    spec, t_spec = timed_generate(engine, token_prompts, params)
    stats = engine.metrics.spec
    n_plain, n_spec = sum(len(o.token_ids) for o in plain), sum(len(o.token_ids) for o in spec)
    return {
        "plain": {"tokens": n_plain, "seconds": round(t_plain, 3), "tokens_per_s": round(n_plain / t_plain, 2)},
        "spec": {"tokens": n_spec, "seconds": round(t_spec, 3), "tokens_per_s": round(n_spec / t_spec, 2), **stats.to_dict()},
        "speedup": round((n_spec / t_spec) / (n_plain / t_plain), 3),
        "tau": round(stats.mean_acceptance_length, 3),
        "acceptance_per_pos": [round(a / max(stats.num_drafts, 1), 4) for a in stats.accepted_per_pos],
        "lossless": all(a.token_ids == b.token_ids for a, b in zip(plain, spec)) if params.temperature == 0 else None,
        "watchdog_fired": engine.metrics.watchdog_fired,
        "spec_profile": engine.prof.table(),
        "policy": engine.policy.snapshot(),
        "spec_steps": engine.metrics.speculative.steps,
        "plain_steps_in_spec_run": engine.metrics.plain.steps,
        "spec_decode_tokens_per_s": round(engine.metrics.speculative.tokens_per_s, 3),
        "spec_step_ms": round(1e3 * engine.metrics.speculative.seconds / max(engine.metrics.speculative.steps, 1), 4),
        "spec_whole_step_ms": round(engine.metrics.speculative.whole_step_ms, 4),
        "prefill_s": round(engine.metrics.prefill.whole_seconds, 4),  # prefill steps, whole (host work included)
        "prefill_steps": engine.metrics.prefill.steps,  # joins one at a time where speculation desynchronised them
        "plain_whole_step_ms_in_spec_run": round(engine.metrics.plain.whole_step_ms, 4),
        "spec_tokens_per_step": round(engine.metrics.speculative.tokens / max(engine.metrics.speculative.steps, 1), 4),
        "decode_tokens_per_s": round(_decode_rate(engine.metrics), 3),  # plain and speculative steps together
    }


def _decode_rate(metrics) -> float:
    tokens = metrics.plain.tokens + metrics.speculative.tokens
    seconds = metrics.plain.seconds + metrics.speculative.seconds
    return tokens / seconds if seconds > 0 else 0.0


def compare_engines(
    target, draft, tok, tcfg: TargetConfig, dcfg: DraftConfig, prompts: list, params: SamplingParams, batch: int = 1
) -> tuple[dict, list]:
    """Plain then speculative decoding of the same prompts on one target -> (metrics, (token prompts, plain outputs))."""
    cfg = EngineConfig(target=tcfg, draft=dcfg, max_num_seqs=batch, profile_steps=True)
    token_prompts, plain, t_plain, plain_engine = plain_run(target, tok, cfg, prompts, params)
    result = spec_run(target, draft, tok, cfg, token_prompts, params, plain, t_plain)
    result["plain_profile"] = plain_engine.prof.table()
    result.update(decode_speedups(result, plain_engine.metrics.plain, batch))
    return result, (token_prompts, plain)


def decode_speedups(result: dict, plain_steps, batch: int) -> dict:
    """Decode-only speedup (speculative vs plain decode steps, tokens/s) and the cost model's prediction at
    ``batch``: τ * t_plain(B) / (t_verify(B, k) + t_draft(B, k)), with t_plain from the plain run's steps of
    ``batch`` sequences and t_verify, t_draft the spec run's measured costs (its policy, bucket of ``batch``)."""
    measured = None
    if plain_steps.tokens and result["spec_decode_tokens_per_s"]:
        measured = round(result["spec_decode_tokens_per_s"] / plain_steps.tokens_per_s, 3)
    plain_row = result["plain_profile"].get("plain", {}).get(batch)
    costs = result["policy"]["buckets"].get(bucket(batch))
    predicted = None
    if plain_row and costs and costs["spec_ms"] is not None:
        predicted = round(result["tau"] * plain_row["step_ms"] / costs["spec_ms"], 3)
    spec_row = result["spec_profile"].get("spec", {}).get(batch)
    return {
        "plain_step_ms": plain_row["step_ms"] if plain_row else None,
        "spec_step_ms": spec_row["step_ms"] if spec_row else None,
        "decode_speedup": measured,
        "predicted_speedup": predicted,
    }


def measure_draft(
    cfg,
    draft_dir,
    *,
    suites: tuple[str, ...] = ("mtbench", "humaneval"),
    k: int | None = None,
    limit: int = 8,
    max_tokens: int = 64,
) -> dict[str, float]:
    """Real τ and speed of a trained draft (``evaluate_with_engine`` in jobs/train.py).

    ``cfg`` is the TrainingConfig (its ``target``); chain drafting with ``k`` tokens (default: the
    config's ``num_speculative_tokens`` if it has one, else 4), T=0. Returns flat MLflow metrics per
    suite: ``engine/<suite>/tau``, ``.../acc_pos_<i>``, ``.../plain_tokens_per_s``,
    ``.../spec_tokens_per_s``, ``.../speedup``, ``.../lossless`` (1.0 = every output equal to plain).
    """
    k = k or getattr(cfg, "num_speculative_tokens", None) or 4
    dcfg = DraftConfig(source=str(draft_dir), num_speculative_tokens=k, policy=PolicyConfig(adaptive=False))
    target, draft, tok, _ = load_models(cfg.target, dcfg)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out: dict[str, float] = {}
    try:
        for suite in suites:
            prompts = [[m.to_dict() for m in r.messages] for r in load_prompts(suite, limit=limit)]
            if not prompts:
                raise EaglerayError(
                    f"bench suite {suite!r} gave no prompts\n    fix: pass suites with prompts (mtbench, humaneval)"
                )
            r, _ = compare_engines(target, draft, tok, cfg.target, dcfg, prompts, params)
            pre = f"engine/{suite}"
            out.update(
                {
                    f"{pre}/tau": r["tau"],
                    f"{pre}/plain_tokens_per_s": r["plain"]["tokens_per_s"],
                    f"{pre}/spec_tokens_per_s": r["spec"]["tokens_per_s"],
                    f"{pre}/speedup": r["speedup"],
                    f"{pre}/lossless": float(r["lossless"]),
                }
            )
            out.update({f"{pre}/acc_pos_{i}": a for i, a in enumerate(r["acceptance_per_pos"])})
    finally:
        close_target(target)
    return out
