"""On a CUDA GPU: the engine's greedy speculative chain steps on the step graphs (drafting and verification
captured per batch bucket and k, the verify kernel inside the graph) give plain greedy output token for token
in bf16 (marker `gpu`; run with EAGLERAY_TEST_GPU=1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagleray.platform.checkpoints.draft_factory import eagle3_config
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.config.schemas import DraftConfig, PolicyConfig
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.llama import LlamaModel
from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams
from eagleray.tests.support.tiny import make_copy_draft

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3, rope_theta=10000.0)
CFG |= dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=1024)
AUX = [0, 1, 3]  # 3 = the final pre-norm state: the copy draft reads it


def _models():
    dev = torch.device("cuda")
    target = LlamaModel.from_config(CFG, dtype="bf16", device=dev, aux_layer_ids=AUX, std=0.08)
    draft = Eagle3Draft(
        eagle3_config(TargetSpec(path=Path("<gpu test>"), config=dict(CFG)), AUX), device=dev, dtype=torch.bfloat16
    )
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    make_copy_draft(draft, target, final_aux=2)  # often accepted
    draft.share_embedding(target.embed_tokens)
    return target, draft.to(dev).eval()


@pytest.mark.parametrize("k", [1, 4])
def test_graph_chain_steps_equal_plain_in_bf16(k):
    target, draft = _models()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CFG["vocab_size"], (n,), generator=gen).tolist() for n in (5, 40, 17, 90, 3, 64, 8)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False)
    base = dict(decode_path="rows", max_num_seqs=4, kv_cache_gib=0.25)
    plain_engine = LLMEngine(target, None, EngineConfig(**base))
    captured = plain_engine.target.rows.rows.captures
    assert captured > 0, "the plain step's graphs are captured when the engine starts"
    plain = plain_engine.generate(prompts, params)
    assert plain_engine.target.rows.rows.captures == captured, "no plain step captures a graph"
    dcfg = DraftConfig(source="test", num_speculative_tokens=k, policy=PolicyConfig(adaptive=False))
    engine = LLMEngine(target, None, EngineConfig(draft=dcfg, **base), draft)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    graphs = engine.drafts.spec.graphs
    assert graphs is not None and graphs.graphs.captures > 0, "greedy chain steps must run on the step graphs"
    assert engine.metrics.spec.num_accepted_tokens > 0
