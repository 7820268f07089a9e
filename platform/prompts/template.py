"""Chat-templated token ids and the loss mask of one prompt + regenerated response.

Loss mask (int8, one per token): 1 for the tokens of the regenerated assistant turn — from the
first token after the generation prompt (``<|im_start|>assistant\\n`` for ChatML) up to and
including the end-of-turn token (the tokenizer's eos) — and 0 for everything else: system and
user turns, earlier assistant turns of a multi-turn prompt (they were not regenerated), the
generation prompt itself and template text after the end-of-turn token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eagleray.platform.errors import EaglerayError


class RowError(EaglerayError):
    """One row cannot be processed; recorded in the errors table with ``kind``."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(message)


@dataclass
class Tokenized:
    input_ids: list[int]  # [T]
    loss_mask: list[int]  # [T], 0/1
    truncated: bool


def _ids(tok, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True)
    return list(out["input_ids"])


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of the prompt with the generation prompt appended."""
    return _ids(tok, messages, add_generation_prompt=True)


def tokenize_with_mask(tok, messages: list[dict], response: str, max_seq_len: int) -> Tokenized:
    """Template ``messages`` + the assistant ``response``; mask = the response's tokens (see module doc)."""
    prefix = prompt_ids(tok, messages)  # [P]
    full = _ids(tok, [*messages, {"role": "assistant", "content": response}], add_generation_prompt=False)  # [T]
    if full[: len(prefix)] != prefix:
        raise RowError(
            "template_mismatch",
            "the chat template of prompt+response does not start with the "
            "templated prompt, so the assistant tokens cannot be located",
        )
    end = len(full)
    eos = tok.eos_token_id
    if eos is not None:
        tail = full[len(prefix) :]
        if eos in tail:
            end = len(prefix) + tail.index(eos) + 1  # include the end-of-turn token
    mask = [0] * len(prefix) + [1] * (end - len(prefix)) + [0] * (len(full) - end)
    truncated = len(full) > max_seq_len
    return Tokenized(full[:max_seq_len], mask[:max_seq_len], truncated)


CHARS_PER_TOKEN_BOUND = 16  # text cut for tokenizing a long conversation: max_seq_len tokens fit in this many chars each
CUT_MARGIN = 64  # tokens past max_seq_len that must come out of the cut text, so the cut cannot change the kept ones


def tokenize_conversation_with_mask(tok, messages: list[dict], max_seq_len: int) -> Tokenized:
    """Template a whole conversation; mask = EVERY assistant message's tokens (each from after its generation
    prompt through its end-of-turn token), for conversations whose every answer the target wrote itself
    (turn-by-turn regeneration, :mod:`eagleray.datagen.turns`).

    The conversation is tokenized once; each assistant message's span is found in the rendered text (the
    template of the messages before it with the generation prompt, and of the messages through it, must be
    prefixes of the whole) and mapped to tokens by their character offsets. Only what the first
    ``max_seq_len`` tokens can reach is rendered and tokenized (a long conversation costs no more than a
    short one); the cut is checked: it must leave ``CUT_MARGIN`` tokens beyond those kept, else the whole text
    is tokenized.
    """
    render = lambda msgs, gen: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    text = render(messages, False)
    budget = (max_seq_len + CUT_MARGIN) * CHARS_PER_TOKEN_BOUND
    cut = len(text) > budget
    enc = tok(text[:budget], add_special_tokens=False, return_offsets_mapping=True)
    if cut and len(enc["input_ids"]) < max_seq_len + CUT_MARGIN:  # the cut may reach into kept tokens: no cut
        cut, enc = False, tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"][:max_seq_len])  # [T]
    starts = np.asarray([a for a, _ in enc["offset_mapping"][:max_seq_len]], dtype=np.int64)  # [T] first char of each token
    reach = int(starts[-1]) if len(starts) else 0
    eos = tok.eos_token or ""
    bounds = []  # sorted, disjoint [start, end) character spans of the learned assistant tokens
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:  # an opening assistant message answers no prompt: not learned
            continue
        before = render(messages[:i], True)
        if len(before) > reach:
            break  # this answer starts after the last kept token
        through = render(messages[: i + 1], False)
        if not (text.startswith(through) and through.startswith(before)):
            raise RowError(
                "template_mismatch",
                f"the chat template of messages[:{i + 1}] is not a prefix of the whole conversation's, so the "
                f"assistant tokens of message {i} cannot be located",
            )
        end = through.rfind(eos, len(before)) if eos else -1
        bounds += [len(before), end + len(eos) if end >= 0 else len(through)]
    inside = np.searchsorted(np.asarray(bounds, dtype=np.int64), starts, side="right") % 2 == 1  # [T]
    return Tokenized(ids, inside.astype(int).tolist(), cut or len(enc["input_ids"]) > max_seq_len)
