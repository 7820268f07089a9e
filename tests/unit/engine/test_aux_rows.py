"""The draft's queued aux rows: steps hand sequences row ranges by reference; the catch-up joins them once."""

from __future__ import annotations

import torch

from eagleray.serve.engine.sampling import SamplingParams
from eagleray.serve.engine.sequence import AuxRows, Sequence, gather_aux


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
    assert a.pending_aux == [] and b.pending_aux == []  # emptied


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
