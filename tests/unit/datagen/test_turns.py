"""Turn-by-turn regeneration (answer_turns: all): every user turn answered on the target's own history,
left truncation counted (never dropped), engine refusals recorded with the turns they cut off, the
output read back (in = answered + errors, 0 lost, 0 duplicated), resume and sharding."""

import json

import pytest

from eagleray.datagen.answers_only import count_output, errors_path, manifest_path, regenerate_conversations
from eagleray.datagen.turns import Conversation, PromptTooLong, TurnByTurn, fit_prompt
from eagleray.platform.config.schemas import DatagenConfig, GenerationConfig, TargetConfig
from eagleray.platform.errors import ConfigError
from eagleray.platform.prompts import make_record
from eagleray.platform.prompts.records import Message
from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams
from eagleray.tests.support.datagen import datagen_config

LONG = "the quick brown fox jumps over the lazy dog " * 30  # ~300 tokens: over the cap alone

CONVERSATIONS = [
    ["Write a short note about speculative decoding.", "Now make it shorter.", "And one line?"],
    ["Explain the Ray object store in one sentence.", "Give an example."],
    ["What is Parquet?"],
    [LONG, "Summarise that."],  # the first turn alone is over the cap: its text is cut from the left
    ["Tell me about " + "paged attention " * 12, "More about " + "block tables " * 12, "And " + "prefill " * 12],
]


