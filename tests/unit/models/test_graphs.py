"""The no-sync decode path (static buffers, DecodeMetadata, fused step, Triton kernels under the
interpreter) gives the logits of the model's own paged forward, on CPU."""

from __future__ import annotations

import pytest
import torch

from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.graphs import DecodeGraphRunner
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.row_graphs import DecodeRows
from eagleray.tests.support.interpreter import row_invariant_numpy

VOCAB = 96  # conftest.SMALL
BLOCK = 4
TABLES = [[7, 2, 9, 0, 3], [5, 11, -1, -1, -1], [4, 1, 6, -1, -1]]  # non-contiguous; block 13 = pad block
PROMPTS = (13, 5, 9)


def _prefill(model, seqs, cache):
    ids = torch.cat(seqs)  # [T]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])  # [T]
    attn = AttentionMetadata.build([len(s) for s in seqs], [0] * len(seqs), TABLES, BLOCK)
    hidden, _ = model(ids, positions, attn, cache)
    return model.compute_logits(hidden[torch.tensor([len(s) for s in seqs]).cumsum(0) - 1]).argmax(-1)  # [B]


def _eager_step(model, tok, lens, cache):
    """The engine's paged path: one token per sequence at position lens[b]."""
    attn = AttentionMetadata.build([1] * len(lens), list(lens), TABLES, BLOCK)
    hidden, aux = model(tok, torch.tensor(lens), attn, cache)
    return model.compute_logits(hidden), aux


