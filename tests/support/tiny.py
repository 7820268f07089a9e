"""Tiny random Llama targets for tests: a real HF directory (config, safetensors, tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagleray.platform.paths import atomic_dir

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "Ray Serve exposes an OpenAI compatible HTTP API; MLflow tracks runs and models.",
    "user assistant system hello world answer question explain write code",
]


def tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a few sentences, with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_llama(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 8,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_positions: int = 512,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a randomly initialised Llama (transformers' own implementation) with a real tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    rope = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
    return out


def zero_tensor(model_dir: str | Path, key: str) -> None:
    """Zero the tensor ``key`` in place in the safetensors of ``model_dir`` (e.g. a norm weight: constant outputs)."""
    from safetensors.torch import load_file, save_file

    for f in Path(model_dir).glob("*.safetensors"):
        tensors = load_file(str(f))
        if key in tensors:
            tensors[key] = torch.zeros_like(tensors[key])
            save_file(tensors, str(f), metadata={"format": "pt"})
            return
    raise KeyError(f"{key} not in {model_dir}")


def scaled_copy(src: str | Path, dst: str | Path, factor: float = 6.0) -> Path:
    """Copy of a model directory with every 2-D weight times ``factor``.

    Larger weights give peaked logits, so tests comparing runs with different reduction orders
    (TP=2 vs TP=1) cannot see an argmax flip on a near-tie.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    out = Path(dst)
    shutil.copytree(src, out)
    for f in out.glob("*.safetensors"):
        tensors = {k: (v * factor if v.dim() == 2 else v).contiguous() for k, v in load_file(str(f)).items()}
        save_file(tensors, str(f), metadata={"format": "pt"})
    return out


def make_copy_draft(draft, target, final_aux: int):
    """Turn ``draft`` into one that replays ``target``'s next-token distribution, so it is accepted often: fc picks
    the aux state number ``final_aux`` (the target's final pre-norm state), the layer is an identity (o_proj =
    down_proj = 0), norm and lm_head are the target's. Returns ``draft``."""
    h = target.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, final_aux * h : (final_aux + 1) * h] = torch.eye(h)
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.norm.weight.copy_(target.norm.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    return draft
