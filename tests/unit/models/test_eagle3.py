"""EAGLE-3 draft: loading (eagleray and vLLM-only checkpoints) and vLLM's Eagle3 llama numerics.

The reference below is written from vLLM's ``llama_eagle3.py`` with plain torch ops and
transformers' rotary helpers, independently of eagleray's layers.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagleray.platform.checkpoints.draft import DraftCheckpoint, save_draft
from eagleray.platform.checkpoints.draft_factory import eagle3_config, make_random_draft, random_eagle3_tensors, vocab_map
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.row_graphs import DecodeRows
from eagleray.tests.support.tiny import make_tiny_llama

AUX = [1, 2, 4]
ATOL = 1e-5


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp("t") / "target", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96
    )


@pytest.fixture(scope="module")
def target(target_dir):
    return LlamaModel.from_dir(target_dir, aux_layer_ids=AUX)


@pytest.fixture(scope="module")
def draft_dir(target_dir, tmp_path_factory):
    spec = TargetSpec.from_dir(target_dir)
    counts = torch.rand(spec.vocab_size, generator=torch.Generator().manual_seed(0))
    return make_random_draft(
        spec, tmp_path_factory.mktemp("d") / "draft", aux_layer_ids=AUX, draft_vocab_size=64, seed=3, counts=counts
    )


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference(t: dict, cfg: dict, embed_w, ids, aux_or_hidden, positions, from_aux: bool):
    """vLLM Eagle3 llama draft, one causal sequence, no cache -> (logits [T, Vd], next_hidden [T, H])."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    eps, nh, nkv, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eagle = cfg.get("eagle_config", {})
    x = aux_or_hidden
    if from_aux:
        if eagle.get("norm_before_fc") or cfg.get("norm_before_fc"):
            x = _rms(x, t["input_norm.weight"], eps)
        x = x @ t["fc.weight"].T  # [T, H]
    m = "midlayer."
    hn = _rms(x, t[m + "hidden_norm.weight"], eps)
    residual = hn if cfg.get("norm_before_residual") else x
    inp = torch.cat([_rms(embed_w[ids], t[m + "input_layernorm.weight"], eps), hn], -1)  # [T, 2H]
    T = ids.shape[0]
    q = (inp @ t[m + "self_attn.q_proj.weight"].T).view(T, nh, d).transpose(0, 1)[None]  # [1, nh, T, d]
    k = (inp @ t[m + "self_attn.k_proj.weight"].T).view(T, nkv, d).transpose(0, 1)[None]
    v = (inp @ t[m + "self_attn.v_proj.weight"].T).view(T, nkv, d).transpose(0, 1)[None]
    rope_cfg = LlamaConfig(**{k_: v_ for k_, v_ in cfg.items() if k_ not in ("eagle_config", "architectures")})
    cos, sin = LlamaRotaryEmbedding(rope_cfg)(inp[None], positions[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)  # [1, nh, T, d]
    scores = (q @ k.transpose(-1, -2)) * d**-0.5 + torch.full((T, T), float("-inf")).triu(1)
    o = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(T, nh * d)  # [T, nh*d]
    h = o @ t[m + "self_attn.o_proj.weight"].T + residual  # [T, H]
    y = _rms(h, t[m + "post_attention_layernorm.weight"], eps)
    y = torch.nn.functional.silu(y @ t[m + "mlp.gate_proj.weight"].T) * (y @ t[m + "mlp.up_proj.weight"].T)
    pre = y @ t[m + "mlp.down_proj.weight"].T + h  # [T, H]
    normed = _rms(pre, t["norm.weight"], eps)
    return normed @ t["lm_head.weight"].T, (normed if cfg.get("norm_output") else pre)


def _inputs(target, n=9, seed=5):
    ids = torch.randint(0, target.arch.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))  # [T]
    _, aux = target.forward_full(ids[None])  # [1, T, 3H]
    return ids, aux[0], torch.arange(n)  # draft token t+1 pairs with aux at t; any ids suffice numerically


def _run(draft, ids, hidden, positions, cache=None, ctx=0, tables=None):
    attn = AttentionMetadata.build([ids.shape[0]], [ctx], tables, 4 if tables is not None else 0)
    with torch.inference_mode():
        normed, nxt = draft(ids, positions, hidden, attn, cache)
        return draft.compute_logits(normed), nxt


def test_random_draft_shares_target_embedding_and_matches_vllm(draft_dir, target):
    draft = Eagle3Draft.from_checkpoint(draft_dir, target)
    assert draft.embed_tokens is None and draft.draft_vocab_size == 64
    ids, aux, pos = _inputs(target)
    logits, nxt = _run(draft, ids, draft.combine_hidden_states(aux), pos)  # [T, 64], [T, H]
    ckpt = DraftCheckpoint.open(draft_dir)
    ref_logits, ref_next = reference(ckpt.load_tensors(), ckpt.config, target.embed_tokens.weight, ids, aux, pos, True)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(nxt, ref_next, atol=ATOL, rtol=0)


