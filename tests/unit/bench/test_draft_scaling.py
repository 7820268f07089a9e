"""The issue-15 run's driver (jobs/bench/draft_scaling): the pieces that decide what is trained and kept."""

import argparse
import json

import pytest

from eagleray.jobs.bench import draft_scaling as ds
from eagleray.jobs.bench import draft_scaling_train as dst


def _args(tmp_path, **over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ds.add_arguments(p)
    args = p.parse_args(["train", "--work", str(tmp_path), "--device", "cpu"])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_each_fraction_trains_on_the_first_share_of_the_conversations_with_every_turn_learned(tmp_path):
    args = _args(tmp_path, steps=1200)
    cfg = dst.train_config(args, 0.25, 1000)
    assert cfg.online.limit == 250 and cfg.online.loss_turns == "all" and cfg.max_steps == 1200
    assert cfg.backend == "local" and not cfg.register_model and cfg.checkpoint_every == 100
    assert cfg.output_dir.endswith("frac-0.25")


def test_a_stopped_trainer_keeps_its_newest_checkpoint(tmp_path):
    args = _args(tmp_path)
    d = ds._draft_dir(args, 0.5)
    for step in (100, 200):
        (d / "checkpoints" / f"step-{step:07d}" / "draft").mkdir(parents=True)
        (d / "checkpoints" / f"step-{step:07d}" / "draft" / "config.json").write_text(json.dumps({"step": step}))
    dst._keep_latest(args, 0.5, -15)
    assert json.loads((d / "final-draft" / "config.json").read_text()) == {"step": 200}
    assert json.loads((d / "train.json").read_text())["steps"] == 200


def test_answers_are_packed_in_pieces_that_join_back(tmp_path):
    args = _args(tmp_path)
    (tmp_path / "conversations.jsonl").write_text("".join(json.dumps({"i": i, "pad": "x" * 50}) + "\n" for i in range(2000)))
    (tmp_path / "regen.json").write_text("{}")
    ds._split(tmp_path / "conversations.jsonl", tmp_path / "pieces", "c.part", size=10_000)
    pieces = sorted((tmp_path / "pieces").glob("c.part*"), key=lambda p: int(p.name[6:]))
    assert len(pieces) > 1 and b"".join(p.read_bytes() for p in pieces) == (tmp_path / "conversations.jsonl").read_bytes()
    ds._pack_answers(args, tmp_path / "early")
    assert (tmp_path / "early" / "regen.json").is_file() and (tmp_path / "early" / "conversations.jsonl.xz.part0").is_file()


def test_expected_turns_counts_user_turns_per_conversation(tmp_path):
    src = tmp_path / "c.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"a{i}"}, {"role": "user", "content": "b"}]} for i in range(3)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sorted(ds._expected_turns(src, None).values()) == [2, 2, 2] and len(ds._expected_turns(src, 2)) == 2


def test_epochs_give_each_fraction_the_same_passes_over_its_own_data(tmp_path):
    args = _args(tmp_path, epochs=2.2, train_batch=16)
    steps = {f: dst.train_config(args, f, 16329).max_steps for f in (0.125, 0.25, 0.5, 1.0)}
    assert steps == {0.125: 281, 0.25: 562, 0.5: 1123, 1.0: 2246}  # ceil(2.2 * int(16329 f) / 16)
    assert dst.train_config(args, 0.125, 16329).warmup_steps == 28
    assert dst.train_config(_args(tmp_path, steps=700), 0.125, 16329).max_steps == 700  # without --epochs: --steps


def test_a_given_draft_takes_its_fractions_place_and_bad_options_name_the_fix(tmp_path):
    src = tmp_path / "champion"
    src.mkdir()
    (src / "config.json").write_text("{}")
    args = _args(tmp_path / "w", given=[f"1={src}"], fractions="0.5,1")
    assert dst.given_drafts(args) == {1.0: src}
    dst.place_given(args, 1.0, src)
    assert (ds._draft_dir(args, 1.0) / "final-draft" / "config.json").is_file()
    assert json.loads((ds._draft_dir(args, 1.0) / "train.json").read_text())["given"] == str(src)
    for bad, says in ((f"0.25={src}", "one of --fractions"), ("1", "FRACTION=DIR"), (f"1={tmp_path}", "no config.json")):
        with pytest.raises(SystemExit, match=says):
            dst.given_drafts(_args(tmp_path, given=[bad], fractions="0.5,1"))


def test_child_processes_see_the_same_epochs_given_and_b1(tmp_path):
    args = _args(tmp_path, epochs=2.2, given=["1=/x"], b1="largest")
    child = argparse.ArgumentParser()
    ds.add_arguments(child)
    seen = child.parse_args(["train-one", *ds._shared_options(args)])
    assert (seen.epochs, seen.given, seen.b1) == (2.2, ["1=/x"], "largest")


def test_a_resumed_eval_measures_only_the_drafts_without_a_record(tmp_path):
    from eagleray.jobs.bench import draft_scaling_eval as dse

    args = _args(tmp_path, fractions="0.5,1")
    (tmp_path / "plain.pkl").write_bytes(b"")  # baselines exist: no target is loaded
    for f in (0.5, 1.0):
        (tmp_path / f"eval-{f:g}.json").write_text(json.dumps({"data_fraction": f}))
    args.eval_prompts = "mtbench,humaneval"
    assert [r["data_fraction"] for r in dse.evaluate(args)] == [0.5, 1.0]
    assert json.loads((tmp_path / "scaling.json").read_text()) == [{"data_fraction": 0.5}, {"data_fraction": 1.0}]


def _scaling_records():
    return [  # out of order on purpose; the 'run 1' leftover has no loss_tokens and is not a curve point
        {"data_fraction": 1.0, "loss_tokens": 8000, "tau_mtbench_chain": 1.9, "tau_humaneval_chain": 2.3, "sim_tau_heldout": 3.9},
        {
            "data_fraction": 0.25,
            "loss_tokens": 2000,
            "tau_mtbench_chain": 1.5,
            "tau_humaneval_chain": 1.4,
            "sim_tau_heldout": None,
        },
        {"data_fraction": 0.5, "loss_tokens": 4000, "tau_mtbench_chain": 1.6, "tau_humaneval_chain": 1.6, "sim_tau_heldout": 2.6},
        {"data_fraction": 0.75, "loss_tokens": None, "tau_mtbench_chain": None},
    ]


def test_the_scaling_plot_orders_drafts_by_data_and_logs_tau_per_data_size_to_mlflow(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("EAGLERAY_HOME", str(tmp_path / "home"))
    (tmp_path / "scaling.json").write_text(json.dumps(_scaling_records()))
    ds.main(["plot", "--work", str(tmp_path), "--out", str(tmp_path / "s.png"), "--mlflow-experiment", "scaling-test"])
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("scaling-test")
    (run,) = client.search_runs([exp.experiment_id])
    history = client.get_metric_history(run.info.run_id, "tau_mtbench_chain")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(2000, 1.5), (4000, 1.6), (8000, 1.9)]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"s.png", "scaling.json"}


