from __future__ import annotations

import pytest

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine.block_manager import BlockManager
from eagleray.serve.engine.sampling import SamplingParams
from eagleray.serve.engine.sequence import Sequence


def _seq(n=3):
    return Sequence(list(range(n)), SamplingParams())


def test_alloc_grow_and_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = _seq(), _seq()
    bm.ensure(a, 5)
    assert len(a.block_table) == 2 and bm.num_free == 6
    bm.ensure(a, 8)  # still two blocks
    assert len(a.block_table) == 2
    bm.ensure(b, 9)
    assert len(b.block_table) == 3 and not set(a.block_table) & set(b.block_table)
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 5


def test_rollback_frees_rejected_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _seq()
    bm.ensure(s, 4 + 5)  # committed 4 positions + 5 speculative slots -> 3 blocks
    assert bm.truncate(s, 5) == 1  # 2 accepted: positions 0..4 -> 2 blocks kept
    assert len(s.block_table) == 2 and bm.num_free == 6
    assert bm.truncate(s, 5) == 0


def test_capacity_and_ownership_errors():
    bm = BlockManager(num_blocks=2, block_size=4)
    a, b = _seq(), _seq()
    assert not bm.can_ensure(a, 9)
    with pytest.raises(EaglerayError, match="num_kv_blocks"):
        bm.ensure(a, 9)
    bm.ensure(a, 4)
    b.block_table = list(a.block_table)
    with pytest.raises(EaglerayError, match="does not own"):
        bm.free(b)