def test_vocab_mapping_follows_d2t_and_t2d(draft_dir, target):
    draft = Eagle3Draft.from_checkpoint(draft_dir, target)
    t2d = DraftCheckpoint.open(draft_dir).load_tensors(["t2d"])["t2d"]  # [V] bool
    targets = draft.to_target_ids(torch.arange(64))  # [64]
    assert bool(t2d[targets].all()) and int(t2d.sum()) == 64 and bool((targets.diff() > 0).all())
    logits = torch.randn(2, 64)
    full = draft.logits_in_target_vocab(logits)  # [2, V]
    assert torch.equal(full.argmax(-1), draft.to_target_ids(logits.argmax(-1)))
    assert bool(torch.isinf(full[:, ~t2d]).all())


def test_second_step_uses_own_hidden_through_the_paged_cache(draft_dir, target):
    draft = Eagle3Draft.from_checkpoint(draft_dir, target)
    ids, aux, pos = _inputs(target)
    cache, tables = draft.make_kv_cache(num_blocks=5, block_size=4), [[4, 0, 2]]
    hidden = draft.combine_hidden_states(aux)  # [T, H]
    _, nxt = _run(draft, ids, hidden, pos, cache, 0, tables)
    new_tok = torch.tensor([7])
    step2, _ = _run(draft, new_tok, nxt[-1:], torch.tensor([len(ids)]), cache, len(ids), tables)  # [1, Vd]
    full, _ = _run(draft, torch.cat([ids, new_tok]), torch.cat([hidden, nxt[-1:]]), torch.arange(len(ids) + 1))
    torch.testing.assert_close(step2[0], full[-1], atol=ATOL, rtol=0)


def _vllm_only_draft(target_dir, out, **flags):
    """A draft with only vLLM's config keys and tensor names: no eagleray block, no t2d, own embedding."""
    spec = TargetSpec.from_dir(target_dir)
    cfg = eagle3_config(spec, AUX, 48)
    cfg.update({k: v for k, v in flags.items() if k != "norm_before_fc"})
    if flags.get("norm_before_fc"):
        cfg["eagle_config"]["norm_before_fc"] = True
    counts = torch.arange(spec.vocab_size, dtype=torch.float32).flip(0)
    d2t, t2d = vocab_map(counts, 48)
    t = random_eagle3_tensors(cfg, d2t, t2d, seed=11, std=0.05)
    del t["t2d"]
    g = torch.Generator().manual_seed(12)
    for name in [n for n in t if "norm" in n]:
        t[name] = 1 + 0.3 * torch.randn(t[name].shape, generator=g)
    t["embed_tokens.weight"] = torch.randn(spec.vocab_size, spec.hidden_size, generator=g) * 0.5
    if flags.get("norm_before_fc"):
        t["input_norm.weight"] = 1 + 0.3 * torch.randn(cfg["hidden_size"] * len(AUX), generator=g)
    return save_draft(out, cfg, t), cfg, t


@pytest.mark.parametrize(
    "flags",
    [{}, {"norm_before_residual": True}, {"norm_before_fc": True, "norm_output": True}],
    ids=["default", "norm_before_residual", "norm_before_fc+norm_output"],
)
def test_vllm_format_draft_without_eagleray_metadata(flags, target_dir, target, tmp_path):
    path, cfg, tensors = _vllm_only_draft(target_dir, tmp_path / "vllm_draft", **flags)
    assert "eagleray" not in json.loads((path / "config.json").read_text())
    draft = Eagle3Draft.from_checkpoint(path)  # no target needed: the draft has its own embedding
    assert draft.embed_tokens is not None
    ids, aux, pos = _inputs(target, seed=8)
    logits, nxt = _run(draft, ids, draft.combine_hidden_states(aux), pos)
    ref_logits, ref_next = reference(tensors, cfg, tensors["embed_tokens.weight"], ids, aux, pos, True)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(nxt, ref_next, atol=ATOL, rtol=0)


def test_unsupported_and_inconsistent_drafts_are_refused(target_dir, draft_dir, target, tmp_path):
    with pytest.raises(EaglerayError, match="no target was given"):
        Eagle3Draft.from_checkpoint(draft_dir)
    path, _, _ = _vllm_only_draft(target_dir, tmp_path / "fcn", fc_norm=True)
    with pytest.raises(EaglerayError, match="fc_norm"):
        Eagle3Draft.from_checkpoint(path)
    draft = Eagle3Draft.from_checkpoint(draft_dir, target)
    with pytest.raises(EaglerayError, match="aux hidden states of width 192"):
        draft.combine_hidden_states(torch.zeros(3, 64))