def _runner_step(runner, tok, lens):
    pos = torch.tensor(lens)  # [B]
    tables = torch.tensor(TABLES, dtype=torch.int32)  # [B, 5]
    slots = tables.gather(1, (pos // BLOCK)[:, None]).squeeze(1).long() * BLOCK + pos % BLOCK  # [B]
    return runner.run(DecodeRows(tok, pos, tables, (pos + 1).to(torch.int32), slots))


def _split_plans(monkeypatch):
    """Every product's K split in two (tiny weights are otherwise never split): the reduce kernel's path."""
    import eagleray.kernels.invariant_linear as il
    from eagleray.kernels import invariant_plans

    monkeypatch.setattr(il, "plan", lambda n, k, device=None: invariant_plans.make_plan(n, k, splits=2, block_k=16))


@pytest.mark.parametrize(
    "variant,fused,triton,invariant",
    [
        ("llama_tied", True, False, False),
        ("llama_tied", False, False, False),
        ("llama_tied", True, True, False),
        ("mistral_window", True, True, False),
        ("qwen2", True, False, False),
        ("qwen3", None, False, False),
        ("llama3_rope", False, False, False),
        ("llama_tied", True, True, True),  # the batch-invariant step
        ("qwen2", True, True, "split"),  # ... with biases, every product's K split in two (partial sums reduced)
        ("qwen2", True, True, "unfolded"),  # ... the norms as kernels (a model too large for folded copies)
    ],
)
def test_decode_runner_equals_eager(variant, fused, triton, invariant, tiny_dirs, monkeypatch):
    import eagleray.platform.models.graphs as graphs

    if invariant == "split":
        _split_plans(monkeypatch)
    if invariant == "unfolded":
        monkeypatch.setattr(graphs, "FOLD_MAX_BYTES", 1000)
    model = LlamaModel.from_dir(tiny_dirs[variant], aux_layer_ids=[0, 2, 4])
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPTS]
    eager_kv, fast_kv = (model.make_kv_cache(num_blocks=14, block_size=BLOCK) for _ in range(2))
    runner = DecodeGraphRunner(
        model, fast_kv, max_blocks_per_seq=6, buckets=(1, 2, 4), fused=fused, use_triton=triton, invariant=bool(invariant)
    )
    with torch.inference_mode():
        tok = _prefill(model, seqs, eager_kv)
        fast_kv.k.copy_(eager_kv.k)
        fast_kv.v.copy_(eager_kv.v)
        lens = list(PROMPTS)
        for _ in range(2 if triton else 3):  # batch 3 runs in bucket 4 (one padding row)
            ref, ref_aux = _eager_step(model, tok, lens, eager_kv)
            got, got_aux = _runner_step(runner, tok, lens)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(got_aux, ref_aux, atol=1e-4, rtol=0)
            tok, lens = ref.argmax(-1), [n + 1 for n in lens]
    # the padding row wrote only the pad slot: real blocks of both caches agree
    torch.testing.assert_close(fast_kv.k[:, :13], eager_kv.k[:, :13], atol=1e-5, rtol=0)


def test_from_config_random_model_runs():
    cfg = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = LlamaModel.from_config(cfg, dtype="fp32", aux_layer_ids=[1])
    logits, aux = model.forward_full(torch.randint(0, 64, (2, 5)))
    assert logits.shape == (2, 5, 64) and aux.shape == (2, 5, 32) and torch.isfinite(logits).all()
    assert float(model.norm.weight.min()) == 1.0


@row_invariant_numpy
@pytest.mark.parametrize("one_tile", [False, True])
def test_invariant_rows_score_a_position_alike_alone_in_a_batch_and_in_a_verification(tiny_dirs, monkeypatch, one_tile):
    """The batch-invariant row step (its Triton kernels, interpreted): a position's logits and aux are bitwise the
    same scored alone (plain decode at batch 1), beside other sequences (batch 3) and as row j of a 3-row chain
    verification (k=2), with the attention's splits read in tiles or each as one tile (``ONE_TILE_SPLITS``). (The
    torch references of the CPU path are not: SDPA's batched reduction varies.)"""
    from eagleray.platform.models.decode_metadata import DecodeMetadata

    monkeypatch.setattr(DecodeMetadata, "ONE_TILE_SPLITS", one_tile)
    triton = True
    model = LlamaModel.from_dir(tiny_dirs["llama_tied"], aux_layer_ids=[0, 2, 4])
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPTS]
    kv = model.make_kv_cache(num_blocks=14, block_size=BLOCK)
    runner = DecodeGraphRunner(model, kv, max_blocks_per_seq=6, buckets=(1, 4, 9), invariant=True, use_triton=triton)
    drafts = torch.randint(0, VOCAB, (3, 3), generator=g)  # [B, k+1]: the last token, then 2 drafts
    tables = torch.tensor(TABLES, dtype=torch.int32)

    def score(row_seq, pos, ids):
        pos, t = torch.tensor(pos), tables[torch.tensor(row_seq)]
        slots = t.gather(1, (pos // BLOCK)[:, None]).squeeze(1).long() * BLOCK + pos % BLOCK
        logits, aux = runner.run(DecodeRows(ids, pos, t, (pos + 1).to(torch.int32), slots))
        return logits.clone(), aux.clone()

    with torch.inference_mode():
        _prefill(model, seqs, kv)
        verify = score([b for b in range(3) for _ in range(3)], [n + j for n in PROMPTS for j in range(3)], drafts.reshape(-1))
        alone = [score([1], [PROMPTS[1] + j], drafts[1, j : j + 1]) for j in range(3)]
        batch = [score([0, 1, 2], [n + j for n in PROMPTS], drafts[:, j]) for j in range(3)]
    for j in range(3):
        assert torch.equal(verify[0][3 + j], alone[j][0][0]), f"row {j} of the verification != alone"
        assert torch.equal(verify[1][3 + j], alone[j][1][0])
        for b in range(3):
            assert torch.equal(verify[0][3 * b + j], batch[j][0][b]), f"seq {b} row {j} != batch of 3"


def test_the_norms_fold_once_per_model_or_not_at_all(tiny_dirs, monkeypatch):
    """The invariant Triton step folds RMSNorm into the products with copies of qkv, gate_up and the LM head made once
    per model (every step of it agrees); where the copies are too large, every step keeps the norms as kernels."""
    import eagleray.platform.models.graphs as graphs

    model = LlamaModel.from_dir(tiny_dirs["llama_tied"])
    first, second = (graphs.FusedDecodeStep(model, use_triton=True, invariant=True) for _ in range(2))
    assert first.fold and second.folded_lm_head is first.folded_lm_head
    assert not graphs.FusedDecodeStep(model, use_triton=False, invariant=True).fold  # the CPU kernels: no folding
    monkeypatch.setattr(graphs, "FOLD_MAX_BYTES", 1000)  # copies larger than this are not made
    tight = LlamaModel.from_dir(tiny_dirs["llama_tied"])
    assert not graphs.FusedDecodeStep(tight, use_triton=True, invariant=True).fold
    monkeypatch.undo()
    assert not graphs.FusedDecodeStep(tight, use_triton=True, invariant=True).fold  # decided once for the model


def test_invariant_step_refuses_a_tensor_parallel_or_unfused_model(tiny_dirs):
    from eagleray.platform.errors import EaglerayError
    from eagleray.platform.models.graphs import FusedDecodeStep

    model = LlamaModel.from_dir(tiny_dirs["llama_tied"])
    kv = model.make_kv_cache(num_blocks=4, block_size=BLOCK)
    with pytest.raises(EaglerayError, match="fused=True"):
        DecodeGraphRunner(model, kv, max_blocks_per_seq=2, fused=False, invariant=True)
    model.tp = type(model.tp)(rank=0, world=2)
    with pytest.raises(EaglerayError, match="one rank"):
        FusedDecodeStep(model, use_triton=False, invariant=True)


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
            got, got_aux = runner.run(DecodeRows(tok, pos, t, (pos + 1).to(torch.int32), slots))
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(got_aux, ref_aux, atol=1e-4, rtol=0)
            tok, n = ref.argmax(-1), n + 1
    torch.testing.assert_close(fast_kv.k[:6], eager_kv.k[:6], atol=1e-5, rtol=0)


def test_a_batch_past_the_largest_bucket_is_refused_with_the_fix():
    from eagleray.platform.errors import EaglerayError
    from eagleray.platform.models.row_graphs import pick_bucket

    assert pick_bucket((1, 2, 4), 3, "rows", "-") == 4
    with pytest.raises(EaglerayError, match=r"a batch of 5 sequences exceeds the largest bucket 4\n    fix: max_num_seqs"):
        pick_bucket((1, 2, 4), 5, "sequences", "max_num_seqs")


def test_chain_metadata_equals_each_steps_own():
    """chain_metadata (every chain step's rows computed at once) gives each step j the positions first + j, their
    sequence lengths and cache slots through the block tables, as one step's own metadata would; no steps, no rows."""
    from eagleray.platform.models.row_graphs import chain_metadata

    tables = torch.tensor([[5, 2, 8, 0], [3, 9, 1, 6], [7, 4, 10, 11]], dtype=torch.int32)  # [3, 4]
    first = torch.tensor([3, 6, 9])  # [3]: steps cross block boundaries (block size 4)
    rows = chain_metadata(tables, first, 3, 4, use_triton=True)
    assert len(rows) == 3 and chain_metadata(tables, first, 0, 4, use_triton=True) == []
    for j, (pos, meta) in enumerate(rows):
        want_pos = first + j
        want_slots = torch.stack([tables[b, p // 4].long() * 4 + p % 4 for b, p in enumerate(want_pos.tolist())])
        assert torch.equal(pos, want_pos)
        assert torch.equal(meta.slot_mapping, want_slots) and meta.slot_mapping.is_contiguous()
        assert torch.equal(meta.seq_lens, (want_pos + 1).to(torch.int32)) and meta.seq_lens.dtype == torch.int32
        assert meta.block_tables is tables and meta.block_size == 4 and meta.use_triton
