"""Regeneration in one process (`eagleray regenerate`) and datagen's `backend: given` on its output:
answers file + manifest + errors, resume, the prompts-only export, and the hidden-state half under Ray."""

import json

import pyarrow.parquet as pq
import pytest

from eagleray.datagen import manifest as mf
from eagleray.datagen import shards
from eagleray.datagen.answers_only import errors_path, manifest_path, regenerate, write_prompts
from eagleray.datagen.pipeline import dry_run, run_datagen
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.errors import ConfigError
from eagleray.tests.support.datagen import datagen_config, expected_ids


@pytest.fixture(scope="module")
def answers(tiny_target, prompt_file, tmp_path_factory):
    """The tiny target's answers to the fixture prompts (the over-long one is recorded, MT-bench held out)."""
    out = tmp_path_factory.mktemp("regen") / "answers.jsonl"
    cfg = DatagenConfig(**datagen_config(tiny_target, prompt_file, tmp_path_factory.mktemp("unused")))
    lines: list[str] = []
    manifest = regenerate(cfg, out, "cpu", emit=lines.append)
    return cfg, out, manifest, lines


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_answers_file_holds_every_prompt_once_with_the_targets_answer(answers, tiny_target):
    cfg, out, manifest, _ = answers
    rows = _rows(out)
    errors = _rows(errors_path(out))
    assert {r["prompt_id"] for r in rows} | {e["prompt_id"] for e in errors} == expected_ids(cfg.model_dump())
    assert len(rows) == manifest["rows"] == 20 and len(errors) == manifest["errors"] == 1
    assert errors[0]["kind"] == "prompt_too_long" and "max_prompt_tokens 96" in errors[0]["message"]
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-2]["role"] == "user" for r in rows)
    assert all(1 <= r["num_tokens"] <= cfg.generation.max_tokens for r in rows)
    spec = TargetSpec.from_dir(tiny_target)
    saved = json.loads(manifest_path(out).read_text())
    assert saved["target_fingerprint"] == spec.fingerprint and saved["tokenizer_fingerprint"] == spec.tokenizer_fingerprint
    assert saved["generation"]["max_tokens"] == 8 and saved["this_run"]["generated_tokens"] == sum(r["num_tokens"] for r in rows)


def test_answers_are_the_targets_greedy_output(answers, tiny_target):
    from eagleray.datagen.backends import TransformersGenerator

    cfg, out, _, _ = answers
    row = _rows(out)[0]
    gen = TransformersGenerator(str(tiny_target))
    again = gen.generate([row["messages"][:-1]], cfg.generation, seed=0)[0]
    assert again.text == row["messages"][-1]["content"]


def test_rerun_resumes_and_writes_nothing_twice(answers):
    cfg, out, _, _ = answers
    before = out.read_bytes()
    lines: list[str] = []
    manifest = regenerate(cfg, out, "cpu", emit=lines.append)
    assert out.read_bytes() == before and manifest["this_run"]["rows"] == 0
    assert any("0 prompts to run, 21 already done" in line for line in lines)


def test_prompts_only_exports_the_selected_prompts(tiny_target, prompt_file, tmp_path):
    cfg = DatagenConfig(**datagen_config(tiny_target, prompt_file, tmp_path / "o"))
    counts = write_prompts(cfg, tmp_path / "p.jsonl", emit=lambda s: None)
    rows = _rows(tmp_path / "p.jsonl")
    assert counts == {"prompts": 20, "too_long": 1} and len(rows) == 20
    assert all(r["messages"][-1]["role"] == "user" for r in rows)


def test_given_needs_whole_conversations(tiny_target, prompt_file, tmp_path):
    with pytest.raises(ValueError, match="set split_turns: false"):
        DatagenConfig(**datagen_config(tiny_target, prompt_file, tmp_path / "o", backend="given"))


def test_given_refuses_answers_written_by_another_target(answers, tiny_target, tmp_path):
    _, out, _, _ = answers
    other = tmp_path / "other.jsonl"
    other.write_bytes(out.read_bytes())
    saved = json.loads(manifest_path(out).read_text())
    manifest_path(other).write_text(json.dumps({**saved, "target_fingerprint": "tgt-someone-else"}))
    cfg = DatagenConfig(**datagen_config(tiny_target, other, tmp_path / "o", backend="given", split_turns=False))
    with pytest.raises(ConfigError, match=r"(?s)prompts\[0\].*tgt-someone-else.*fix: regenerate the answers with this target"):
        dry_run(cfg, emit=lambda s: None)


@pytest.fixture(scope="module")
def given_run(answers, tiny_target, tmp_path_factory):
    import ray

    _, out, _, _ = answers
    src = tmp_path_factory.mktemp("given") / "answers.jsonl"
    no_answer = {"messages": [{"role": "user", "content": "a prompt that never got its answer"}]}
    src.write_text(out.read_text() + json.dumps(no_answer) + "\n")
    manifest_path(src).write_text(manifest_path(out).read_text())
    dg_out = tmp_path_factory.mktemp("given") / "out"
    cfg = datagen_config(tiny_target, src, dg_out, backend="given", split_turns=False)
    ray.init(address="local", num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False, log_to_driver=False)
    try:
        lines: list[str] = []
        manifest = run_datagen(DatagenConfig(**cfg), emit=lines.append)
    finally:
        ray.shutdown()
    return out, dg_out, manifest, lines


def test_given_answers_become_shards_without_regeneration(given_run):
    out, dg_out, manifest, lines = given_run
    answers = {json.dumps(r["messages"][:-1]): r["messages"][-1]["content"] for r in _rows(out)}
    rows = [r for p in shards.shard_files(dg_out) for r in pq.read_table(p, columns=["response", "loss_mask"]).to_pylist()]
    assert manifest["rows"] == len(rows) == 20 and sorted(r["response"] for r in rows) == sorted(answers.values())
    assert all(sum(r["loss_mask"]) > 0 for r in rows)
    assert any("every manifest present matches target" in line for line in lines)
    given = json.loads((dg_out / mf.MANIFEST).read_text())["given_answers"]
    assert len(given) == 1 and given[0]["backend"] == "transformers" and given[0]["device"] == "cpu"
    assert given[0]["rows"] == 20 and given[0]["target_fingerprint"] == manifest["target_fingerprint"]
    assert any(line.startswith("estimate: time") for line in lines)


def test_given_records_without_an_answer_are_recorded_not_dropped(given_run):
    _, dg_out, manifest, _ = given_run
    errs = pq.read_table(dg_out / mf.ERRORS_TABLE).to_pylist()
    assert manifest["errors"] == len(errs) == 1
    assert errs[0]["kind"] == "no_answer" and errs[0]["stage"] == "given"
