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


PARAMS = SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False)
BASE = dict(decode_path="rows", max_num_seqs=4, kv_cache_gib=0.25)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG["vocab_size"], (n,), generator=gen).tolist() for n in (5, 40, 17, 90, 3, 64, 8)]


@pytest.mark.parametrize("k", [1, 4])
def test_graph_chain_steps_equal_plain_in_bf16(k):
    target, draft = _models()
    prompts, params, base = _prompts(), PARAMS, BASE
    plain_engine = LLMEngine(target, None, EngineConfig(**base))
    captured = plain_engine.target.rows.captures
    assert captured > 0, "the plain step's graphs are captured when the engine starts"
    plain = plain_engine.generate(prompts, params)
    assert plain_engine.target.rows.captures == captured, "no plain step captures a graph"
    dcfg = DraftConfig(source="test", num_speculative_tokens=k, policy=PolicyConfig(adaptive=False))
    engine = LLMEngine(target, None, EngineConfig(draft=dcfg, **base), draft)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    graphs = engine.drafts.spec.graphs
    assert graphs is not None and graphs.graphs.captures > 0, "greedy chain steps must run on the step graphs"
    assert engine.metrics.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("tree", [dict(depth=3, topk=2, num_draft_tokens=4), dict(depth=5, topk=4, num_draft_tokens=8)])
def test_tree_steps_verified_as_rows_equal_plain_in_bf16(tree):
    """Tree drafting and verification on the row steps (a node a row, its ancestors through the attention kernel's
    tail, graphs of their own): greedy tree output equals plain greedy output token for token in bf16."""
    from eagleray.platform.config.schemas import TreeConfig

    target, draft = _models()
    plain = LLMEngine(target, None, EngineConfig(**BASE)).generate(_prompts(), PARAMS)
    dcfg = DraftConfig(source="test", tree=TreeConfig(**tree), policy=PolicyConfig(adaptive=False))
    engine = LLMEngine(target, None, EngineConfig(draft=dcfg, **BASE), draft)
    outs = engine.generate(_prompts(), PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert any(key[0][0] == "tail" for key in engine.target.rows.graphs), "the tree must verify on the row graphs"
    assert ("tail", False) in {key for key, _ in engine.drafts.spec.draft.rows.rows.graphs}, "the tree drafts on rows"
    assert engine.metrics.spec.num_accepted_tokens > 0


def test_the_fused_draft_step_equals_the_drafts_forward_in_bf16():
    """The draft's graphs on CUDA run FusedDraftStep: the draft's own forward's values (bf16 rounding apart) and K/V."""
    from eagleray.platform.models.decode_metadata import DecodeMetadata
    from eagleray.platform.models.draft_graphs import DraftGraphRunner, FusedDraftStep

    target, draft = _models()
    dev = torch.device("cuda")
    caches = [draft.make_kv_cache(num_blocks=9, block_size=16) for _ in range(2)]
    for kv in caches:
        kv.k.normal_(generator=torch.Generator(device=dev).manual_seed(1))
        kv.v.normal_(generator=torch.Generator(device=dev).manual_seed(2))
    assert isinstance(DraftGraphRunner(draft, caches[0], 4, 4, (1, 4)).step, FusedDraftStep)
    tables = torch.tensor([[3, 1, 6, 0], [2, 7, 4, 5], [5, 0, 1, 2]], dtype=torch.int32, device=dev)
    pos = torch.tensor([5, 40, 20], device=dev)
    slots = tables.gather(1, (pos // 16)[:, None]).squeeze(1).long() * 16 + pos % 16
    ids = torch.randint(0, CFG["vocab_size"], (3,), device=dev)
    hidden = torch.randn(3, CFG["hidden_size"], device=dev, dtype=torch.bfloat16)
    meta = DecodeMetadata(tables, (pos + 1).to(torch.int32), slots, 16, use_triton=True)
    with torch.inference_mode():
        want = draft(ids, pos, hidden, meta, caches[0])
        got = FusedDraftStep(draft)(ids, pos, hidden, meta, caches[1])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(caches[1].k.float(), caches[0].k.float(), atol=0.02, rtol=0)
