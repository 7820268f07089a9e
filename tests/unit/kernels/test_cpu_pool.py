"""The native kernels' thread pool under preemption: more helper threads than cores, jobs of alternating sizes back to
back. A helper woken late for a finished job used to claim a chunk of the next one with that job's size before it was
published, and ran a half-written job (SIGSEGV in plinear_chunk in a Serve replica under 72 requests; here about one
run in eight of 25 s before the fix). The run is a subprocess, so a crash fails the test instead of the test session."""

import subprocess
import sys

import pytest

from eagleray.kernels import cpu_decode_build

STRESS = """
import sys, time, torch
from eagleray.kernels import cpu_decode
cpu_decode.configure("native")
cpu_decode.set_threads(6)  # five helpers on a 2-core box: they are preempted mid-claim
torch.manual_seed(0)
ws = [torch.randn(48 * n, 64) for n in (2, 40, 3, 17)]  # 2, 40, 3 and 17 weight panels: chunk counts that alternate
xs = [torch.randn(1, 64), torch.randn(2, 64)]
first, calls, bad, end = {}, 0, 0, time.perf_counter() + float(sys.argv[1])
while time.perf_counter() < end:
    for i, w in enumerate(ws):
        for j, x in enumerate(xs):
            y = cpu_decode.linear(x, w, None)
            calls += 1
            if (i, j) not in first:
                first[(i, j)] = y.clone()
            elif not torch.equal(y, first[(i, j)]):
                bad += 1
print(calls, bad)
"""


@pytest.mark.skipif(cpu_decode_build.unsupported() is not None, reason=f"native kernels: {cpu_decode_build.unsupported()}")
def test_back_to_back_jobs_with_preempted_helpers_neither_crash_nor_mix():
    done = subprocess.run([sys.executable, "-c", STRESS, "8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the pool crashed (exit {done.returncode}): {done.stderr[-2000:]}"
    calls, bad = map(int, done.stdout.split()[-2:])
    assert calls > 10_000 and bad == 0, f"{bad} of {calls} results differ from the same call's first result"
