"""Tiny models shared by the engine tests (built once per session, 1 CPU thread)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

NUM_LAYERS = 4


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the CI box has 2 cores shared by several jobs


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from eagleray.tests.support.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("engine") / "target", num_layers=NUM_LAYERS)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="session")
def target(tiny_dir):
    """The tiny target with weights scaled up so greedy output varies (not one repeated token)."""
    from eagleray.platform.models.llama import LlamaModel

    model = LlamaModel.from_dir(tiny_dir, aux_layer_ids=[1, 2, NUM_LAYERS])
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    return model


@pytest.fixture(scope="session")
def random_draft(tiny_dir, target, tmp_path_factory):
    """An untrained EAGLE-3 draft (τ ≈ 1)."""
    from eagleray.platform.checkpoints.draft_factory import make_random_draft
    from eagleray.platform.checkpoints.target import TargetSpec
    from eagleray.platform.models.eagle3 import Eagle3Draft

    path = make_random_draft(
        TargetSpec.from_dir(tiny_dir), tmp_path_factory.mktemp("draft") / "random", aux_layer_ids=[1, 2, NUM_LAYERS]
    )
    return Eagle3Draft.from_checkpoint(path, target)


@pytest.fixture(scope="session")
def copy_draft(tiny_dir, target, tmp_path_factory):
    """A draft that replays the target's last distribution: fc picks the final pre-norm state, the layer is
    an identity (o_proj = down_proj = 0) and norm/lm_head are the target's. It is accepted often, which
    exercises acceptance, rollback and tree compaction."""
    from eagleray.platform.checkpoints.draft_factory import make_random_draft
    from eagleray.platform.checkpoints.target import TargetSpec
    from eagleray.platform.models.eagle3 import Eagle3Draft

    path = make_random_draft(
        TargetSpec.from_dir(tiny_dir), tmp_path_factory.mktemp("draft") / "copy", aux_layer_ids=[1, 2, NUM_LAYERS]
    )
    from eagleray.tests.support.tiny import make_copy_draft

    return make_copy_draft(Eagle3Draft.from_checkpoint(path, target), target, final_aux=2)


def make_engine(target, tokenizer, draft=None, *, k=3, tree=None, policy=None, **engine_kw):
    from eagleray.platform.config.schemas import DraftConfig, PolicyConfig, TreeConfig
    from eagleray.serve.engine import EngineConfig, LLMEngine

    dcfg = None
    if draft is not None:
        dcfg = DraftConfig(
            source="test",
            num_speculative_tokens=k,
            tree=TreeConfig(**tree) if tree else None,
            policy=PolicyConfig(**({"adaptive": False} | (policy or {}))),
        )
    return LLMEngine(target, tokenizer, EngineConfig(draft=dcfg, **engine_kw), draft)


PROMPTS = ["hello world", "def add(a, b):\n", "The quick brown fox jumps", "Ray Serve exposes an OpenAI compatible HTTP API"]
