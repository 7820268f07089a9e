"""The draft's queued aux rows: steps hand sequences row ranges by reference; the catch-up joins them once."""

from __future__ import annotations

import gc

import torch

from eagleray.serve.engine.sampling import SamplingParams
from eagleray.serve.engine.sequence import AuxRows, Sequence, gather_aux

from .conftest import PROMPTS, make_engine


def _seq(capture: bool = False) -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(capture_states=capture))


def test_gather_joins_each_sequences_rows_in_position_order_across_steps():
    prefill = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)  # [5, 3]: a 2-token and a 3-token prompt
    plain = 100 + torch.arange(2 * 3, dtype=torch.float32).view(2, 3)  # [2, 3]: one row a sequence
    spec = 200 + torch.arange(6 * 3, dtype=torch.float32).view(6, 3)  # [6, 3]: k+1 = 3 rows a sequence
    a, b = _seq(), _seq()
    for s, part in zip((a, b), AuxRows.split(prefill, [2, 3])):
        s.append_aux(part)
    for s, part in zip((a, b), AuxRows.split(plain, [1, 1])):
        s.append_aux(part)
    a.append_aux(AuxRows(spec, 0, 3).head(2))  # a accepted one draft: 2 rows
    b.append_aux(AuxRows(spec, 3, 3).head(1))  # b accepted none
    aux, counts = gather_aux([a, b])
    want = torch.cat([prefill[:2], plain[:1], spec[0:2], prefill[2:], plain[1:], spec[3:4]])
    assert counts == [5, 5]
    torch.testing.assert_close(aux, want, rtol=0, atol=0)
    assert len(a.pending_aux) == 0 and len(b.pending_aux) == 0  # emptied


def test_gather_drops_the_captured_final_state_columns():
    rows = torch.arange(4 * 5, dtype=torch.float32).view(4, 5)  # [4, A=3 + H=2]
    a = _seq()
    a.append_aux(AuxRows(rows, 1, 2))
    aux, _ = gather_aux([a], extra=2)
    torch.testing.assert_close(aux, rows[1:3, :3], rtol=0, atol=0)


def test_a_whole_single_step_is_returned_without_a_copy_and_a_captured_sequence_keeps_its_own_copy():
    rows = torch.randn(2, 4)
    a, b = _seq(capture=True), _seq()
    for s, part in zip((a, b), AuxRows.split(rows, [1, 1])):
        s.append_aux(part)
    aux, _ = gather_aux([a, b])
    assert aux.data_ptr() == rows.data_ptr()
    rows.zero_()  # the step's buffer is reused ...
    assert a.captured[0].abs().sum() > 0  # ... the capture copied its rows


def test_plain_steps_of_a_speculative_engine_queue_rows_without_an_object_per_sequence(target, tokenizer, random_draft):
    """A speculative engine's plain steps queue each sequence's aux row until the next speculative step; the queue
    must not keep a tracked object per sequence and step (AuxRows did: on the H200 at 64 sequences they set off a
    young collection every ~2 steps and, once, a 273 ms full one)."""
    engine = make_engine(target, tokenizer, random_draft, k=3)
    engine.policy.disable("plain steps only")  # the draft stays installed: its aux rows are queued
    for p in PROMPTS * 2:
        engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):  # the prefill and the first decode steps
        engine.step()
    seqs = list(engine.scheduler.running)
    queued = [len(s.pending_aux) for s in seqs]
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            engine.step()
        kept = sum(type(o) is AuxRows for o in gc.get_objects())
    finally:
        gc.enable()
    assert engine.metrics.speculative.steps == 0 and len(seqs) == 8
    assert [len(s.pending_aux) for s in seqs] == [q + 20 for q in queued]  # every plain step's row is queued
    assert kept == 0  # ... and none as an object of its own
    aux, counts = gather_aux(seqs)
    assert counts == [s.num_cached - s.draft_cached for s in seqs] and aux.shape[0] == sum(counts)


def test_a_plain_engine_queues_no_aux_rows_though_its_target_computes_them(target, tokenizer):
    """The shared target captures aux layers; without a draft nothing reads them, so a plain step must not queue them
    (each queued row keeps its step's whole aux tensor alive for the sequence's life)."""
    engine = make_engine(target, tokenizer)
    assert target.aux_layer_ids  # the rows are computed ...
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # prefill
    seqs = list(engine.scheduler.running)
    for _ in range(3):
        engine.step()
    assert all(s.num_cached > len(s.prompt_token_ids) for s in seqs)
    assert [len(s.pending_aux) for s in seqs] == [0] * len(seqs)  # ... and not queued
