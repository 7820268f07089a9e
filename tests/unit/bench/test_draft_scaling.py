"""The issue-15 run's driver (jobs/bench/draft_scaling): the pieces that decide what is trained and kept."""

import argparse
import json

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
