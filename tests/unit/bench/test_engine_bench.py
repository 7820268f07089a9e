"""`bench engine`: --prompt-ids (token prompts for the 8B-shaped target on a machine without the tokenizer) and the
prompt rounds (whole rounds of the batch, so a plain run decodes at the batch size throughout)."""

from __future__ import annotations

import json

import pytest

from eagleray.jobs.bench.engine_batches import _prompt_ids, full_rounds
from eagleray.platform.errors import EaglerayError


def test_prompt_ids_reads_a_json_list_of_token_lists_and_keeps_the_first_limit(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps([[1, 2, 3], [4], [5, 6]]))
    assert _prompt_ids(str(path), 2) == [[1, 2, 3], [4]]


@pytest.mark.parametrize("bad", [[], [[]], [["a"]], {"ids": [[1]]}, [[1.5]]])
def test_prompt_ids_refuses_what_is_not_token_lists(tmp_path, bad):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(EaglerayError, match="--prompt-ids"):
        _prompt_ids(str(path), 80)


@pytest.mark.parametrize("n,batch,total", [(80, 1, 80), (80, 32, 160), (80, 64, 320), (80, 128, 640), (16, 8, 16), (3, 4, 12)])
def test_full_rounds_are_whole_rounds_of_the_batch_and_at_least_two(n, batch, total):
    prompts = [[i] for i in range(n)]
    out = full_rounds(prompts, batch)
    assert len(out) == total and len(out) % batch == 0 and len(out) >= 2 * batch
    assert out[:n] == prompts  # the prompts in order, repeated


def test_a_fixed_k_run_is_predicted_at_its_own_k():
    """A fixed-k run measured only k=4: its prediction uses k=4's costs, not the k the policy would choose (whose
    costs may be interpolated guesses); an adaptive run's uses the chosen k's."""
    from eagleray.jobs.bench.engine_batches import _predicted

    run = {"tau": 2.0, "policy": {"buckets": {8: {"spec_ms": 1.0, "verify_ms_by_k": {4: 1.5}, "draft_ms_by_k": {4: 0.5}}}}}
    assert _predicted(run, 8, 1.0, 4) == pytest.approx(1.0)  # 2 x 1.0 / (1.5 + 0.5)
    assert _predicted(run, 8, 1.0, None) == pytest.approx(2.0)  # at the chosen k: 2 x 1.0 / 1.0
    assert _predicted(run, 8, 1.0, 3) is None  # k=3 never measured


def test_repeated_runs_report_the_median_run_and_ratios_against_the_plain_median():
    from eagleray.jobs.bench.engine_batches import _medians

    def plain(t):
        return {"mode": "plain", "tok_s": t, "decode_tok_s": 2 * t, "lossless": None}

    def spec(t, ok=True):
        return {"mode": "spec", "tok_s": t, "all_decode_tok_s": 3 * t, "lossless": ok, "speedup": 0.0}

    rounds = [[plain(100), spec(90)], [plain(80), spec(120, ok=False)], [plain(120), spec(100)]]
    p, s = _medians(rounds)
    assert p["tok_s"] == 100 and p["tok_s_runs"] == [100, 80, 120]
    assert s["tok_s"] == 100 and s["tok_s_runs"] == [90, 120, 100]
    assert s["plain_tok_s"] == 100 and s["speedup"] == 1.0 and s["decode_ratio"] == 1.5
    assert s["lossless"] is False  # one round's outputs differed: not lossless
    two = _medians([[plain(80), spec(90)], [plain(120), spec(100)]])
    assert two[0]["tok_s"] == 80  # an even count: the lower of the middle two


def test_repeats_below_one_are_refused_by_name():
    from eagleray.jobs.bench.engine_batches import run

    with pytest.raises(EaglerayError, match="--repeats 0"):
        run(["--repeats", "0"])


def test_join_wait_steps_list_runs_each_value_and_refuses_bad_ones_by_name():
    import argparse

    from eagleray.jobs.bench.engine_batches import add_arguments, join_waits

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert join_waits(p.parse_args([])) == [None]  # the device's default
    assert join_waits(p.parse_args(["--join-wait-steps", "0,8,16"])) == [0, 8, 16]
    for bad in ("8,x", "-1"):
        with pytest.raises(SystemExit, match="--join-wait-steps"):
            join_waits(p.parse_args(["--join-wait-steps", bad]))
