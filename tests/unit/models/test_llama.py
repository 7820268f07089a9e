"""eagleray's target decoder against transformers on tiny random models (fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.llama import LlamaModel

ATOL = 1e-4
VOCAB = 96  # conftest.SMALL
VARIANTS = ["llama_tied", "llama_untied_mha", "llama3_rope", "llama_linear_rope_bias", "mistral_window", "qwen2", "qwen3"]


def _hf_states(ref, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers logits [B, T, V] and the inputs of layers 0..N (N = pre-final-norm state)."""
    captured = {}
    hook = ref.model.norm.register_forward_pre_hook(lambda mod, args: captured.setdefault("pre", args[0]))
    try:
        with torch.no_grad():
            out = ref(ids, output_hidden_states=True)
    finally:
        hook.remove()
    states = list(out.hidden_states[:-1]) + [captured["pre"]]  # [N+1] x [B, T, H]
    return out.logits, states


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_aux_match_transformers(variant, tiny_dirs, hf_model):
    path = tiny_dirs[variant]
    n = 4
    ids_aux = [0, 2, n]
    model = LlamaModel.from_dir(path, aux_layer_ids=ids_aux)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))  # [B, T]
    logits, aux = model.forward_full(ids)  # [B, T, V], [B, T, 3H]
    ref_logits, states = _hf_states(hf_model(path), ids)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    h = model.hidden_size
    for j, k in enumerate(ids_aux):
        torch.testing.assert_close(aux[..., j * h : (j + 1) * h], states[k], atol=ATOL, rtol=0)


def test_bf16_load_is_close_to_fp32(tiny_dirs):
    path = tiny_dirs["llama_tied"]
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    full, _ = LlamaModel.from_dir(path).forward_full(ids)  # [1, T, V]
    half = LlamaModel.from_dir(path, dtype="bf16")
    assert half.norm.weight.dtype == torch.bfloat16
    low, _ = half.forward_full(ids)
    torch.testing.assert_close(low.float(), full, atol=0.05, rtol=0.05)


def _paged_forward(model, seqs, ctx_lens, block_tables, block_size, cache, tree_masks=None, positions=None):
    """One varlen forward of the new tokens ``seqs[b][ctx_lens[b]:]`` -> logits [T, V]."""
    new = [s[c:] for s, c in zip(seqs, ctx_lens)]
    ids = torch.cat(new)  # [T]
    if positions is None:
        positions = torch.cat([torch.arange(c, c + len(s)) for s, c in zip(new, ctx_lens)])  # [T]
    attn = AttentionMetadata.build([len(s) for s in new], ctx_lens, block_tables, block_size, tree_masks)
    hidden, _ = model(ids, positions, attn, cache)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("variant", ["llama_tied", "mistral_window"])
def test_paged_prefill_chunk_and_decode_equal_full_forward(variant, tiny_dirs):
    model = LlamaModel.from_dir(tiny_dirs[variant])
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (13, 6)]  # final lengths
    block_size, cache = 4, model.make_kv_cache(num_blocks=12, block_size=4)
    tables = [[7, 2, 9, 0], [5, 11, -1, -1]]  # non-contiguous blocks, -1 = unused
    with torch.inference_mode():
        # prefill (first 8 / 3 tokens), a chunk (to 12 / 5), then one decode token each
        _paged_forward(model, [s[:8] for s in seqs[:1]] + [seqs[1][:3]], [0, 0], tables, block_size, cache)
        _paged_forward(model, [seqs[0][:12], seqs[1][:5]], [8, 3], tables, block_size, cache)
        last = _paged_forward(model, seqs, [12, 5], tables, block_size, cache)  # [2, V]
        for b, s in enumerate(seqs):
            full, _ = model.forward_full(s.unsqueeze(0))  # [1, T, V]
            torch.testing.assert_close(last[b], full[0, -1], atol=ATOL, rtol=0)


