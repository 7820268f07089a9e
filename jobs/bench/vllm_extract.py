"""Copy vLLM's verification kernels out of the installed vllm(-cpu) package for benchmarking.

vLLM is not a dependency of eagleray and its code is never committed here: at bench time this
writes into the git-ignored folder `.vllm_kernels/`, which the device `run` tool carries to the GPU
machine (torch + triton, no vllm there):

- `vllm_v1_kernels.py`: the three @triton.jit kernels of vllm/v1/sample/rejection_sampler.py
  (greedy, random, recovered), cut out with `ast`, under a triton-only header.
- `vllm/...`: a minimal package tree holding the MRV2 logits-in sampler
  (vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py) and the modules it imports, with a
  stub `vllm.triton_utils`. Put `.vllm_kernels` first on sys.path to import it.

Usage: python -m eagleray.jobs.bench.vllm_extract [--src SITE_PACKAGES_VLLM] [--dst .vllm_kernels]
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import shutil

V1_KERNELS = ("rejection_greedy_sample_kernel", "rejection_random_sample_kernel", "sample_recovered_tokens_kernel")
MRV2_FILES = (
    "v1/worker/gpu/spec_decode/rejection_sampler_utils.py",
    "v1/worker/gpu/sample/gumbel.py",
    "v1/worker/gpu/sample/watermark.py",
    "v1/watermarking/prfs/philox.py",
    "v1/watermarking/prfs/base.py",
)
TRITON_UTILS_STUB = (
    "import triton\nimport triton.language as tl\nimport triton.language.extra.libdevice as tldevice\nHAS_TRITON = True\n"
)


def _default_src() -> pathlib.Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vllm is not installed here: pass --src path/to/site-packages/vllm")
    return pathlib.Path(spec.origin).parent


def extract_v1(src: pathlib.Path, dst: pathlib.Path) -> None:
    text = (src / "v1/sample/rejection_sampler.py").read_text()
    lines = text.splitlines()
    parts = [
        "# Extracted from vllm/v1/sample/rejection_sampler.py at bench time. Do not commit.",
        "import torch",
        "import triton",
        "import triton.language as tl",
        "",
    ]
    found = set()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name in V1_KERNELS:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            parts.append("\n".join(lines[start - 1 : node.end_lineno]) + "\n\n")
            found.add(node.name)
    if found != set(V1_KERNELS):
        raise SystemExit(f"vLLM v1 kernels not found: {sorted(set(V1_KERNELS) - found)}")
    (dst / "vllm_v1_kernels.py").write_text("\n".join(parts))


def extract_mrv2(src: pathlib.Path, dst: pathlib.Path) -> None:
    root = dst / "vllm"
    for rel in MRV2_FILES:
        out = root / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, out)
    (root / "triton_utils").mkdir(parents=True, exist_ok=True)
    (root / "triton_utils" / "__init__.py").write_text(TRITON_UTILS_STUB)
    for pkg in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text("")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=pathlib.Path, default=None, help="path of the installed vllm package")
    ap.add_argument("--dst", type=pathlib.Path, default=pathlib.Path(".vllm_kernels"), help="output folder (git-ignored)")
    args = ap.parse_args(argv)
    src = args.src or _default_src()
    args.dst.mkdir(parents=True, exist_ok=True)
    extract_v1(src, args.dst)
    extract_mrv2(src, args.dst)
    print(f"wrote vLLM kernels from {src} to {args.dst}")


if __name__ == "__main__":
    main()
