"""The training loop in one process on synthetic shards: loss goes down, checkpoints are valid drafts, resume works."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagleray.platform.checkpoints.draft import DraftCheckpoint
from eagleray.platform.checkpoints.guard import check_compatibility
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.config.schemas import TrainingConfig
from eagleray.tests.support.training import small_training_config
from eagleray.training import data, loop
from eagleray.training.loop import DRAFT, lr_lambda, train_worker
from eagleray.training.session import LocalSession


def _cfg(data_dir, target, out, **kw) -> TrainingConfig:
    steps = dict(warmup_steps=2, max_steps=20, log_every=5, checkpoint_every=10, eval_fraction=0.2, ttt_steps=3)
    return small_training_config(data_dir, target, out, **{**steps, **kw})


def _online_cfg(target, out, convs: list[dict], **kw) -> TrainingConfig:
    """An online run over ``convs`` (written to out/convs.jsonl): checkpoint and eval (one batch) at the last step."""
    import json

    src = out / "convs.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in convs))
    steps = kw.pop("max_steps")
    base = dict(max_steps=steps, checkpoint_every=steps, eval_fraction=0.25, eval_batches=1, draft_vocab_size=64)
    return _cfg("online", target, out, online={"prompts": [str(src)]}, **{**base, **kw})


@pytest.fixture(scope="module")
def trained(synthetic_data, train_target, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run")
    session = LocalSession(out / "ckpt")
    train_worker(_cfg(synthetic_data, train_target, out), session)
    return session, out


def test_loss_decreases_and_accuracy_rises(trained):
    reports = [r for r in trained[0].reports if "loss" in r]
    first, last = reports[0], reports[-1]
    assert last["loss"] < first["loss"]
    assert last["acc_0"] > first["acc_0"]
    assert last["sim_tau"] >= 1.0 and {"eval/acc_0", "eval/sim_tau", "ploss_2", "lr", "grad_norm"} <= set(last)


def test_checkpoint_is_a_compatible_vllm_format_draft(trained, train_target, synthetic_data):
    ckpt = trained[0].latest_checkpoint()
    spec = TargetSpec.from_dir(train_target)
    report = check_compatibility(spec, ckpt / DRAFT, algorithm="eagle3")
    assert report.ok, [p.render() for p in report.problems]
    d = DraftCheckpoint.open(ckpt / DRAFT)
    meta = d.metadata
    assert meta.target_fingerprint == spec.fingerprint and meta.tokenizer_fingerprint == spec.tokenizer_fingerprint
    assert meta.dataset_id == data.read_manifest(synthetic_data)["dataset_id"] and meta.notes["step"] == 20
    assert meta.notes["data_loss_tokens"] == int(data.read_vocab_counts(synthetic_data).sum()) > 0
    assert d.config["architectures"] == ["LlamaForCausalLMEagle3"] and d.shapes["lm_head.weight"] == [128, 64]
    assert "embed_tokens.weight" not in d.shapes  # the target's embedding is shared


def test_resume_continues_from_the_latest_checkpoint(synthetic_data, train_target, tmp_path):
    torch.set_num_threads(1)
    session = LocalSession(tmp_path / "ckpt")
    train_worker(_cfg(synthetic_data, train_target, tmp_path, max_steps=4, checkpoint_every=2, eval_batches=1), session)
    again = LocalSession(tmp_path / "ckpt")
    metrics = train_worker(_cfg(synthetic_data, train_target, tmp_path, max_steps=6, checkpoint_every=2, eval_batches=1), again)
    assert metrics["resumed_from_step"] == 4 and metrics["step"] == 6
    assert [r["step"] for r in again.reports if "step" in r] == [6]


def test_lr_schedule_warmup_then_cosine():
    cfg = _cfg("d", "t", "o", warmup_steps=2, max_steps=10, min_lr_ratio=0.1)
    f = lr_lambda(cfg)
    assert [f(0), f(1)] == [0.5, 1.0] and f(2) == pytest.approx(1.0) and f(10) == pytest.approx(0.1)


def test_shard_reader_splits_ranks_and_held_out(synthetic_data):
    files = data.shard_files(synthetic_data)
    ids = lambda **kw: [r["prompt_id"] for r in data.iter_rows(files, eval_fraction=0.2, **kw)]  # noqa: E731
    r0, r1 = ids(rank=0, world=2), ids(rank=1, world=2)
    held = ids(split="eval", shuffle=False)
    assert not set(r0) & set(r1) and not (set(r0) | set(r1)) & set(held) and held
    assert len(r0) + len(r1) + len(held) == 24
    batch = next(
        data.train_batches(files, batch_size=3, max_seq_len=20, rank=0, world=1, seed=0, eval_fraction=0.2, shuffle_buffer=8)
    )
    assert batch.input_ids.shape == (3, 20) and batch.aux.shape == (3, 20, 2 * 64) and batch.final_hidden.shape == (3, 20, 64)


def test_data_dir_of_another_target_is_refused(synthetic_data, tmp_path):
    from eagleray.platform.errors import ConfigError
    from eagleray.tests.support.tiny import make_tiny_llama
    from eagleray.training.plan import make_plan

    other = make_tiny_llama(tmp_path / "other", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
    with pytest.raises(ConfigError, match="training.data_dir: the data was generated by target"):
        make_plan(_cfg(synthetic_data, other, tmp_path))


def test_online_mode_runs_the_target_in_the_loop(train_target, tmp_path):
    torch.set_num_threads(1)
    convs = [
        {
            "messages": [
                {"role": "user", "content": f"write code {i}"},
                {"role": "assistant", "content": "def add(a, b):\n    return a + b\n" * (1 + i % 3)},
            ]
        }
        for i in range(12)
    ]
    cfg = _online_cfg(train_target, tmp_path, convs, max_steps=3)
    session = LocalSession(tmp_path / "ckpt")
    metrics = train_worker(cfg, session)
    assert metrics["step"] == 3 and 0.0 <= metrics["acc_0"] <= 1.0
    assert (session.latest_checkpoint() / DRAFT / "config.json").is_file()


def test_max_shards_trains_on_a_subset_with_its_own_vocab_and_id(synthetic_data, train_target, tmp_path):
    from eagleray.platform.errors import ConfigError
    from eagleray.training.plan import make_plan

    full = make_plan(_cfg(synthetic_data, train_target, tmp_path))
    sub = make_plan(_cfg(synthetic_data, train_target, tmp_path, max_shards=1))
    assert len(full.files) == 3 and sub.files == full.files[:1]
    assert sub.dataset_id != full.dataset_id
    # the subset's draft vocabulary is built from the subset's loss-masked token counts
    counts = data.count_loss_tokens(sub.files, full.spec.vocab_size)
    assert counts.sum() < data.read_vocab_counts(synthetic_data).sum()
    seen = set(torch.nonzero(counts).flatten().tolist())  # fewer than draft_vocab_size here
    import pyarrow.parquet as pq

    rows = pq.read_metadata(sub.files[0]).num_rows
    assert sub.data_size == {"shards": 1, "rows": rows, "loss_tokens": int(counts.sum())}
    assert full.data_size["shards"] == 3 and full.data_size["rows"] > rows
    assert sub.metadata({"step": 1}).notes == {
        "data_shards": 1,
        "data_rows": rows,
        "data_loss_tokens": int(counts.sum()),
        "step": 1,
    }
    assert len(seen) <= 128 and set(torch.nonzero(sub.init.t2d).flatten().tolist()) >= seen
    with pytest.raises(ConfigError, match="training.max_shards: is 9 but .* holds 3 shards"):
        make_plan(_cfg(synthetic_data, train_target, tmp_path, max_shards=9))
    with pytest.raises(ValueError, match="max_shards selects offline shards"):
        _cfg("online", train_target, tmp_path, max_shards=1, online={"prompts": ["sharegpt"]})


def test_relative_paths_are_made_absolute_for_ray_train_workers(synthetic_data, train_target, tmp_path, monkeypatch):
    """Ray Train runs each worker in its own directory: a config with paths relative to where the user
    started the job must reach the workers as absolute paths."""
    import os

    from eagleray.training.trainer import absolute_paths

    monkeypatch.chdir(synthetic_data.parent)
    rel = _cfg(synthetic_data.name, os.path.relpath(train_target), "out", init_from="models:/d@a")
    got = absolute_paths(rel)
    assert got.data_dir == str(synthetic_data.resolve()) and got.output_dir == str((synthetic_data.parent / "out").resolve())
    assert got.target.model == str(Path(train_target).resolve()) and got.init_from == "models:/d@a"
    assert rel.data_dir == synthetic_data.name  # the caller's config is not modified
    assert absolute_paths(_cfg(synthetic_data, "smollm2", tmp_path)).target.model == "smollm2"


def test_online_all_turns_learns_every_assistant_message_and_shows_progress(train_target, tmp_path, capsys):
    """loss_turns 'all' (turn-by-turn regenerated data) masks every answer, 'last' only the final one; a run with no
    MLflow run prints its progress (step, loss, ETA)."""
    import json

    from transformers import AutoTokenizer

    from eagleray.training.online import iter_online_rows

    torch.set_num_threads(1)
    turns = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "first answer"}]
    turns += [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "second answer"}]
    src = tmp_path / "convs.jsonl"
    src.write_text(
        "".join(
            json.dumps({"messages": turns + [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "x"}]}) + "\n"
            for i in range(8)
        )
    )
    tok = AutoTokenizer.from_pretrained(str(train_target))
    masked = {}
    for mode in ("last", "all"):
        cfg = _cfg("online", train_target, tmp_path, online={"prompts": [str(src)], "loss_turns": mode}, eval_fraction=0.0)
        row = next(iter_online_rows(cfg, tok))
        masked[mode] = tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert "first answer" not in masked["last"] and "first answer" in masked["all"] and "second answer" in masked["all"]
    cfg = _cfg("online", train_target, tmp_path, online={"prompts": [str(src)], "loss_turns": "all"}, max_steps=2, log_every=1)
    train_worker(cfg, LocalSession(tmp_path / "ckpt-all"))
    assert "train: step 2/2 loss" in capsys.readouterr().out


def test_a_time_budget_stops_training_with_the_schedule_ended(synthetic_data, train_target, tmp_path):
    """max_minutes: the horizon is fitted to the budget (here ~1.5 s of 0.1 s steps), training stops there with its
    final checkpoint and eval, and the lr has decayed to the floor at that step."""
    torch.set_num_threads(1)
    session = LocalSession(tmp_path / "ckpt")
    cfg = _cfg(
        synthetic_data,
        train_target,
        tmp_path,
        max_steps=300,
        max_minutes=0.025,
        log_every=2,
        checkpoint_every=1000,
        eval_batches=1,
        warmup_steps=1,
        min_lr_ratio=0.1,
        testing={"step_delay_s": 0.1},
    )
    metrics = train_worker(cfg, session)
    assert metrics["step"] < 300 and metrics["horizon"] == metrics["step"]
    assert "eval/sim_tau" in metrics and session.latest_checkpoint() is not None
    assert lr_lambda(cfg, lambda: metrics["step"])(metrics["step"]) == pytest.approx(0.1)


def test_the_horizon_follows_the_measured_step_time(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    cfg = _cfg("d", "t", "o", max_steps=10_000, max_minutes=1.0)
    h = loop.Horizon(cfg)
    session = LocalSession(Path("unused"))
    clock[0] = 5.0
    h.refit(10, session)  # no interval measured yet: the cap
    assert h.steps == 10_000
    clock[0] = 10.0
    h.refit(20, session)  # 0.5 s a step, 50 s left
    assert h.steps == 120
    clock[0] = 70.0
    h.refit(30, session)  # past the budget: stop now
    assert h.steps == 30
    assert loop.Horizon(_cfg("d", "t", "o", max_steps=7)).steps == 7  # no budget: max_steps


def test_prefetch_keeps_order_and_raises_the_producers_error_in_place():
    assert list(data.prefetch(iter(range(50)), 3)) == list(range(50))

    def broken():
        yield 1
        raise ValueError("row 2 is bad")

    got = data.prefetch(broken(), 2)
    assert next(got) == 1
    with pytest.raises(ValueError, match="row 2 is bad"):
        next(got)


def test_closing_prefetch_stops_its_producer():
    import threading

    stream = data.prefetch(iter(range(10_000)), 2)
    assert next(stream) == 0
    stream.close()  # the final eval tokenizes next: the producer must be gone, not still running ahead
    assert not [t for t in threading.enumerate() if t.name == "eagleray-prefetch"]


def test_a_reached_horizon_is_not_moved_again(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    h = loop.Horizon(_cfg("d", "t", "o", max_steps=10_000, max_minutes=1.0))
    session = LocalSession(Path("unused"))
    for step, t in ((10, 5.0), (20, 10.0)):
        clock[0] = t
        h.refit(step, session)
    assert h.steps == 120
    clock[0] = 12.0  # steps got faster: a re-fit now would push the end out, but 120 is reached
    h.refit(120, session)
    assert h.steps == 120


def test_the_final_eval_runs_after_the_background_tokenizer_stopped(train_target, tmp_path, monkeypatch):
    """The first epoch tokenizes on a background thread; the final eval tokenizes too, with the same tokenizer, so the
    training stream is closed (its thread joined) before it."""
    import threading

    torch.set_num_threads(1)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f():\n    return 1\n"}]
    convs = [{"messages": turns, "id": f"c{i}"} for i in range(400)]
    alive = []
    evaluate = loop.evaluate

    def spy(*a, **kw):
        alive.append([t.name for t in threading.enumerate() if t.name == "eagleray-prefetch"])
        return evaluate(*a, **kw)

    monkeypatch.setattr(loop, "evaluate", spy)
    cfg = _online_cfg(train_target, tmp_path, convs, max_steps=2, shuffle_buffer=4)
    train_worker(cfg, LocalSession(tmp_path / "ckpt"))
    assert alive == [[]]
