"""Greedy speculative output equals plain greedy output token for token (fp32), chain and tree."""

from __future__ import annotations

import itertools

import pytest

from eagleray.serve.engine import SamplingParams

from .conftest import PROMPTS, make_engine

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(target, tokenizer):
    return [o.token_ids for o in make_engine(target, tokenizer).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_chain_greedy_equals_plain(target, tokenizer, copy_draft, plain_outputs, k):
    engine = make_engine(target, tokenizer, copy_draft, k=k)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    snap = engine.metrics.snapshot()
    assert snap["spec_decode_num_accepted_tokens"] > 0, "the copy draft should be accepted sometimes"
    assert len(snap["spec_decode_num_accepted_tokens_per_pos"]) == k


@pytest.mark.parametrize("tree", [dict(depth=2, topk=2, num_draft_tokens=3), dict(depth=4, topk=3, num_draft_tokens=8)])
def test_tree_greedy_equals_plain(target, tokenizer, copy_draft, plain_outputs, tree):
    engine = make_engine(target, tokenizer, copy_draft, tree=tree)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    assert engine.metrics.spec.num_accepted_tokens > 0


@pytest.mark.parametrize(
    "tree",
    [
        dict(depth=2, topk=2, num_draft_tokens=3),
        dict(depth=4, topk=3, num_draft_tokens=8),
        dict(depth=2, topk=5, num_draft_tokens=2),
    ],
)
def test_row_path_tree_greedy_equals_plain(target, tokenizer, copy_draft, plain_outputs, tree, monkeypatch):
    """engine.decode_path='rows': the tree verifies as rows of the target's row step (a node a row, its ancestors
    through its tail), never the varlen forward; greedy output equals plain, with drafts accepted and compacted. The
    row buffers hold a step's rows without prompt rows (prefill_rows 0): its nodes and root, or topk a depth drafted."""
    from eagleray.serve.engine import spec_step

    monkeypatch.setattr(spec_step, "target_verify_forward", None)  # the varlen verification must not run
    engine = make_engine(target, tokenizer, copy_draft, tree=tree, decode_path="rows", max_num_seqs=3, prefill_rows=0)
    assert engine.target.rows.buckets[-1] == 3 * max(tree["num_draft_tokens"] + 1, tree["topk"])
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    assert engine.metrics.spec.num_accepted_tokens > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_random_draft_lossless_and_rollback(target, tokenizer, random_draft, plain_outputs):
    engine = make_engine(target, tokenizer, random_draft, k=3)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    assert engine.blocks.num_free == engine.blocks.num_blocks, "finished requests must return every KV block"


def test_batch_invariance(target, tokenizer, copy_draft, plain_outputs):
    """A request's greedy output does not depend on what else is in the batch (or on preemption)."""
    alone = make_engine(target, tokenizer, copy_draft, k=2).generate(PROMPTS[:1], GREEDY)[0].token_ids
    crowded = make_engine(target, tokenizer, copy_draft, k=2, max_num_seqs=3, num_kv_blocks=16, block_size=4)
    outs = crowded.generate(PROMPTS[1:] + PROMPTS[:1] + PROMPTS[2:3], GREEDY)
    assert alone == plain_outputs[0] == outs[3].token_ids
    assert outs[0].token_ids == plain_outputs[1]
    assert crowded.scheduler.num_preemptions > 0, "the small cache should force a preemption"


@pytest.mark.parametrize("k", [1, 3])
def test_row_path_chain_greedy_equals_plain(target, tokenizer, copy_draft, plain_outputs, k):
    """engine.decode_path='rows' (the GPU path's fixed-shape row step, eager on CPU): plain rows equal the varlen
    plain output, and the speculative rows (catch-up rows, the greedy chain step, k+1 verification rows a
    sequence) equal it too, with drafts accepted; the reserved pad block is never handed out."""
    plain = make_engine(target, tokenizer, decode_path="rows", max_num_seqs=3)
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == plain_outputs
    engine = make_engine(target, tokenizer, copy_draft, k=k, decode_path="rows", max_num_seqs=3)
    assert engine.target.kv.num_blocks == engine.blocks.num_blocks + 1, "the pad block must be outside the pool"
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    assert engine.metrics.spec.num_accepted_tokens > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def _count_row_prefills(engine) -> list:
    calls, real = [], engine.target.prefill_rows

    def counted(rows, last):
        calls.append(rows.num_rows)
        return real(rows, last)

    engine.target.prefill_rows = counted
    return calls


@pytest.mark.parametrize("replay_rows", [256, 4])
def test_row_prefill_scores_prompts_as_rows_and_equals_the_varlen_output(
    target, tokenizer, copy_draft, plain_outputs, monkeypatch, replay_rows
):
    """With the row step, a prefill of at most engine.prefill_rows tokens runs as rows (in replays of the largest
    bucket: 4 rows force several per prompt), a longer one eagerly; greedy plain and speculative output equal the
    varlen engine's either way."""
    from eagleray.serve.engine import startup

    monkeypatch.setattr(startup, "PREFILL_REPLAY_ROWS", replay_rows)
    plain = make_engine(target, tokenizer, decode_path="rows", max_num_seqs=2)
    rows = _count_row_prefills(plain)
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == plain_outputs
    assert rows and plain.target.rows.buckets[-1] == replay_rows  # every prefill ran as rows
    assert replay_rows > 4 or max(rows) > replay_rows, "a prompt longer than a replay takes several"
    spec = make_engine(target, tokenizer, copy_draft, k=2, decode_path="rows", max_num_seqs=2)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == plain_outputs
    eager = make_engine(target, tokenizer, decode_path="rows", max_num_seqs=2, prefill_rows=3)  # shorter than prompts
    calls = _count_row_prefills(eager)
    assert [o.token_ids for o in eager.generate(PROMPTS, GREEDY)] == plain_outputs
    assert calls == [], "a prefill longer than engine.prefill_rows runs the eager forward"


def _spy_prefills(engine) -> list:
    """Record each prefill path's call as (path, [uncached tokens of each sequence])."""
    calls, steps = [], engine.steps
    for name in ("_prefill_rows", "_prefill_eager"):
        real = getattr(steps, name)

        def spied(seqs, ends, chunk, real=real, name=name):
            calls.append((name, [ends[id(s)] - s.num_cached for s in seqs]))
            return real(seqs, ends, chunk)

        setattr(steps, name, spied)
    return calls


def test_the_prefill_path_depends_on_the_sequence_not_on_its_step(target, tokenizer, copy_draft, plain_outputs):
    """A speculative engine's sequences join one by one where a plain engine prefills several at once; a path chosen
    by the step's total (rows up to engine.prefill_rows, else eager) prefilled the same prompt on different paths in
    the two engines, and bf16 outputs on the H200 differed at batch 8-128. Each sequence picks its own: the prompts
    that fit run as rows together, a longer one eagerly by itself, in any company."""
    probe = make_engine(target, tokenizer, decode_path="rows", max_num_seqs=4)
    sizes = _spy_prefills(probe)
    probe.generate(PROMPTS, GREEDY)
    lengths = sorted(n for _, ns in sizes for n in ns)
    limit = lengths[-2]  # every prompt but the longest fits
    assert lengths[-1] > limit and sum(lengths) > limit, "the test needs one longer prompt and a total over the limit"
    plain = make_engine(target, tokenizer, decode_path="rows", max_num_seqs=4, prefill_rows=limit)
    calls = _spy_prefills(plain)
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == plain_outputs
    assert [ns for path, ns in calls if path == "_prefill_eager"] == [[lengths[-1]]], calls  # alone
    assert sorted(n for path, ns in calls if path == "_prefill_rows" for n in ns) == lengths[:-1], calls
    assert max(len(ns) for path, ns in calls if path == "_prefill_rows") > 1, "the short prompts share a step"
    spec = make_engine(target, tokenizer, copy_draft, k=2, decode_path="rows", max_num_seqs=1, prefill_rows=limit)
    calls = _spy_prefills(spec)  # one sequence a step: the same path per prompt as the plain engine's
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == plain_outputs
    assert sorted(calls) == sorted([("_prefill_rows", [n]) for n in lengths[:-1]] + [("_prefill_eager", [lengths[-1]])])
    varlen = make_engine(target, tokenizer, max_num_seqs=4)  # no row step: one eager forward for the step, as before
    calls = _spy_prefills(varlen)
    assert [o.token_ids for o in varlen.generate(PROMPTS, GREEDY)] == plain_outputs
    assert calls == [("_prefill_eager", sizes[0][1])], "the varlen engine prefills a step's sequences together"


def test_plain_rows_pad_their_bucket_with_rows_at_the_pad_block(target, tokenizer):
    """Rows past the batch (3 sequences run in bucket 4) are staged as a token at the pad block's first slot, never
    as what an earlier, larger batch left there: the graph writes every row's K/V, and a stale row's would land in
    a live sequence's block."""
    from types import SimpleNamespace

    engine = make_engine(target, tokenizer, decode_path="rows", max_num_seqs=4)
    stage = engine.steps.stage
    stage.host[:] = 7  # an earlier batch's rows
    seqs = [SimpleNamespace(last_token=11 + b, num_tokens=5, block_table=[2 + b]) for b in range(3)]
    assert engine.steps._stage_rows(seqs) == 4
    assert list(stage.host[2, :3]) == [13, 4, 4]  # token, its position, the block table
    assert list(stage.host[3, :2]) == [0, 0] and (stage.host[3, 2:] == engine.target.rows.pad_block).all()
    assert engine.target.rows.pad_block >= engine.blocks.num_blocks  # outside the pool


def test_row_path_refuses_what_it_cannot_run(target, tokenizer):
    from eagleray.platform.errors import EaglerayError

    target.tp = type(target.tp)(rank=0, world=2)
    try:
        with pytest.raises(EaglerayError, match="decode_path='rows' but the target is tensor-parallel"):
            make_engine(target, tokenizer, decode_path="rows")
        assert not make_engine(target, tokenizer, decode_path="auto").use_rows
    finally:
        target.tp = type(target.tp)()


def _count_graph_steps(monkeypatch) -> list[tuple[int, int]]:
    """Record (bucket, k) of every verification on the step graphs."""
    from eagleray.platform.models.spec_graphs import ChainStepGraphs

    calls: list[tuple[int, int]] = []
    verify = ChainStepGraphs.verify
    monkeypatch.setattr(ChainStepGraphs, "verify", lambda self, bucket, k: calls.append((bucket, k)) or verify(self, bucket, k))
    return calls


def test_row_path_greedy_chains_run_on_the_step_graphs(target, tokenizer, copy_draft, plain_outputs, monkeypatch):
    """Greedy chain steps on the row path run on ChainStepGraphs (one staging copy, drafting + verification):
    with k changing between steps, plain steps between them (the draft then lags by more than a step's catch-up
    and is settled first) and sequences joining mid-flight (2 slots, 4 prompts), the output equals plain."""
    calls = _count_graph_steps(monkeypatch)
    engine = make_engine(target, tokenizer, copy_draft, k=3, decode_path="rows", max_num_seqs=2)
    ks = itertools.cycle([3, 1, 0, 2, 0, 0, 0, 0, 0, 3, 3])
    monkeypatch.setattr(engine.policy, "choose", lambda batch=1: next(ks))
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    assert {k for _, k in calls} == {1, 2, 3} and {b for b, _ in calls} == {1, 2}
    assert engine.metrics.spec.num_accepted_tokens > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_sampled_rows_keep_the_step_by_step_path(target, tokenizer, copy_draft, monkeypatch):
    """A batch with a sampled row does not run on the (greedy) step graphs."""
    calls = _count_graph_steps(monkeypatch)
    engine = make_engine(target, tokenizer, copy_draft, k=2, decode_path="rows", max_num_seqs=2)
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=1))
    assert calls == [] and engine.metrics.spec.num_drafts > 0


