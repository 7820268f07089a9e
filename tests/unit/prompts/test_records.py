"""PromptRecord ids, prompt_turns splitting and dedup."""

from __future__ import annotations

import pytest

from eagleray.platform.prompts import Message, dedup, make_record, prompt_id_for, prompt_turns

CONVERSATION = (
    Message("system", "Be brief."),
    Message("user", "Hi"),
    Message("assistant", "Hello!"),
    Message("user", "What is 2+2?"),
    Message("assistant", "4"),
)


def test_prompt_id_is_a_stable_content_hash() -> None:
    # Pinned: changing the canonical form would orphan every dataset already written.
    # printf '%s' '[{"content":"Hi","role":"user"}]' | sha256sum | cut -c1-24
    assert prompt_id_for([Message("user", "Hi")]) == "557f6d9586f57ae72d24a7d3"
    a = make_record(CONVERSATION, "a.jsonl", {"x": 1})
    b = make_record(list(CONVERSATION), "other.parquet")
    assert a.prompt_id == b.prompt_id and len(a.prompt_id) == 24
    assert a.prompt_id != make_record(CONVERSATION[:2], "a.jsonl").prompt_id


@pytest.mark.parametrize(
    "other", [[Message("user", "Hi ")], [Message("system", "Hi")], [Message("user", "H"), Message("user", "i")]]
)
def test_prompt_id_changes_with_content(other: list[Message]) -> None:
    assert prompt_id_for(other) != prompt_id_for([Message("user", "Hi")])


def test_message_rejects_unknown_role() -> None:
    with pytest.raises(ValueError, match="human"):
        Message("human", "hi")


def test_prompt_turns_one_prompt_per_assistant_turn() -> None:
    rec = make_record(CONVERSATION, "s", {"id": "c1"})
    turns = list(prompt_turns(rec))
    assert [len(t.messages) for t in turns] == [2, 4]
    assert turns[0].messages == CONVERSATION[:2]
    assert turns[1].messages[-1] == Message("user", "What is 2+2?")
    assert turns[0].prompt_id == prompt_id_for(CONVERSATION[:2])
    assert turns[1].meta == {"id": "c1", "turn": 4, "parent_id": rec.prompt_id}
    assert all(t.source == "s" for t in turns)


def test_prompt_turns_pending_user_turn_and_plain_prompt() -> None:
    pending = make_record(CONVERSATION + (Message("user", "And 3+3?"),), "s")
    assert [len(t.messages) for t in prompt_turns(pending)] == [2, 4, 6]
    plain = make_record([Message("user", "Hi")], "s")
    (only,) = prompt_turns(plain)
    assert only.prompt_id == plain.prompt_id and only.messages == plain.messages


def test_prompt_turns_skips_answers_without_a_question() -> None:
    # ShareGPT continuation parts start with an assistant turn; two answers in a row also occur.
    rec = make_record(
        [Message("assistant", "...cont"), Message("user", "q"), Message("assistant", "a"), Message("assistant", "b")], "s"
    )
    assert [len(t.messages) for t in prompt_turns(rec)] == [2]


def test_dedup_keeps_first_occurrence_in_order() -> None:
    a = make_record([Message("user", "a")], "one")
    b = make_record([Message("user", "b")], "one")
    a2 = make_record([Message("user", "a")], "two")
    out = dedup([a, b, a2, b])
    assert out == [a, b] and out[0].source == "one"
