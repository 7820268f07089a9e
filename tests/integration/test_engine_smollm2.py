"""SmolLM2-135M (fp32) with an untrained EAGLE-3 draft: speculative greedy output equals plain greedy
output token for token on MT-bench prompts, chain and tree; the watchdog sees τ = 1."""

from __future__ import annotations

import pytest
import torch

from eagleray.platform.config.schemas import DraftConfig, PolicyConfig, TargetConfig, TreeConfig
from eagleray.platform.prompts import load_prompts
from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams

PARAMS = SamplingParams(max_tokens=24)
POLICY = PolicyConfig(adaptive=False, watchdog_window=8)


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_fp32):
    from eagleray.serve.engine import load_models

    torch.set_num_threads(1)  # several threads thrash on the shared 2-core box
    target, draft, tok, _ = load_models(TargetConfig(), DraftConfig(source="random"), tmp_path_factory.mktemp("draft"))
    prompts = [[m.to_dict() for m in r.messages] for r in load_prompts("mtbench", limit=2)]
    plain = LLMEngine(target, tok, EngineConfig(max_num_seqs=2)).generate(prompts, PARAMS)
    return target, draft, tok, prompts, plain


@pytest.mark.parametrize(
    "draft_cfg",
    [
        DraftConfig(source="random", num_speculative_tokens=3, policy=POLICY),
        DraftConfig(source="random", tree=TreeConfig(depth=3, topk=2, num_draft_tokens=4), policy=POLICY),
    ],
    ids=["chain", "tree"],
)
def test_smollm2_lossless(smol, draft_cfg):
    target, draft, tok, prompts, plain = smol
    engine = LLMEngine(target, tok, EngineConfig(draft=draft_cfg, max_num_seqs=2), draft)
    outs = engine.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.text for o in outs)
    snap = engine.metrics.snapshot()
    assert snap["spec_decode_num_drafts"] > 0 and snap["spec_decode_watchdog_fired"] == 1
