"""Building and loading the native CPU kernels of :mod:`eagleray.kernels.cpu_decode`.

The C sources (``cpu_decode.c``, the fused decoder layer ``cpu_layer.c``, a prefill's attention ``cpu_prefill.c``, their
shared header ``cpu_decode.h`` and the 16-lane vectors of ``cpu_simd.h``) are compiled once per machine with the system
C compiler into one library for the machine's instruction set (:func:`isa`): ``cc -O3 -mavx512f -mfma`` where the CPU
has AVX-512F, else ``-mavx2 -mfma`` where it has AVX2 and FMA (the same source: a vector is then two ymm halves).
``EAGLERAY_CPU_ISA=avx2`` builds and loads the AVX2 library on an AVX-512 machine too (tests, comparisons). The
library is ``$EAGLERAY_HOME/kernels/cpu_decode-<isa>-<hash of the sources>.so`` (a temporary file renamed into place,
so concurrent builders never load a partial library), opened with ctypes, its functions' signatures declared here.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform as std_platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from eagleray.kernels.errors import KernelBuildError

SOURCE = Path(__file__).with_name("cpu_decode.c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_layer.c"), SOURCE.with_name("cpu_prefill.c"))  # compiled together
HEADERS = (SOURCE.with_name("cpu_decode.h"), SOURCE.with_name("cpu_simd.h"))
ISA_FLAGS = {"avx512": ("-mavx512f", "-mfma"), "avx2": ("-mavx2", "-mfma")}  # best first
ISA_ENV = "EAGLERAY_CPU_ISA"


def open_library() -> ctypes.CDLL:
    """The compiled kernels (built first if this machine has none for this source), signatures declared."""
    reason = unsupported()
    if reason:
        fix = "" if "fix:" in reason else "\n    fix: set engine.cpu_kernels to 'torch' (or 'auto')"
        raise KernelBuildError(f"{reason}{fix}")
    path = library_path()
    if not path.exists():
        build(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise KernelBuildError(
            f"cannot load {path}: {err}\n    fix: delete it (it is rebuilt) or set engine.cpu_kernels to 'torch'"
        ) from err
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    lib.linear_packed_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int] * 2
    lib.linear_packed_f32.restype = None
    lib.argmax_rows_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.argmax_rows_f32.restype = None
    lib.linear_panel_cols.argtypes = []
    lib.linear_panel_cols.restype = ctypes.c_int64
    lib.paged_attention_f32.argtypes = (
        [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
    )
    lib.paged_attention_f32.restype = ctypes.c_int
    lib.decoder_layer_f32.argtypes = [ctypes.c_void_p] * 5
    lib.decoder_layer_f32.restype = ctypes.c_int
    lib.set_helper_spin.argtypes = [ctypes.c_int]
    lib.set_helper_spin.restype = ctypes.c_int
    lib.rms_norm_rows_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.rms_norm_rows_f32.restype = ctypes.c_int
    lib.rope_attention_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64]
    lib.rope_attention_f32.restype = ctypes.c_int
    lib.silu_mul_rows_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.silu_mul_rows_f32.restype = ctypes.c_int


def unsupported() -> str | None:
    """Why the native kernels cannot build or run here, or None."""
    try:
        isa()
    except KernelBuildError as err:
        return str(err)
    if compiler() is None:
        return "no C compiler (cc or gcc) on PATH to build kernels/cpu_decode.c"
    return None


def isa() -> str:
    """The instruction set the library is built for on this machine (:func:`choose_isa` of its CPU flags and
    ``$EAGLERAY_CPU_ISA``). Raises KernelBuildError naming what is missing."""
    if std_platform.machine() not in ("x86_64", "AMD64"):
        raise KernelBuildError(
            f"the native CPU kernels need x86-64 with AVX-512 or AVX2; this machine is {std_platform.machine()}"
        )
    return choose_isa(cpu_flags(), os.environ.get(ISA_ENV))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The words of /proc/cpuinfo (read once a process: the flags do not change)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError as err:
        raise KernelBuildError(f"cannot read /proc/cpuinfo to check for AVX-512 or AVX2 ({err})") from err


def choose_isa(flags: frozenset[str] | set[str], wanted: str | None) -> str:
    """The best of ``ISA_FLAGS`` that CPU ``flags`` (/proc/cpuinfo's words) allow, or ``wanted`` if they allow it."""
    have = [name for name, need in (("avx512", {"avx512f", "fma"}), ("avx2", {"avx2", "fma"})) if need <= flags]
    if wanted is not None:
        if wanted not in ISA_FLAGS:
            raise KernelBuildError(
                f"{ISA_ENV}={wanted!r} is not an instruction set of the native kernels\n"
                f"    fix: unset {ISA_ENV}, or set it to {' or '.join(ISA_FLAGS)}"
            )
        if wanted not in have:
            raise KernelBuildError(
                f"{ISA_ENV}={wanted}: this CPU lacks it (has: {', '.join(have) or 'neither'})\n    fix: unset {ISA_ENV}"
            )
        return wanted
    if not have:
        raise KernelBuildError("this CPU has neither AVX-512F nor AVX2 with FMA")
    return have[0]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path() -> Path:
    home = Path(os.environ.get("EAGLERAY_HOME") or Path.home() / ".cache" / "eagleray")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()[:16]
    return home / "kernels" / f"cpu_decode-{isa()}-{digest}.so"


def build(path: Path) -> None:
    """Compile into a temporary file, then rename (concurrent builders never see a partial library)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [compiler(), "-O3", *ISA_FLAGS[isa()], "-pthread", "-shared", "-fPIC", *map(str, SOURCES), "-o", tmp, "-lm"]
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as err:
            raise KernelBuildError(
                f"cannot run the C compiler ({' '.join(cmd)}): {err}\n    fix: install gcc, or set engine.cpu_kernels to 'torch'"
            ) from err
        if done.returncode != 0:
            raise KernelBuildError(
                f"building {', '.join(p.name for p in SOURCES)} failed: {' '.join(cmd)}\n{done.stderr.strip()[-2000:]}\n"
                "    fix: install gcc, or set engine.cpu_kernels to 'torch'"
            )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
