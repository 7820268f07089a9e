"""On a CUDA GPU: CUDA-graph replay of the decode step equals the same step run eagerly, and the
engine's paged forward (marker `gpu`; run with EAGLERAY_TEST_GPU=1 so Triton compiles for the GPU)."""

from __future__ import annotations

import pytest
import torch

from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.graphs import DecodeGraphRunner
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.row_graphs import DecodeRows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
BLOCK, LENS = 16, (37, 5, 80, 16, 1)


def _tables(dev):
    blocks = 8  # 128 tokens per sequence; block 40 (the last) is the pad block
    order = torch.randperm(len(LENS) * blocks, generator=torch.Generator().manual_seed(0))
    return order.view(len(LENS), blocks).to(torch.int32).to(dev)  # [B, 8]


def _eager(model, tok, lens, tables, kv):
    attn = AttentionMetadata.build([1] * len(lens), list(lens), tables, BLOCK)
    hidden, aux = model(tok, torch.tensor(lens, device=tok.device), attn, kv)
    return model.compute_logits(hidden), aux


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-2), (torch.bfloat16, 0.1)])  # Triton fp32 dots are tf32
@pytest.mark.parametrize("fused,invariant", [(True, False), (False, False), (True, True)])
def test_graph_replay_equals_eager(dtype, atol, fused, invariant):
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = LlamaModel.from_config(CFG, dtype=dtype, device=dev, aux_layer_ids=[1, 3], std=0.05)
    tables = _tables(dev)
    kv_ref, kv_graph, kv_eager = (model.make_kv_cache(41, BLOCK) for _ in range(3))
    ids = torch.randint(0, 512, (sum(LENS),), device=dev)
    pos = torch.cat([torch.arange(n) for n in LENS]).to(dev)
    with torch.inference_mode():
        model(ids, pos, AttentionMetadata.build(list(LENS), [0] * len(LENS), tables, BLOCK), kv_ref)
        for kv in (kv_graph, kv_eager):
            kv.k.copy_(kv_ref.k)
            kv.v.copy_(kv_ref.v)
    graph = DecodeGraphRunner(model, kv_graph, 8, fused=fused, invariant=invariant)
    graph.capture()
    eager = DecodeGraphRunner(model, kv_eager, 8, fused=fused, use_graphs=False, invariant=invariant)
    tok, lens = torch.randint(0, 512, (len(LENS),), device=dev), list(LENS)
    with torch.inference_mode():
        for _ in range(4):  # batch 5 replays the bucket-8 graph
            p = torch.tensor(lens, device=dev)
            slots = tables.gather(1, (p // BLOCK)[:, None].long()).squeeze(1).long() * BLOCK + p % BLOCK
            rows = DecodeRows(tok, p, tables, (p + 1).int(), slots)
            g_logits, g_aux = (t.clone() for t in graph.run(rows))
            e_logits, e_aux = eager.run(rows)
            r_logits, r_aux = _eager(model, tok, lens, tables, kv_ref)
            torch.testing.assert_close(g_logits, e_logits, atol=1e-5, rtol=0)  # same kernels, replayed
            torch.testing.assert_close(g_aux, e_aux, atol=1e-5, rtol=0)
            torch.testing.assert_close(g_logits.float(), r_logits.float(), atol=atol, rtol=0)
            torch.testing.assert_close(g_aux.float(), r_aux.float(), atol=atol, rtol=0)
            tok, lens = r_logits.argmax(-1), [n + 1 for n in lens]


@pytest.mark.parametrize("head_dim,group,length", [(64, 3, 600), (128, 4, 600), (128, 4, 17)])
def test_triton_decode_attention_bf16_matches_torch(head_dim, group, length):
    from eagleray.kernels.decode_attention import decode_attention, decode_attention_reference

    dev, hkv, bs = torch.device("cuda"), 8, 16
    blocks = -(-length // bs) + 3
    k_cache, v_cache = (torch.randn(4 * blocks, bs, hkv, head_dim, device=dev, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(4, hkv * group, head_dim, device=dev, dtype=torch.bfloat16)
    tables = torch.randperm(4 * blocks, device=dev).view(4, blocks).to(torch.int32)
    lens = torch.tensor([length, 1, length // 2 + 1, length + 5], device=dev, dtype=torch.int32)
    ref = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, head_dim**-0.5)
    got = decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5).float()
    rel = float((got - ref).norm() / ref.norm())
    print(f"attention D={head_dim} G={group} L={length}: relative error {rel:.2e}")
    assert rel < 1e-2


def test_fused_step_on_8b_shapes_matches_engine_path():
    """Two layers with Llama-3.1-8B shapes, bf16: one decode step, fused graph vs paged eager."""
    from eagleray.jobs.bench.common import LLAMA_8B

    dev = torch.device("cuda")
    model = LlamaModel.from_config(dict(LLAMA_8B, num_hidden_layers=2), dtype=torch.bfloat16, device=dev)
    lens = [600, 33, 1]
    tables = torch.arange(3 * 40, device=dev, dtype=torch.int32).view(3, 40)
    kv = model.make_kv_cache(121, BLOCK)
    ids = torch.randint(0, 128256, (sum(lens),), device=dev)
    pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
    runner = DecodeGraphRunner(model, kv, 40)
    runner.capture([4])
    with torch.inference_mode():
        model(ids, pos, AttentionMetadata.build(lens, [0] * 3, tables, BLOCK), kv)
        tok, p = torch.randint(0, 128256, (3,), device=dev), torch.tensor(lens, device=dev)
        slots = tables.gather(1, (p // BLOCK)[:, None].long()).squeeze(1).long() * BLOCK + p % BLOCK
        got = runner.run(DecodeRows(tok, p, tables, (p + 1).int(), slots))[0].float().clone()
        ref = _eager(model, tok, lens, tables, kv)[0].float()
    rel = float((got - ref).norm() / ref.norm())
    print(f"8B-shaped step: logits relative error {rel:.2e}, argmax {got.argmax(-1).tolist()} vs {ref.argmax(-1).tolist()}")
    assert rel < 2e-2


def test_pdl_leaves_the_invariant_graph_step_bitwise_unchanged(monkeypatch):
    """The step captured with programmatic dependent launch (EAGLERAY_PDL=on) gives the same bits as without it
    (off): every PDL kernel waits for the kernels before it before its first load or store."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability >= 9")
    dev = torch.device("cuda")
    model = LlamaModel.from_config(CFG, dtype=torch.bfloat16, device=dev, aux_layer_ids=[1, 3], std=0.05)
    tables = _tables(dev)
    kvs, runners = [], []
    for mode in ("off", "on"):
        monkeypatch.setenv("EAGLERAY_PDL", mode)
        kv = model.make_kv_cache(41, BLOCK)
        kv.k.normal_(0, 1), kv.v.normal_(0, 1)
        if kvs:
            kv.k.copy_(kvs[0].k), kv.v.copy_(kvs[0].v)
        runner = DecodeGraphRunner(model, kv, 8, fused=True, invariant=True)
        runner.capture()  # the launches (with or without PDL) are recorded now
        kvs.append(kv)
        runners.append(runner)
    tok, lens = torch.randint(0, 512, (len(LENS),), device=dev), list(LENS)
    with torch.inference_mode():
        for _ in range(4):
            p = torch.tensor(lens, device=dev)
            slots = tables.gather(1, (p // BLOCK)[:, None].long()).squeeze(1).long() * BLOCK + p % BLOCK
            rows = DecodeRows(tok, p, tables, (p + 1).int(), slots)
            off_logits, off_aux = (t.clone() for t in runners[0].run(rows))
            on_logits, on_aux = runners[1].run(rows)
            assert torch.equal(off_logits, on_logits) and torch.equal(off_aux, on_aux)
            tok, lens = off_logits.argmax(-1), [n + 1 for n in lens]
    assert torch.equal(kvs[0].k, kvs[1].k) and torch.equal(kvs[0].v, kvs[1].v)
