"""Incremental detokenization of a step's sequences in one batched decode: the same text and deltas as one decode a
sequence, a stop string still finishes its sequence, and the tokenizer's per-call overhead is paid once a step."""

from __future__ import annotations

import random

from eagleray.serve.engine import SamplingParams
from eagleray.serve.engine.outputs import Detokenizer
from eagleray.serve.engine.sequence import Sequence

TEXTS = ["Ray Serve exposes an OpenAI compatible HTTP API", "def add(a, b):\n    return a + b", "héllo wörld — ünïcode"]


def _sequences(tokenizer, stop=None):
    params = SamplingParams(max_tokens=64, stop=stop or [])
    return [Sequence([1], params) for _ in TEXTS], [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def test_a_batched_step_streams_what_one_decode_a_sequence_streams(tokenizer, monkeypatch):
    many_seqs, ids = _sequences(tokenizer)
    one_seqs, _ = _sequences(tokenizer)
    many, one = Detokenizer(tokenizer), Detokenizer(tokenizer)
    calls = []
    real_decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **kw: calls.append(1) or real_decode(*a, **kw))
    rng, steps = random.Random(0), 0
    while any(len(s.output_token_ids) < len(t) for s, t in zip(many_seqs, ids)):
        for a, b, t in zip(many_seqs, one_seqs, ids):
            more = t[len(a.output_token_ids) : len(a.output_token_ids) + rng.randint(1, 3)]  # 1-3 tokens a step
            a.output_token_ids += more
            b.output_token_ids += more
        before = len(calls)
        got = many.update_many(many_seqs)
        assert len(calls) == before, "a step's windows are decoded in one batch call, not one decode each"
        assert got == [one.update(s) for s in one_seqs]
        steps += 1
    assert steps > 5
    for seq, t in zip(many_seqs, ids):
        seq.finish_reason = "length"
        assert many.update_many([seq])[0][0] == tokenizer.decode(t, skip_special_tokens=True)


def test_a_stop_string_finishes_its_sequence_in_a_batched_step(tokenizer):
    seqs, ids = _sequences(tokenizer, stop=["compatible"])
    detok = Detokenizer(tokenizer)
    for seq, t in zip(seqs, ids):
        seq.output_token_ids += t
    texts = detok.update_many(seqs)
    assert seqs[0].finish_reason == "stop" and texts[0][0] == "Ray Serve exposes an OpenAI "
    assert [s.finish_reason for s in seqs[1:]] == [None, None]
    assert detok.update_many(seqs[:1]) == [(texts[0][0], "")]  # stopped: nothing more
