"""Loss mask: 1 exactly on the regenerated assistant turn (through its end-of-turn token)."""

import pytest

from eagleray.platform.prompts.template import prompt_ids, tokenize_with_mask
from eagleray.tests.support.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _masked_text(tok, t) -> str:
    return tok.decode([i for i, m in zip(t.input_ids, t.loss_mask) if m])


def test_single_turn_mask_covers_response_and_eos(tok):
    msgs = [{"role": "user", "content": "hello world"}]
    t = tokenize_with_mask(tok, msgs, "the quick brown fox", max_seq_len=512)
    p = len(prompt_ids(tok, msgs))
    assert t.loss_mask[:p] == [0] * p
    assert _masked_text(tok, t) == "the quick brown fox<|im_end|>"
    assert t.input_ids[p - 1 + sum(t.loss_mask)] == tok.eos_token_id  # last masked token is eos
    assert t.loss_mask[-1] == 0  # the template's trailing newline after <|im_end|>
    assert len(t.input_ids) == len(t.loss_mask) and not t.truncated


def test_multi_turn_only_last_assistant_turn_is_masked(tok):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "old answer"},
        {"role": "user", "content": "write code"},
    ]
    t = tokenize_with_mask(tok, msgs, "def add(a, b)", max_seq_len=512)
    assert _masked_text(tok, t) == "def add(a, b)<|im_end|>"
    assert "old answer" in tok.decode(t.input_ids)


def test_empty_response_masks_only_eos(tok):
    t = tokenize_with_mask(tok, [{"role": "user", "content": "hi"}], "", max_seq_len=512)
    assert sum(t.loss_mask) == 1 and _masked_text(tok, t) == "<|im_end|>"


def test_truncation(tok):
    t = tokenize_with_mask(tok, [{"role": "user", "content": "hello world " * 20}], "answer " * 20, max_seq_len=32)
    assert t.truncated and len(t.input_ids) == len(t.loss_mask) == 32


def _conversation(turns: int, words: int = 6) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        msgs += [
            {"role": "user", "content": f"question {i} " + "fox " * words},
            {"role": "assistant", "content": f"answer {i} " + "dog " * words},
        ]
    return msgs


def test_every_assistant_turn_is_masked_as_its_own_last_turn_would_be(tok):
    """The all-turns mask is the union of the single-answer masks of each assistant turn (same ids)."""
    from eagleray.platform.prompts.template import tokenize_conversation_with_mask

    msgs = _conversation(3)
    t = tokenize_conversation_with_mask(tok, msgs, max_seq_len=4096)
    union = [0] * len(t.input_ids)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            one = tokenize_with_mask(tok, msgs[:i], m["content"], max_seq_len=4096)
            assert t.input_ids[: len(one.input_ids)] == one.input_ids
            union = [a | b for a, b in zip(union, one.loss_mask + [0] * (len(union) - len(one.loss_mask)))]
    assert t.loss_mask == union and not t.truncated
    assert _masked_text(tok, t) == "".join(f"answer {i} " + "dog " * 6 + "<|im_end|>" for i in range(3))


def test_long_conversations_are_cut_before_tokenizing_with_the_same_result(tok, monkeypatch):
    """Only what max_seq_len tokens reach is tokenized; the result equals tokenizing everything (planted: the
    cut is checked, a too-short cut falls back to the whole text)."""
    from eagleray.platform.prompts import template

    msgs = _conversation(40, words=30)
    full = template.tokenize_conversation_with_mask(tok, msgs, max_seq_len=100_000)
    for n in (64, 300, 1000):
        cut = template.tokenize_conversation_with_mask(tok, msgs, max_seq_len=n)
        assert cut.input_ids == full.input_ids[:n] and cut.loss_mask == full.loss_mask[:n] and cut.truncated
    monkeypatch.setattr(template, "CHARS_PER_TOKEN_BOUND", 1)  # a cut far too short: the check must catch it
    short = template.tokenize_conversation_with_mask(tok, msgs, max_seq_len=300)
    assert short.input_ids == full.input_ids[:300] and short.loss_mask == full.loss_mask[:300] and short.truncated
    whole = template.tokenize_conversation_with_mask(tok, msgs, max_seq_len=len(full.input_ids))  # fell back, kept all
    assert whole.input_ids == full.input_ids and not whole.truncated


def test_an_opening_assistant_message_is_not_learned(tok):
    from eagleray.platform.prompts.template import tokenize_conversation_with_mask

    msgs = [{"role": "assistant", "content": "hello there"}] + _conversation(1)[1:]
    t = tokenize_conversation_with_mask(tok, msgs, max_seq_len=512)
    assert _masked_text(tok, t) == "answer 0 " + "dog " * 6 + "<|im_end|>"