def test_long_prompts_prefill_unpadded_through_the_native_attention(tiny_dirs):
    """Prompts longer than a row mask can describe (MAX_NEW) beside a short one: one varlen prefill reads
    the paged cache in place (no padded SDPA), and its logits match the full forward."""
    from eagleray.kernels import cpu_decode

    model = LlamaModel.from_dir(tiny_dirs["llama_tied"])
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (cpu_decode.MAX_NEW + 37, 9)]
    cache = model.make_kv_cache(num_blocks=40, block_size=4)
    tables = [list(range(39, 13, -1)), [0, 5, 9] + [-1] * 23]  # 26 and 3 blocks, non-contiguous, -1 = unused
    with torch.inference_mode():
        attn = AttentionMetadata.build([len(s) for s in seqs], [0, 0], tables, 4)
        positions = torch.cat([torch.arange(len(s)) for s in seqs])  # [T]
        hidden, _ = model(torch.cat(seqs), positions, attn, cache)  # [T, H]
        logits = model.compute_logits(hidden)  # [T, V]
        assert ("rows" in attn.layouts) == (cpu_decode.status() == "native"), "the native kernel takes long prompts"
        ends = [len(seqs[0]) - 1, len(seqs[0]) + len(seqs[1]) - 1]
        for b, s in enumerate(seqs):
            full, _ = model.forward_full(s.unsqueeze(0))  # [1, T, V]
            torch.testing.assert_close(logits[ends[b]], full[0, -1], atol=ATOL, rtol=0)
            torch.testing.assert_close(
                logits[ends[b] - 70 if b == 0 else ends[b] - 3], full[0, -71 if b == 0 else -4], atol=ATOL, rtol=0
            )


def test_tree_mask_forward_equals_chain_forwards(tiny_dirs):
    model = LlamaModel.from_dir(tiny_dirs["llama_untied_mha"])
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (7,), generator=g)  # [P]
    tree = torch.randint(0, VOCAB, (5,), generator=g)  # nodes r, a, b, c, d
    parents = [-1, 0, 0, 1, 2]  # r -> {a, b}; a -> c; b -> d
    depth = [0, 1, 1, 2, 2]
    mask = torch.eye(5, dtype=torch.bool)  # [5, 5] node i sees its ancestors and itself
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p], p = True, parents[p]
    block_size, cache, tables = 4, model.make_kv_cache(num_blocks=6, block_size=4), [[3, 1, 4]]
    p = len(prompt)
    with torch.inference_mode():
        _paged_forward(model, [prompt], [0], tables, block_size, cache)
        positions = torch.tensor(depth) + p  # [5]
        logits = _paged_forward(
            model, [torch.cat([prompt, tree])], [p], tables, block_size, cache, tree_masks=[mask], positions=positions
        )  # [5, V]
    for i in range(5):
        path, node = [], i
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        chain = torch.cat([prompt, tree[path]]).unsqueeze(0)  # [1, P + depth + 1]
        full, _ = model.forward_full(chain)
        torch.testing.assert_close(logits[i], full[0, -1], atol=ATOL, rtol=0)


def _edit_config(path, tmp_path, **changes):
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "gpt2"}, "model_type"),
    ],
)
def test_unsupported_config_is_refused(changes, field, tiny_dirs, tmp_path):
    path = _edit_config(tiny_dirs["llama_tied"], tmp_path, **changes)
    with pytest.raises(EaglerayError, match=field):
        LlamaModel.from_dir(path)


def test_aux_ids_out_of_range_are_refused(tiny_dirs):
    with pytest.raises(EaglerayError, match=r"outside \[0, 4\]"):
        LlamaModel.from_dir(tiny_dirs["llama_tied"], aux_layer_ids=[2, 5])


def test_wrong_checkpoint_names_missing_tensors(tiny_dirs, tmp_path):
    path = _edit_config(tiny_dirs["llama_tied"], tmp_path, num_hidden_layers=5)
    with pytest.raises(EaglerayError, match="missing tensors"):
        LlamaModel.from_dir(path)


