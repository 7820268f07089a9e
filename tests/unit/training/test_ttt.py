"""TTT loss and unroll: hand-computed loss, target vocab mapping, shapes, and equality with the inference draft."""

from __future__ import annotations

import math

import pytest
import torch

from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.training.build import draft_module, new_draft, target_embed_and_head
from eagleray.training.ttt import TTTBatch, TTTModel, step_terms, summarize


def test_step_terms_hand_computed():
    # one row, two positions, draft vocab of 2 (target ids 3 and 7)
    logits = torch.tensor([[[0.0, math.log(3.0)], [1.0, 1.0]]])  # q = [.25, .75], [.5, .5]
    probs = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])
    mask = torch.tensor([[1.0, 1.0]])
    in_vocab = torch.tensor([[True, False]])  # position 1: target argmax outside the draft vocab
    draft_ids = torch.tensor([3, 7])
    argmax = torch.tensor([[7, 5]])
    ploss, row, hit = step_terms(logits, probs, mask, in_vocab, argmax, draft_ids)
    want = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))  # only position 0 is trained
    assert ploss.item() == pytest.approx(want, rel=1e-6)
    assert row.tolist() == pytest.approx([want, 1.0, 1.0, 2.0])  # hit at 0 (draft 1 -> target 7), miss at 1
    assert hit.tolist() == [[1.0, 0.0]]
    m = summarize(torch.stack([row, torch.tensor([0.0, 0.0, 0.0, 0.0])]), torch.tensor([3.0, 2.0]), 0.8)
    assert m["acc_0"] == 0.5 and m["sim_tau"] == 1.5 and m["sim_tau_product"] == pytest.approx(1.5)


@pytest.fixture(scope="module")
def model(train_target):
    spec = TargetSpec.from_dir(train_target)
    counts = torch.arange(spec.vocab_size, dtype=torch.float32)  # the highest ids are the most frequent
    embed, head = target_embed_and_head(train_target)
    init = new_draft(spec, counts, 64, seed=1, target_head=head)
    return TTTModel(draft_module(init), embed, head, init.t2d, ttt_steps=3).eval(), spec


