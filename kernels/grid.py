"""Index arithmetic of the Triton kernels' launch grids, shared by every kernel that splits an axis into blocks.

- :func:`program_range` (``@triton.jit``): the BLOCK consecutive indices a program owns along one grid axis,
  and which of them lie inside the axis.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def program_range(axis: tl.constexpr, BLOCK: tl.constexpr, n):
        """This program's indices along grid axis ``axis``, pid * BLOCK + [0, BLOCK), and their mask (< ``n``): [BLOCK] each."""
        i = tl.program_id(axis) * BLOCK + tl.arange(0, BLOCK)
        return i, i < n
