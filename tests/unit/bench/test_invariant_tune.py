"""The plan tuning's bookkeeping on CPU: the candidates it tries and how it writes the plans file."""

import json

from eagleray.jobs.bench import invariant_check as ic
from eagleray.kernels import invariant_plans
from eagleray.kernels.invariant_plans import make_plan


def test_candidates_are_distinct_and_hold_the_shipped_plans():
    shipped = json.loads(invariant_plans.PLANS_FILE.read_text())["NVIDIA H200"]  # tuned among the earlier candidates
    for model, shapes in ic.SHAPES.items():
        for n, k in shapes:
            cands = ic._candidates(n, k)
            assert len(cands) == len(set(cands)), (model, n, k)
            assert make_plan(n, k, **shipped[f"{n}x{k}"]) in ic._old_candidates(n, k)  # the A/B's baseline holds it
            assert ic._old_candidates(n, k) < set(cands)  # a new tuning can only match or beat the earlier one
            assert all(p.splits * p.k_per_split >= k and (p.splits - 1) * p.k_per_split < k for p in cands)


def test_write_plans_merges_shape_by_shape(tmp_path, monkeypatch):
    path = tmp_path / "plans.json"
    monkeypatch.setattr(ic, "PLANS_FILE", path)
    plan = {"splits": 1, "block_n": 32, "block_k": 128, "warps": 4, "stages": 3}
    ic._write_plans({"GPU": {"1x2": plan}})
    ic._write_plans({"GPU": {"3x4": plan}, "Other": {"1x2": plan}})  # a later tuning of other shapes
    assert json.loads(path.read_text()) == {"GPU": {"1x2": plan, "3x4": plan}, "Other": {"1x2": plan}}