def test_a_step_that_captured_a_graph_is_no_cost_measurement(target, tokenizer, copy_draft, monkeypatch):
    """The adaptive policy does not learn step costs from a step that captured a CUDA graph (capture time is
    not the step's cost): here every graph step 'captures' once, so none is observed."""
    from eagleray.platform.models.spec_graphs import ChainStepGraphs

    draft = ChainStepGraphs.draft

    def capturing(self, bucket, k):
        self.graphs.captures += 1
        return draft(self, bucket, k)

    monkeypatch.setattr(ChainStepGraphs, "draft", capturing)
    engine = make_engine(target, tokenizer, copy_draft, k=2, decode_path="rows", max_num_seqs=2)
    engine.generate(PROMPTS[:2], GREEDY)
    assert engine.metrics.spec.num_drafts > 0
    assert all(c.spec_steps == 0 for c in engine.policy.costs.values())


def test_a_long_prompt_settles_the_draft_in_chunks_of_rows(target, tokenizer, copy_draft, monkeypatch):
    """After the prefill of a prompt longer than the draft's row buffers (k=1, one slot: 2 rows), the draft catches up
    in chunks of rows before the step graphs run; greedy output still equals plain, and drafts are accepted."""
    calls = _count_graph_steps(monkeypatch)
    prompt = " ".join(PROMPTS * 3)
    plain = make_engine(target, tokenizer, decode_path="rows", max_num_seqs=1).generate([prompt], GREEDY)[0].token_ids
    # prefill_rows 0: the row buffers sized by decoding alone (prompt rows would make them 256)
    engine = make_engine(target, tokenizer, copy_draft, k=1, decode_path="rows", max_num_seqs=1, prefill_rows=0)
    assert engine.drafts.spec.draft.max_rows == 2
    assert engine.generate([prompt], GREEDY)[0].token_ids == plain
    assert calls and engine.metrics.spec.num_accepted_tokens > 0