def test_greedy_chain_graph_equals_the_step_by_step_chain(target, draft_dir):
    """DraftGraphRunner.chain (the greedy chain as one replayable step) drafts the same tokens as one row step
    per draft token, with a reduced draft vocabulary (d2t) and a padded bucket."""
    from eagleray.platform.models.draft_graphs import DraftGraphRunner

    draft = Eagle3Draft.from_checkpoint(draft_dir, target)
    outs = []
    for mode in ("steps", "chain"):
        kv = draft.make_kv_cache(num_blocks=9, block_size=4)
        kv.k.copy_(torch.randn(kv.k.shape, generator=torch.Generator().manual_seed(1)))
        kv.v.copy_(torch.randn(kv.v.shape, generator=torch.Generator().manual_seed(2)))
        runner = DraftGraphRunner(draft, kv, max_rows=4, max_blocks_per_seq=4, buckets=(1, 4))
        tables = torch.tensor([[3, 1, 6, 0], [2, 7, 4, 5], [5, 0, 1, 2]], dtype=torch.int32)  # [3, 4]; block 8 = pad
        first = torch.tensor([5, 9, 2])  # [3] positions of the first draft token
        ids = torch.randint(0, 64, (3,), generator=torch.Generator().manual_seed(4)) + draft.d2t[:3]
        hidden = torch.randn(3, draft.arch.hidden_size, generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            if mode == "chain":
                outs.append(runner.chain(ids, hidden, first, tables, 3))
                continue
            got = []
            for j in range(3):
                pos = first + j
                slots = tables.gather(1, (pos // 4)[:, None]).squeeze(1).long() * 4 + pos % 4
                logits, hidden = runner.run(
                    DecodeRows(ids, pos, tables, (pos + 1).to(torch.int32), slots), hidden, from_aux=False
                )
                ids = draft.to_target_ids(logits.argmax(-1))
                got.append(ids)
            outs.append(torch.stack(got, 1))
    assert torch.equal(outs[0], outs[1]), (outs[0], outs[1])


@pytest.mark.parametrize("norm_before_residual,product_rows", [(False, 0), (True, 0), (False, 8)])
def test_the_fused_draft_step_equals_the_drafts_forward(target, draft_dir, norm_before_residual, product_rows, monkeypatch):
    """FusedDraftStep (the draft's graphs on CUDA: its Triton kernels, interpreted here) gives the draft's own forward
    on rows: normed and next hidden states, the K/V it stores, the combined aux states and the logits, for rows of
    three sequences at their positions; with its products on cuBLAS's stand-in (F.linear) or on the Triton linear."""
    from eagleray.platform.models.decode_metadata import DecodeMetadata
    from eagleray.platform.models.draft_graphs import FusedDraftStep

    monkeypatch.setattr(FusedDraftStep, "TRITON_PRODUCT_ROWS", product_rows)
    triton_products = []
    if product_rows:
        import eagleray.platform.models.draft_graphs as dg

        real = dg.invariant_linear
        monkeypatch.setattr(dg, "invariant_linear", lambda *a, **kw: triton_products.append(a[1].shape) or real(*a, **kw))

    draft = Eagle3Draft.from_checkpoint(draft_dir, target)
    draft.midlayer.norm_before_residual = norm_before_residual
    caches = []
    for _ in range(2):
        kv = draft.make_kv_cache(num_blocks=9, block_size=4)
        kv.k.copy_(torch.randn(kv.k.shape, generator=torch.Generator().manual_seed(1)))
        kv.v.copy_(torch.randn(kv.v.shape, generator=torch.Generator().manual_seed(2)))
        caches.append(kv)
    tables = torch.tensor([[3, 1, 6, 0], [2, 7, 4, 5], [5, 0, 1, 2]], dtype=torch.int32)  # [3, 4]
    pos = torch.tensor([5, 9, 2])  # [3]
    slots = tables.gather(1, (pos // 4)[:, None]).squeeze(1).long() * 4 + pos % 4
    ids = torch.randint(0, 64, (3,), generator=torch.Generator().manual_seed(4))
    hidden = torch.randn(3, draft.arch.hidden_size, generator=torch.Generator().manual_seed(5))
    meta = DecodeMetadata(tables, (pos + 1).to(torch.int32), slots, 4, use_triton=True)
    with torch.inference_mode():
        want = draft(ids, pos, hidden, meta, caches[0])
        step = FusedDraftStep(draft)
        got = step(ids, pos, hidden, meta, caches[1])
        aux = torch.randn(3, draft.fc_in, generator=torch.Generator().manual_seed(6))
        extra = [(step.combine_hidden_states(aux), draft.combine_hidden_states(aux))]
        extra.append((step.compute_logits(got[0]), draft.compute_logits(want[0])))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    for g, w in extra:
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-5, rtol=0)
    torch.testing.assert_close(caches[1].v, caches[0].v, atol=1e-5, rtol=0)
    # every product (qkv, o, gate/up, down, fc, LM head) on the Triton linear when asked, none otherwise
    assert len(triton_products) == (6 if product_rows else 0), triton_products