def test_tau_rises_only_when_every_doubling_gains_and_an_unmeasured_draft_is_refused():
    from eagleray.jobs.bench import draft_scaling_plot as dsp

    rows = dsp.curve(_scaling_records())
    assert [r["data_fraction"] for r in rows] == [0.25, 0.5, 1.0] and dsp.rises(rows)
    rows[1]["tau_mtbench_chain"] = 1.5  # flat from 1/4 to 1/2
    assert not dsp.rises(rows)
    bad = _scaling_records()[:3]
    bad[0]["tau_mtbench_chain"] = None
    with pytest.raises(SystemExit, match="unmeasured \\[1.0\\]"):
        dsp.curve(bad)
    with pytest.raises(SystemExit, match="need >= 2 drafts"):
        dsp.curve(bad[:1])
    more = _scaling_records()  # a continued training sits at the tokens learned since a fresh draft, not its own run's
    more.append(dict(more[-1], data_fraction=1.0, loss_tokens=1000, loss_tokens_cumulative=9000, tau_mtbench_chain=2.0))
    assert [dsp.data_tokens(r) for r in dsp.curve(more)] == [2000, 4000, 8000, 9000]


def test_single_turns_are_each_user_message_alone_or_each_conversations_first(tmp_path):
    src = tmp_path / "c.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "c"}, {"role": "user", "content": "d"}]},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = ds.single_turns(src, tmp_path / "first.jsonl", "first")
    got = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert got == [[{"role": "user", "content": "a"}], [{"role": "system", "content": "s"}, {"role": "user", "content": "c"}]]
    assert sorted(ds._expected_turns(out, None).values()) == [1, 1]  # the regen's count of what must come back
    out = ds.single_turns(src, tmp_path / "all.jsonl", "all")
    got = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    sys_ = {"role": "system", "content": "s"}
    assert got == [[{"role": "user", "content": c}] for c in "ab"] + [[sys_, {"role": "user", "content": c}] for c in "cd"]
    assert sorted(ds._expected_turns(out, None).values()) == [1, 1, 1, 1]


def test_continued_training_starts_from_the_draft_and_learns_the_extra_answers_too(tmp_path):
    args = _args(tmp_path, init_from="/champion", extra_prompts="/sampled/conversations.jsonl")
    cfg = dst.train_config(args, 1.0, 100)
    assert cfg.init_from == "/champion"
    assert cfg.online.prompts == [str(tmp_path / "conversations.jsonl"), "/sampled/conversations.jsonl"]
    assert dst.train_config(_args(tmp_path), 1.0, 100).online.prompts == [str(tmp_path / "conversations.jsonl")]
    child = argparse.ArgumentParser()
    ds.add_arguments(child)
    seen = child.parse_args(["train-one", *ds._shared_options(args)])
    assert (seen.init_from, seen.extra_prompts) == ("/champion", "/sampled/conversations.jsonl")


def test_the_regen_config_samples_at_the_temperature_asked_for(tmp_path):
    from eagleray.platform.config.schemas import DatagenConfig

    for temperature in (0.0, 0.7):
        cfg = ds.regen_config(_args(tmp_path, temperature=temperature), tmp_path / "p.jsonl", tmp_path / "regen")
        assert cfg["generation"]["temperature"] == temperature and cfg["answer_turns"] == "all"
        DatagenConfig.model_validate(cfg)  # what each regen process loads


def test_another_regen_seed_samples_each_turn_with_another_seed(tmp_path):
    from eagleray.datagen.backends import batch_seed
    from eagleray.platform.config.schemas import DatagenConfig

    seeds = {}
    for base in (0, 1):
        cfg = ds.regen_config(_args(tmp_path, temperature=0.7, seed=base), tmp_path / "p.jsonl", tmp_path / "regen")
        gen = DatagenConfig.model_validate(cfg).generation  # what each regen process loads
        assert (gen.seed, gen.temperature) == (base, 0.7)
        seeds[base] = batch_seed(gen.seed, "conv-1:0")  # datagen/turns: one seed per conversation turn
    assert seeds[0] != seeds[1]
    assert ds.regen_config(_args(tmp_path), tmp_path / "p.jsonl", tmp_path / "regen")["generation"]["seed"] == 0
