"""What the adaptive policy reports (:meth:`AdaptivePolicy.snapshot`): per batch-size bucket, its costs and the k it
would choose now, and over the run: the decode steps taken at each k, the mean prediction of its speculative
decisions and the speedup the steps measured on the wall clock (:mod:`~eagleray.serve.engine.step_wall`).

The k "now" is read at the end of a run, when a bucket's last steps drain its batch (no more joins, fewer
sequences); the k of the run (``k_run``, the k most steps took) is the one to print per batch size.
"""

from __future__ import annotations

from eagleray.serve.engine.policy_costs import at_k


def snapshot(policy) -> dict:
    out = {}
    for b, c in sorted(policy.costs.items()):
        k, speedup = policy.best(b)
        at = k or policy.k_max
        verify = round(policy._verify_cost(c, at) * 1e3, 3) if c.verify_by_k else None
        draft = round(at_k(c.draft_by_k, at, 0.0) * 1e3, 3) if c.draft_by_k else None
        join = round(policy._join_cost(c, at, b) * 1e3, 3)
        decided, summed = c.predicted
        out[b] = {
            "plain_ms": None if c.plain is None else round(c.plain * 1e3, 3),
            "verify_ms": verify,
            "verify_ms_by_k": {j: round(v * 1e3, 3) for j, v in sorted(c.verify_by_k.items())},
            "draft_ms": draft,
            "draft_ms_by_k": {j: round(v * 1e3, 3) for j, v in sorted(c.draft_by_k.items())},
            "join_ms": join,
            "spec_ms": None if verify is None or draft is None else round(verify + draft + join, 3),
            "k": k,
            "predicted_speedup": round(speedup, 4),
            "k_steps": dict(sorted(c.chosen.items())),
            "k_run": max(c.chosen, key=lambda j: (c.chosen[j], j)) if c.chosen else None,
            "predicted_run": round(summed / decided, 4) if decided else None,
            **measured(c),
        }
    return {"acceptance_per_pos": [round(a, 4) for a in policy.accept], "buckets": out}


def measured(c) -> dict:
    """The run's steps at each k on the wall clock: mean step ms (speculative: less the catch-up after plain steps,
    plus the joins' share), tokens a sequence a step, and each k's speedup over the bucket's plain steps."""
    wall = {
        j: {"steps": n, "step_ms": round(1e3 * s / n, 4), "tokens_per_seq": round(t / q, 4)}
        for j, (n, q, t, s) in sorted(c.wall.items())
        if n and q
    }
    plain = wall.get(0)
    by_k = {}
    if plain:
        for j, w in wall.items():
            if j:
                by_k[j] = round(w["tokens_per_seq"] * plain["step_ms"] / w["step_ms"], 4) if w["step_ms"] else None
    return {"wall": wall, "measured_speedup_by_k": by_k}
