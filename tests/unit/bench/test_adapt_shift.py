"""The issue-16 shift benchmark's driver (jobs/bench/adapt_shift): what the adaptation loop is told to train."""

from eagleray.jobs.bench import adapt_shift as bench
from eagleray.platform.config.load import parse_config
from eagleray.platform.config.schemas import TrainingConfig


def _cfg(tmp_path, *argv: str):
    args = bench.parse(["--work", str(tmp_path), *argv])
    return bench.adapt_config(args, tmp_path / "traffic", tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}")


def _training(cfg, tmp_path) -> TrainingConfig:
    """The fine-tuning config the loop builds from cfg.train (as jobs/adapt.train_step does)."""
    fields = {**cfg.train, "data_dir": str(tmp_path / "data"), "output_dir": str(tmp_path / "out")}
    return parse_config(TrainingConfig, fields, source="test", prefix="train")


def test_replay_share_unrolled_steps_and_autocast_reach_the_fine_tuning(tmp_path):
    cfg = _cfg(
        tmp_path,
        "--replay", str(tmp_path / "replay"), "--replay-fraction", "0.5",
        "--ttt-steps", "3", "--autocast", "bf16", "--learning-rate", "2e-4", "--train-steps", "150",
    )  # fmt: skip
    t = _training(cfg, tmp_path)
    assert t.replay is not None and t.replay.data_dir == str(tmp_path / "replay") and t.replay.fraction == 0.5
    assert t.ttt_steps == 3 and t.autocast == "bf16"
    assert t.learning_rate == 2e-4 and t.max_steps == 150 and t.backend == "local"


def test_unrolled_steps_follow_the_served_chain_length_by_default_and_no_replay_without_data(tmp_path):
    t = _training(_cfg(tmp_path, "--k", "3", "--traffic", "40"), tmp_path)
    assert t.ttt_steps == 3 and t.replay is None and t.autocast == "auto"
    assert _cfg(tmp_path, "--traffic", "40").min_new_requests == 20


def test_overhead_rounds_alternate_abba_and_always_end_with_the_capture_that_feeds_the_loop():
    assert bench.overhead_plan(1) == ["off", "on"]
    assert bench.overhead_plan(2) == ["on", "off", "off", "on"]
    assert bench.overhead_plan(3) == ["off", "on", "on", "off", "off", "on"]
    for r in range(1, 6):
        plan = bench.overhead_plan(r)
        assert plan.count("on") == plan.count("off") == r and plan[-1] == "on"


def test_overhead_is_the_throughput_ratio_over_all_passes_not_the_mean_of_rounds():
    def p(tokens, seconds):
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}

    off = [p(1000, 10.0), p(1000, 20.0)]  # 100 and 50 tok/s: 2000 tokens in 30 s
    on = [p(1000, 10.0), p(1000, 30.0)]  # 100 and 33.3 tok/s: 2000 tokens in 40 s
    cost = bench.overhead(off, on)
    assert abs(cost["overhead"] - (1 - 30.0 / 40.0)) < 1e-12
    assert cost["per_round"][0] == 0.0 and abs(cost["per_round"][1] - (1 - (1000 / 30) / 50)) < 1e-12


def test_code_requests_from_sharegpt_are_first_user_turns_asking_for_code(tmp_path):
    """--code-sharegpt: distinct first user turns with a code marker, at most 1,500 characters, the same sample every run,
    none of them a HumanEval prompt (the held-out set); the loop waits for half of all the traffic."""
    picked = bench.sharegpt_code(40)
    assert len(picked) == 40 and picked == bench.sharegpt_code(40)
    texts = [m[0]["content"] for m in picked]
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in picked) and len(set(texts)) == 40
    assert all(len(t) <= 1500 and bench.CODE_MARKER.search(t) for t in texts)
    humaneval = {m[-1]["content"] for m in bench.messages("humaneval", 0, None)}
    assert not humaneval & set(texts)
    assert _cfg(tmp_path, "--traffic", "100", "--code-sharegpt", "200").min_new_requests == 150


def test_traffic_samples_repeat_every_prompt_with_its_own_seed_and_greedy_repeats_are_refused(tmp_path):
    """--traffic-samples S: each traffic prompt S more times, a distinct seed per request (distinct answers of the
    target), at --traffic-max-tokens; S greedy repeats would be S identical answers, so they are refused."""
    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(3)]
    bodies = bench.sampled_requests(prompts, 4, 0.8, 256)
    assert len(bodies) == 12 and [b["messages"] for b in bodies[:3]] == prompts == [b["messages"] for b in bodies[9:]]
    assert len({b["seed"] for b in bodies}) == 12 and all(b["max_tokens"] == 256 and b["temperature"] == 0.8 for b in bodies)
    assert bench.sampled_requests(prompts, 0, 0.8, 64) == []
    assert "seed" not in bench.sampled_requests(prompts, 1, 0.0, 256)[0]  # one greedy pass at a longer length
    for samples, temperature in ((2, 0.0), (-1, 0.8), (1, -0.5)):
        try:
            bench.sampled_requests(prompts, samples, temperature, 64)
        except ValueError as err:
            assert "--traffic-" in str(err)
        else:
            raise AssertionError(f"samples {samples}, temperature {temperature} accepted")
    assert bench.requests(prompts, 64)[0] == {"messages": prompts[0], "max_tokens": 64, "temperature": 0}
    assert _cfg(tmp_path, "--traffic", "100", "--traffic-samples", "3").min_new_requests == 200
