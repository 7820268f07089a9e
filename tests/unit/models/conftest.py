"""Tiny random HF checkpoints (Llama, Mistral, Qwen2, Qwen3) built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=1,
    pad_token_id=0,
)

VARIANTS: dict[str, tuple[str, dict]] = {
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_untied_mha": ("llama", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "llama3_rope": (
        "llama",
        dict(
            tie_word_embeddings=False,
            max_position_embeddings=8192,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama_linear_rope_bias": (
        "llama",
        dict(attention_bias=True, mlp_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ),
    "mistral_window": ("mistral", dict(tie_word_embeddings=False, sliding_window=5, head_dim=16)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "llama_odd_vocab": ("llama", dict(tie_word_embeddings=False, vocab_size=97)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, head_dim=32)),
}


def _config(kind: str, overrides: dict):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    return cls(**{**SMALL, **overrides})


def write_tiny(out: Path, kind: str, overrides: dict, seed: int = 0) -> Path:
    """Save a random transformers model of ``kind`` (fp32) to ``out``; biases/norms randomised too."""
    from transformers import AutoModelForCausalLM

    from eagleray.tests.support.tiny import tiny_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(kind, overrides)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # make biases and norm weights matter
    model.save_pretrained(str(out), safe_serialization=True)
    tiny_tokenizer().save_pretrained(str(out))  # drafts record the tokenizer fingerprint
    return out


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """name -> HF directory for every entry of :data:`VARIANTS`, built lazily."""
    root = tmp_path_factory.mktemp("tiny_models")

    class Lazy(dict):
        def __missing__(self, name: str) -> Path:
            kind, overrides = VARIANTS[name]
            self[name] = write_tiny(root / name, kind, overrides)
            return self[name]

    return Lazy()


def hf_reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_model():
    """path -> transformers model (fp32), cached."""
    cache: dict[Path, object] = {}

    def get(path: Path):
        if path not in cache:
            cache[path] = hf_reference(path)
        return cache[path]

    return get


@pytest.fixture
def native():
    """The native CPU kernels forced on for the test (the process's setting restored after)."""
    from eagleray.kernels import cpu_decode

    before = cpu_decode.status()
    cpu_decode.configure("native")
    yield
    cpu_decode.configure("auto" if before == "native" else "torch")
