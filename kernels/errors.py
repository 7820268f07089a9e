"""Errors raised by the kernel wrappers.

`kernels` sits at the bottom of the import graph (kernels <- platform), so it cannot reuse
`eagleray.platform.errors`; this is its own small hierarchy. Every message names the argument,
what was expected, what was got, and the fix.
"""

from __future__ import annotations


class KernelInputError(ValueError):
    """An argument of a kernel has the wrong shape, dtype, stride or device."""

    def __init__(self, arg: str, expected: str, got: str, fix: str) -> None:
        self.arg = arg
        self.expected = expected
        self.got = got
        self.fix = fix
        super().__init__(f"{arg}: expected {expected}, got {got}. Fix: {fix}")


class VerifyInputError(KernelInputError):
    """An argument of a verification kernel has the wrong shape, dtype, stride or device."""


def no_triton(op: str) -> KernelInputError:
    """What a Triton kernel's wrapper raises where the triton package is missing: the fix names its reference."""
    return KernelInputError(f"{op}: triton", "the triton package", "none installed", f"pip install triton, or use {op}_reference")


class KernelBuildError(RuntimeError):
    """A native kernel cannot be built or loaded on this machine (the message says why and what to do)."""
