"""What the Triton interpreter's arithmetic lets a CPU test compare bit for bit."""

from __future__ import annotations

import functools

import numpy as np
import pytest


@functools.cache
def numpy_rows_invariant() -> bool:
    """Whether ``np.matmul`` (the interpreter's ``tl.dot``) gives a row the same bits at every index of a 16-row block.
    Not on every CPU: with OpenBLAS's Haswell kernels (an AVX2-only EPYC) rows 6-15 differ from rows 0-5 in the last
    bit, so an interpreted kernel's result for a row depends on where the row sits in its tile there."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    x = rng.standard_normal(64).astype(np.float32)
    rows = []
    for i in range(16):
        a = np.zeros((16, 64), np.float32)
        a[i] = x
        rows.append(np.matmul(a, w)[i])
    return all(np.array_equal(r, rows[0]) for r in rows)


row_invariant_numpy = pytest.mark.skipif(
    not numpy_rows_invariant(),
    reason="numpy's matmul on this CPU is not row-index invariant (OpenBLAS Haswell kernels): interpreted kernels "
    "cannot show bitwise row invariance here; tests/gpu shows it for the compiled kernels",
)
