"""eagleray: EAGLE-3 speculative decoding on Ray.

The repository root is the ``eagleray`` package; its top-level folders (``platform``,
``kernels``, ``serve``, ``datagen``, ``training``, ``jobs``) are namespace subpackages
(no ``__init__.py``) so that ``platform/`` never shadows the standard library's ``platform``.
"""

import os

__version__ = "0.1.0"

__all__ = ["__version__"]

# GNU OpenMP (PyTorch's CPU threads) reads GOMP_SPINCOUNT once, when torch loads it: 0 makes its worker threads sleep
# as soon as a parallel region ends instead of spinning for ~3 ms. A CPU engine interleaves oneDNN's GEMMs (OpenMP)
# with its native kernels (a thread pool of their own); a spinning OpenMP worker takes a core from them: a prefill of
# 8 prompts 1.57 -> 1.42 s, its attention 190 -> 90 ms (BENCHMARKS.md). A value already set wins, and it does
# nothing where torch was imported before eagleray. EAGLERAY_SET_GOMP_SPINCOUNT says the value is eagleray's (a
# benchmark starts a peer server without it).
if "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "0"
    os.environ["EAGLERAY_SET_GOMP_SPINCOUNT"] = "1"
