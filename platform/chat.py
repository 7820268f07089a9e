"""A single greedy chat answer with transformers (the engine replaces this for serving)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagleray.platform.errors import EaglerayError


def chat_once(model_dir: Path, prompt: str, *, max_tokens: int = 128, system: str | None = None) -> str:
    """Greedy answer of the model in ``model_dir`` to one user ``prompt`` using its chat template."""
    if not prompt.strip():
        raise EaglerayError("prompt is empty\n    fix: pass a non-empty user message")
    if max_tokens < 1:
        raise EaglerayError(f"max_tokens={max_tokens} must be >= 1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