def _batch(spec, b=2, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_aux = len(spec.default_aux_layer_ids)
    return TTTBatch(
        torch.randint(0, spec.vocab_size, (b, t), generator=g),
        torch.ones(b, t),
        torch.randn(b, t, n_aux * spec.hidden_size, generator=g),
        torch.randn(b, t, spec.hidden_size, generator=g),
    )


def test_targets_are_restricted_to_the_draft_vocab(model):
    m, spec = model
    final = torch.randn(2, 5, spec.hidden_size)
    probs, argmax, in_vocab = m.targets(final)
    logits = final @ m.target_head.T  # [2, 5, V]
    assert m.draft_ids.tolist() == list(range(spec.vocab_size - 64, spec.vocab_size))
    torch.testing.assert_close(probs, torch.softmax(logits[..., m.draft_ids], -1))
    assert torch.equal(argmax, logits.argmax(-1))
    assert torch.equal(in_vocab, argmax >= spec.vocab_size - 64)


def test_unroll_shapes_and_loss_is_finite(model):
    m, spec = model
    out = m(_batch(spec))
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    assert out.stats.shape == (3, 4) and out.tau.shape == (2,)
    assert out.stats[:, 3].tolist() == [22.0, 20.0, 18.0]  # loss-masked targets per step: B*(T-1-i)
    short = m(_batch(spec, t=3))  # fewer tokens than steps: missing steps are zero rows
    assert short.stats.shape == (3, 4) and short.stats[2].abs().sum() == 0


def test_step0_and_step1_equal_the_inference_draft(model):
    """TTT slot t, step 1 == the engine's draft: a causal pass over the prefix, then one token at t+1."""
    m, spec = model
    d = m.draft
    d._shared_embed = []
    from eagleray.platform.models.tp import TPInfo, VocabParallelEmbedding

    emb = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, TPInfo(), torch.float32)
    emb.weight.data.copy_(m.embed)
    d.share_embedding(emb)
    batch = _batch(spec, b=1, t=10, seed=3)
    ids, aux = batch.input_ids[0], batch.aux[0]
    with torch.no_grad():
        hidden0 = d.combine_hidden_states(batch.aux)  # [1, T, H]
        cache: list = []
        n0, h0 = m.step(torch.nn.functional.pad(ids[1:], (0, 1))[None], torch.arange(10), hidden0, cache)
        n1, _ = m.step(torch.nn.functional.pad(ids[2:], (0, 2))[None], torch.arange(10) + 1, h0, cache)
        t = 6  # slot: prefix x_1..x_{t+1} at positions 0..t, then x_{t+2} at t+1 with the fed-back hidden
        inp = torch.cat([ids[1 : t + 2], ids[t + 2 : t + 3]])
        hid = torch.cat([d.combine_hidden_states(aux[: t + 1]), h0[0, t : t + 1]])
        ref, _ = d(inp, torch.arange(t + 2), hid, AttentionMetadata.build([t + 2]))
    torch.testing.assert_close(n0[0, : t + 1], ref[: t + 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(n1[0, t], ref[t + 1], atol=1e-5, rtol=1e-5)


def test_window_keeps_the_answer_of_long_rows():
    from eagleray.training.data import pad_tokens, window

    row = {"input_ids": list(range(100)), "loss_mask": [0] * 90 + [1] * 8 + [0, 0]}
    assert window(row, 16) == (82, 98)  # ends at the last answer token, keeps 16 tokens
    assert window(row, 1000) == (0, 98)
    ids, mask, spans = pad_tokens([row, {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}], 16)
    assert spans == [(82, 98), (0, 3)] and ids.shape == (2, 16)
    assert mask[0].sum() == 8 and ids[0, 0] == 82 and ids[1, :3].tolist() == [5, 6, 7]


def _dense_forward(m, batch):
    """The unroll with the lm_heads over EVERY position (what TTTModel computed before it gathered the
    loss-masked slots): loss, stats and simulated τ must not change."""
    import torch.nn.functional as F

    from eagleray.training.ttt import _sim_tau

    ids, mask = batch.input_ids, batch.loss_mask.float()
    b, t = ids.shape
    probs, argmax, in_vocab = m.targets(batch.final_hidden)
    hidden, cache, losses, stats, correct = m.draft.combine_hidden_states(batch.aux), [], [], [], []
    for i in range(min(m.ttt_steps, t - 1)):
        n = t - 1 - i
        normed, hidden = m.step(F.pad(ids[:, 1 + i :], (0, 1 + i)), torch.arange(t) + i, hidden, cache)
        sl = slice(1 + i, None)
        ploss, row, hit = step_terms(
            m.draft.compute_logits(normed[:, :n]), probs[:, sl], mask[:, sl], in_vocab[:, sl], argmax[:, sl], m.draft_ids
        )
        losses.append(m.loss_decay**i * ploss)
        correct.append(F.pad(hit, (0, t - 1 - n)))
        stats.append(row)
    return torch.stack(losses).sum(), torch.stack(stats), _sim_tau(correct, mask)


def test_gathered_masked_slots_equal_the_dense_unroll(model):
    m, spec = model
    batch = _batch(spec, b=3, t=14, seed=5)
    mask = torch.zeros(3, 14)
    mask[0, 5:] = 1  # an answer after a prompt
    mask[1, 2:9] = 1  # an answer, then padding
    mask[2, 13] = 1  # one masked token only
    batch.loss_mask = mask
    with torch.no_grad():
        out = m(batch)
        loss, stats, tau = _dense_forward(m, batch)
    torch.testing.assert_close(out.loss, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.stats, stats, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.tau, tau)


def test_bf16_autocast_on_cpu_trains_and_keeps_fp32_soft_labels(model):
    """autocast: bf16 on CPU (AMX) used to fail: the bf16 softmax of the soft labels met an fp32 buffer."""
    m, spec = model
    batch = _batch(spec, seed=3)
    with torch.no_grad():
        exact = m(batch).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(batch)
        probs, _, _ = m.targets(batch.final_hidden)
    out.loss.backward()
    assert probs.dtype == torch.float32 and torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - exact.item()) < 0.05 * abs(exact.item())
    grads = [p.grad for p in m.draft.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    m.zero_grad(set_to_none=True)


def test_chain_walk_steps_by_accepted_length_inside_each_answer_span():
    """Hand-walked: one row, T=10, answers at tokens 2-5 and 8-9 (loss_mask), k=2 drafts a step.

    Span 1 starts at slot 1: correct_0 = 1, correct_1 = 1 -> accepts 2 (+1) -> slot 4: correct_0 = 0 -> 1 ->
    slot 5: the span has ended (mask[6] = 0). Span 2 starts at slot 7: accepts 1 (+1) -> slot 9: past the row.
    Steps: 3 + 1 + 2 = 6 over 3 steps -> chain_tau 2.0; sim_tau counts every slot of both spans instead."""
    from eagleray.training.ttt import _sim_tau, chain_walk

    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 1, 1]], dtype=torch.float32)  # [1, 10]
    c0 = torch.tensor([[0, 1, 1, 1, 0, 0, 0, 1, 0]], dtype=torch.float32)  # [1, 9]: draft 0 right at slot t
    c1 = torch.tensor([[0, 1, 0, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    assert chain_walk([c0, c1], mask).tolist() == [6.0, 3.0]
    sums = _sim_tau([c0, c1], mask).tolist()  # slots 1-4 and 7-8: 3, 2, 3, 1, 2, 1
    assert sums == [12.0, 6.0]
    m = summarize(torch.zeros(2, 4), torch.tensor(sums), 0.8, chain_walk([c0, c1], mask))
    assert m["chain_tau"] == 2.0 and m["sim_tau"] == 2.0
    c0[0, 4] = 1.0  # slot 4 now accepts its first draft: the walk takes 2 there and still stops at the span's end
    assert chain_walk([c0, c1], mask).tolist() == [7.0, 3.0]


def test_held_out_evaluation_reports_chain_tau_and_training_steps_do_not_walk(model):
    m, spec = model
    out = m(_batch(spec))
    assert out.walk is not None and out.walk[1] >= 1  # eval mode (the fixture): the walk is taken
    m.train()
    try:
        assert m(_batch(spec)).walk is None  # a training step: no host sync for the walk
    finally:
        m.eval()