@pytest.mark.parametrize("variant", ["llama_tied", "llama_linear_rope_bias", "qwen3"])
def test_fused_projections_equal_the_separate_ones_and_still_load(variant, tiny_dirs):
    from eagleray.platform.models.layers import fuse_for_inference

    path = tiny_dirs[variant]
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    ref, _ = LlamaModel.from_dir(path).forward_full(ids)
    model = fuse_for_inference(LlamaModel.from_dir(path))
    attn = model.layers[0].self_attn
    assert attn.qkv is not None and model.layers[0].mlp.gate_up is not None
    assert attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr(), "the parts are views of the fused weight"
    fused, _ = model.forward_full(ids)
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=0)
    with torch.no_grad():
        attn.k_proj.weight.zero_()  # what a weight loader does: write into the part
    assert bool((attn.qkv.weight[attn.qkv.sizes[0] : sum(attn.qkv.sizes[:2])] == 0).all())
    model.load_checkpoint(path)  # loading again lands in the fused weights
    again, _ = model.forward_full(ids)
    torch.testing.assert_close(again, ref, atol=1e-5, rtol=0)


def test_pack_for_cpu_packs_what_the_forward_multiplies_by_at_load(tiny_dirs, monkeypatch):
    from eagleray.kernels import cpu_decode, cpu_gemm, cpu_panels
    from eagleray.platform.models.layers import fuse_for_inference, pack_for_cpu

    if cpu_decode.status() != "native":
        pytest.skip(f"native CPU kernels: {cpu_decode.status()}")
    model = fuse_for_inference(LlamaModel.from_dir(tiny_dirs["llama_untied_mha"]))
    assert pack_for_cpu(model) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down per layer + lm_head
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert not hasattr(attn.q_proj.weight, cpu_panels._PACKED), "a fused part is not packed (its memory)"
    if cpu_gemm.available():
        gemm_packed = [w for w in (attn.qkv.weight, attn.o_proj.weight, mlp.gate_up.weight, mlp.down_proj.weight)]
        assert all(hasattr(w, cpu_gemm._PACKED) for w in gemm_packed), "prefill GEMM weights packed for oneDNN"
        assert not hasattr(model.lm_head.weight, cpu_gemm._PACKED), "the LM head stays native in a prefill"
        assert not hasattr(attn.q_proj.weight, cpu_gemm._PACKED)

    def no_packing(*args, **kwargs):
        raise AssertionError("packed in a forward")

    monkeypatch.setattr(cpu_panels, "pack", no_packing)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_packing, raising=False)
    ids = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(6))
    prompt = torch.randint(0, VOCAB, (cpu_decode.PREFILL_NATIVE_ROWS + 4,), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        cache = model.make_kv_cache(num_blocks=16, block_size=4)
        _paged_forward(model, [ids], [0], [[0, 1]], 4, cache)
        attn_meta = AttentionMetadata.build([len(prompt)], [0], [[2, 3, 4, 5, 6, 7]], 4)
        with cpu_decode.blas_gemms():  # a prefill's layers: their GEMMs on oneDNN's packed weights, made at load
            model(prompt, torch.arange(len(prompt)), attn_meta, cache)


def test_attention_never_asks_cudnn(tiny_dirs, monkeypatch):
    """Every SDPA of the varlen path (the padded paged prefill, the no-cache causal and masked forms) runs with cuDNN
    attention off: on the H200 it built a plan per new shape, 46 of a 79 ms one-prompt prefill."""
    import torch.nn.functional as F

    from eagleray.kernels import cpu_decode

    monkeypatch.setattr(cpu_decode, "attention_supported", lambda *a: False)  # the padded SDPA path on this CPU too
    cudnn, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **k: cudnn.append(torch.backends.cuda.cudnn_sdp_enabled()) or real(*a, **k)
    )
    model = LlamaModel.from_dir(tiny_dirs["llama_tied"])
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.forward_full(ids)  # no cache: causal
        tree = AttentionMetadata.build([3], tree_masks=[torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)])
        model(ids[0, :3], torch.tensor([0, 1, 1]), tree)  # no cache: masked
        _paged_forward(model, [ids[0]], [0], [[3, 1, 2]], 4, model.make_kv_cache(num_blocks=4, block_size=4))
    assert len(cudnn) >= 3 * model.arch.num_layers and not any(cudnn)
