"""The eagleray datagen backend (LLMEngine) gives the same greedy responses as transformers (fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from eagleray.datagen.backends import EagleRayGenerator, TransformersGenerator, make_generator
from eagleray.platform.config.schemas import DatagenConfig, GenerationConfig
from eagleray.tests.support.datagen import FIXTURE, datagen_config

GEN = GenerationConfig(max_tokens=12)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def conversations() -> list[list[dict]]:
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()[:4]]
    return [r["messages"] for r in rows]


@pytest.fixture(scope="module")
def hf_responses(tiny_target, conversations):
    return TransformersGenerator(str(tiny_target)).generate(conversations, GEN, seed=0)


@pytest.mark.parametrize("draft", [None, {"source": "random", "num_speculative_tokens": 3}], ids=["plain", "spec"])
def test_eagleray_greedy_equals_transformers(tiny_target, tmp_path, conversations, hf_responses, draft):
    cfg = DatagenConfig(**datagen_config(tiny_target, FIXTURE, tmp_path / "o", backend="eagleray", draft=draft))
    gen = make_generator(cfg, str(tiny_target), "cpu")
    assert isinstance(gen, EagleRayGenerator)
    try:
        ours = gen.generate(conversations, GEN, seed=0)
    finally:
        gen.close()
    assert [(g.text, g.num_tokens) for g in ours] == [(g.text, g.num_tokens) for g in hf_responses]
    assert any(g.num_tokens > 1 for g in ours)


def test_eagleray_is_the_default_backend():
    assert DatagenConfig(prompts=["mtbench"], output_dir="x").backend == "eagleray"