def _conversations_file(path, with_answers: bool = True):
    """ShareGPT-like conversations (the dataset's answers are not the target's: they must not be used)."""
    lines = []
    for turns in CONVERSATIONS:
        msgs = []
        for t in turns:
            msgs.append({"role": "user", "content": t})
            if with_answers:
                msgs.append({"role": "assistant", "content": "a dataset answer that the target did not write"})
        lines.append(json.dumps({"messages": msgs}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(tiny_target, prompts, tmp_path, **over) -> DatagenConfig:
    base = datagen_config(
        tiny_target,
        prompts,
        tmp_path / "unused",
        backend="eagleray",
        split_turns=False,
        answer_turns="all",
        hold_out_eval=False,
        max_seq_len=200,
        max_prompt_tokens=120,
        batch_size=3,
    )
    base.update(over)
    return DatagenConfig(**base)


@pytest.fixture(scope="module")
def regenerated(tiny_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("turns")
    cfg = _config(tiny_target, _conversations_file(tmp / "convs.jsonl"), tmp)
    out = tmp / "answers.jsonl"
    lines: list[str] = []
    manifest = regenerate_conversations(cfg, out, "cpu", emit=lines.append)
    return cfg, out, manifest, lines


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_user_turn_is_answered_in_order(regenerated):
    _, out, manifest, _ = regenerated
    rows = _rows(out)
    assert len(rows) == len(CONVERSATIONS)
    by_first = {r["messages"][0]["content"]: r for r in rows}
    for turns in CONVERSATIONS:
        row = by_first[turns[0]]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == turns
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"] * len(turns)
        assert all("dataset answer" not in m["content"] for m in row["messages"])
        assert len(row["num_tokens"]) == len(turns) and all(1 <= n <= 8 for n in row["num_tokens"])
    assert manifest["turns_in"] == sum(map(len, CONVERSATIONS)) == manifest["answered"] + manifest["errors"]
    assert manifest["errors"] == 0 and manifest["lost"] == 0 and manifest["duplicated"] == 0
    assert json.loads(manifest_path(out).read_text())["answered"] == manifest["answered"]


def test_each_answer_is_the_targets_greedy_output_on_its_own_history(regenerated, tiny_target):
    """Turn 2 of a conversation is what the engine answers given turn 1 and the target's OWN turn-1 answer."""
    cfg, out, _, _ = regenerated
    row = next(r for r in _rows(out) if r["messages"][0]["content"] == CONVERSATIONS[0][0])
    engine = LLMEngine.from_config(EngineConfig(target=TargetConfig(model=str(tiny_target), dtype="fp32", device="cpu")))
    params = SamplingParams(max_tokens=cfg.generation.max_tokens)
    for turn in (0, 1):
        history = row["messages"][: 2 * turn + 1]
        again = engine.generate([history], params)[0]
        assert (
            engine.tokenizer.decode(again.token_ids, skip_special_tokens=True).strip() == row["messages"][2 * turn + 1]["content"]
        )


def test_overlong_prompts_are_cut_from_the_left_and_counted_not_dropped(regenerated):
    cfg, out, manifest, _ = regenerated
    rows = {r["messages"][0]["content"]: r for r in _rows(out)}
    assert rows[LONG]["truncated_turns"] >= 1  # its first turn alone is over the cap, and answered anyway
    assert manifest["truncated"] == sum(r["truncated_turns"] for r in rows.values()) >= 2
    assert rows["What is Parquet?"]["truncated_turns"] == 0


def test_rerun_resumes_and_writes_nothing_twice(regenerated):
    cfg, out, _, _ = regenerated
    before = out.read_bytes()
    manifest = regenerate_conversations(cfg, out, "cpu", emit=lambda s: None)
    assert out.read_bytes() == before and manifest["this_run"]["conversations"] == 0
    assert manifest["duplicated"] == 0 and manifest["lost"] == 0


def test_shards_split_the_conversations_without_overlap(tiny_target, tmp_path):
    cfg = _config(tiny_target, _conversations_file(tmp_path / "convs.jsonl"), tmp_path)
    outs = [tmp_path / f"part{i}.jsonl" for i in range(2)]
    for i, out in enumerate(outs):
        regenerate_conversations(cfg, out, "cpu", emit=lambda s: None, shard=(i, 2))
    ids = [{r["prompt_id"] for r in _rows(o)} if o.is_file() else set() for o in outs]
    assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == len(CONVERSATIONS)


def test_count_output_sees_lost_and_duplicated_turns(regenerated, tmp_path):
    """The read-back is what proves nothing was lost: drop a line, write one twice, and it says so."""
    _, out, _, _ = regenerated
    rows = out.read_text().splitlines()
    expected = {json.loads(r)["prompt_id"]: len(json.loads(r)["num_tokens"]) for r in rows}
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(rows[1:] + [rows[2]]) + "\n")
    counts = count_output(broken, expected)
    assert counts["lost"] == len(json.loads(rows[0])["num_tokens"])
    assert counts["duplicated"] == len(json.loads(rows[2])["num_tokens"])


def test_a_refused_turn_is_an_error_and_so_are_the_turns_after_it(tiny_target):
    """An engine whose KV cache cannot hold the long conversation's turn refuses it; the conversation's answered
    part is kept, the refused turn and the ones after it are errors, the other conversations finish."""
    engine = LLMEngine.from_config(
        EngineConfig(target=TargetConfig(model=str(tiny_target), dtype="fp32", device="cpu"), num_kv_blocks=6, block_size=16)
    )
    records = [
        make_record((Message("user", "hi"), Message("user", "again")), "test"),
        make_record((Message("user", "short"), Message("user", LONG)), "test"),
    ]
    done, errors = [], []
    run = TurnByTurn(engine, GenerationConfig(max_tokens=4), 400, concurrency=2, on_done=done.append, on_error=errors.append)
    with pytest.raises(Exception, match="max_model_len"):
        TurnByTurn(
            engine,
            GenerationConfig(max_tokens=4),
            engine.max_model_len,
            concurrency=2,
            on_done=done.append,
            on_error=errors.append,
        )
    stats = run.run(records)
    assert stats.turns_in == 4 and stats.answered == 3 and stats.errors == 1
    assert [(e.turn, e.kind) for e in errors] == [(1, "engine_refused")]
    assert "KV blocks" in errors[0].message
    partial = next(c for c in done if c.record.prompt_id == records[1].prompt_id)
    assert partial.turn == 1 and len(partial.history) == 2


def test_fit_prompt_drops_oldest_pairs_then_cuts_the_user_text(tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    tokenize = lambda msgs: list(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )  # noqa: E731
    rec = make_record((Message("system", "be brief"), Message("user", "one " * 40), Message("user", "two")), "test")
    conv = Conversation.of(rec)
    conv.history = [{"role": "user", "content": "one " * 40}, {"role": "assistant", "content": "answer " * 40}]
    conv.num_tokens = [40]
    ids, cut = fit_prompt(tokenize, tok, conv, 60)
    assert cut and len(ids) <= 60
    assert ids == tokenize([{"role": "system", "content": "be brief"}, {"role": "user", "content": "two"}])  # system kept
    conv.users[1] = "word " * 200
    ids, cut = fit_prompt(tokenize, tok, conv, 60)
    assert (
        cut
        and len(ids) <= 60
        and tok.decode(ids).rstrip().endswith(tok.decode(tokenize([{"role": "user", "content": "word"}])[-6:]).rstrip()[-10:])
    )
    conv.system = [{"role": "system", "content": "rule " * 200}]
    with pytest.raises(PromptTooLong, match="prompt cap 60"):
        fit_prompt(tokenize, tok, conv, 60)


def test_answer_turns_all_needs_whole_conversations_and_the_engine(tiny_target, tmp_path):
    prompts = _conversations_file(tmp_path / "c.jsonl")
    with pytest.raises((ConfigError, ValueError), match="answer_turns"):
        _config(tiny_target, prompts, tmp_path, split_turns=True)
    with pytest.raises((ConfigError, ValueError), match="answer_turns"):
        _config(tiny_target, prompts, tmp_path, backend="transformers")


def test_sampling_without_text_refuses_stop_strings():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    assert SamplingParams(detokenize=False).detokenize is False


def test_errors_file_is_written_next_to_the_output(regenerated):
    _, out, _, _ = regenerated
    assert errors_path(out).is_file() and errors_path(out).read_text() == ""
