"""The native CPU kernels' instruction sets (kernels/cpu_simd.h): which one a CPU gets, the EAGLERAY_CPU_ISA override
and its errors, both builds compiling, and the AVX2 build against the references on a machine whose default is
AVX-512 (on an AVX2 machine the whole kernel suite runs on it already)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagleray.kernels import cpu_decode_build as build
from eagleray.kernels.errors import KernelBuildError

AVX512 = {"avx512f", "avx2", "fma", "sse4_2"}
AVX2 = {"avx2", "fma", "sse4_2"}


def test_a_cpu_gets_its_best_instruction_set():
    assert build.choose_isa(AVX512, None) == "avx512"
    assert build.choose_isa(AVX2, None) == "avx2"


def test_a_cpu_without_fma_or_avx2_gets_no_native_kernels():
    with pytest.raises(KernelBuildError, match="neither AVX-512F nor AVX2 with FMA"):
        build.choose_isa({"avx2", "sse4_2"}, None)  # AVX2 without FMA
    with pytest.raises(KernelBuildError, match="neither"):
        build.choose_isa({"avx", "sse4_2"}, None)


def test_the_override_picks_avx2_on_an_avx512_cpu():
    assert build.choose_isa(AVX512, "avx2") == "avx2"


def test_the_override_refuses_an_instruction_set_the_cpu_lacks_naming_the_variable():
    with pytest.raises(KernelBuildError, match=r"EAGLERAY_CPU_ISA=avx512: this CPU lacks it \(has: avx2\)") as err:
        build.choose_isa(AVX2, "avx512")
    assert "fix: unset EAGLERAY_CPU_ISA" in str(err.value)


def test_the_override_refuses_an_unknown_name():
    with pytest.raises(KernelBuildError, match="'sse4' is not an instruction set") as err:
        build.choose_isa(AVX512, "sse4")
    assert "set it to avx512 or avx2" in str(err.value)


@pytest.mark.skipif(build.unsupported() is not None, reason=f"native CPU kernels: {build.unsupported()}")
def test_the_override_reaches_the_library_and_its_error_keeps_its_fix(monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    assert build.library_path().name.startswith("cpu_decode-avx2-")
    monkeypatch.setenv(build.ISA_ENV, "neon")
    assert "is not an instruction set" in build.unsupported()
    with pytest.raises(KernelBuildError) as err:
        build.open_library()
    assert "fix: unset EAGLERAY_CPU_ISA" in str(err.value) and "cpu_kernels" not in str(err.value)


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("isa", sorted(build.ISA_FLAGS))
def test_every_instruction_set_compiles(isa, tmp_path):
    """Both builds compile wherever the tests run (only the CPU's own can run: the AVX2 test below, or the suite)."""
    for src in build.SOURCES:
        cmd = [build.compiler(), "-O1", *build.ISA_FLAGS[isa], "-Wall", "-Werror", "-c", str(src), "-o", str(tmp_path / "x.o")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-3000:]}"


@pytest.mark.skipif(build.unsupported() is not None, reason=f"native CPU kernels: {build.unsupported()}")
def test_the_avx2_build_passes_the_kernel_suite_on_an_avx512_cpu(tmp_path):
    if build.choose_isa(build.cpu_flags(), None) != "avx512":
        pytest.skip("this CPU's default build is AVX2: the kernel suite runs on it already")
    here = Path(__file__).parent
    env = {**os.environ, build.ISA_ENV: "avx2", "EAGLERAY_HOME": str(tmp_path)}
    files = [str(here / f) for f in ("test_cpu_decode.py", "test_cpu_layer.py", "test_cpu_prefill.py")]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *files],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert list((tmp_path / "kernels").glob("cpu_decode-avx2-*.so")), "the suite ran on the AVX2 library"
