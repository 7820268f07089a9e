"""Batch-1 Triton GEMVs with folded element-wise ops (interpreter on CPU) equal the unfused references,
and the batch-1 fused decode step through them equals the model's own paged forward."""

from __future__ import annotations

import torch

from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.decode_gemv import gemv, qkv_rope_gemv
from eagleray.platform.models.decode_ops import add_rmsnorm_torch, rope_write_kv_torch, silu_mul_torch
from eagleray.platform.models.graphs import DecodeGraphRunner
from eagleray.platform.models.llama import LlamaModel

BLOCK = 4


def test_gemv_modes_match_references():
    g = torch.Generator().manual_seed(0)
    k, n = 96, 40  # K not a multiple of the tile: masked path
    x, w, b = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    res, nw = torch.randn(1, n, generator=g), torch.randn(k, generator=g)
    xn, _ = add_rmsnorm_torch(x, None, nw, 1e-5)  # [1, K]
    gu = torch.randn(1, 2 * k, generator=g)
    cases = [
        (gemv(x, w), x @ w.T),
        (gemv(x, w, b, residual=res), res + (x @ w.T + b)),
        (gemv(x, w, mode="norm", norm_weight=nw, eps=1e-5), xn @ w.T),
        (gemv(gu, w, mode="silu"), silu_mul_torch(gu) @ w.T),
    ]
    for got, ref in cases:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


def test_qkv_rope_gemv_matches_reference():
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, k = 4, 2, 16, 64
    h, nw = torch.randn(1, k, generator=g), torch.randn(k, generator=g)
    w = torch.randn((hq + 2 * hkv) * d, k, generator=g)
    pos, slots = torch.tensor([9]), torch.tensor([6])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    caches = [torch.randn(4, 4, hkv, d, generator=g) for _ in range(2)]
    got_caches = [c.clone() for c in caches]
    xn, _ = add_rmsnorm_torch(h, None, nw, 1e-5)
    q_ref = rope_write_kv_torch(xn @ w.T, pos, inv, caches[0], caches[1], slots, hq, hkv)
    q_got = qkv_rope_gemv(h, nw, 1e-5, w, None, pos, inv, got_caches[0], got_caches[1], slots, hq, hkv)
    torch.testing.assert_close(q_got, q_ref, atol=1e-4, rtol=1e-5)
    for got, ref in zip(got_caches, caches):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


def test_batch1_gemv_step_equals_eager(tiny_dirs):
    model = LlamaModel.from_dir(tiny_dirs["llama_tied"], aux_layer_ids=[0, 2, 4])
    prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(3))
    tables = [[3, 0, 5]]
    eager_kv, fast_kv = (model.make_kv_cache(num_blocks=8, block_size=BLOCK) for _ in range(2))
    runner = DecodeGraphRunner(model, fast_kv, max_blocks_per_seq=3, buckets=(1,), use_triton=True, use_gemv=True)
    assert runner.step.use_gemv
    with torch.inference_mode():
        attn = AttentionMetadata.build([7], [0], tables, BLOCK)
        hidden, _ = model(prompt, torch.arange(7), attn, eager_kv)
        fast_kv.k.copy_(eager_kv.k)
        fast_kv.v.copy_(eager_kv.v)
        tok, n = model.compute_logits(hidden[-1:]).argmax(-1), 7  # [1]
        for _ in range(2):
            attn = AttentionMetadata.build([1], [n], tables, BLOCK)
            h, ref_aux = model(tok, torch.tensor([n]), attn, eager_kv)
            ref = model.compute_logits(h)
            pos, t = torch.tensor([n]), torch.tensor(tables, dtype=torch.int32)
            slots = t[0, n // BLOCK].long().view(1) * BLOCK + n % BLOCK
            got, got_aux = runner.run(tok, pos, t, (pos + 1).to(torch.int32), slots)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(got_aux, ref_aux, atol=1e-4, rtol=0)
            tok, n = ref.argmax(-1), n + 1
    torch.testing.assert_close(fast_kv.k[:6], eager_kv.k[:6], atol=1e-5, rtol=0)
