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
