"""``eagleray chat --target smollm2 "prompt"``: one greedy chat answer from the real model.

It runs transformers' ``generate`` (a check that a target directory loads and chats, independent
of eagleray's engine; serving uses the engine).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eagleray.platform.checkpoints.target import TargetSpec, resolve_target
from eagleray.platform.errors import EaglerayError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message")
    p.add_argument("--target", default="smollm2", help="target model directory, or 'smollm2'")
    p.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens")
    p.add_argument("--system", default=None, help="optional system message")


def run(args: argparse.Namespace) -> int:
    target = TargetSpec.from_dir(resolve_target(args.target))  # clear error for a bad directory
    print(chat_once(target.path, args.prompt, max_tokens=args.max_tokens, system=args.system))
    return 0


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
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
