"""A draft tree verified as rows of the batch-invariant row step (its Triton kernels, interpreted): every node's logits
and aux are bitwise those of plain decoding along its path, and the K/V it writes at its scratch slot are bitwise
what plain decoding writes at its position (the accepted path is moved there)."""

from __future__ import annotations

import torch

from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.graphs import DecodeGraphRunner
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.row_graphs import DecodeRows
from eagleray.serve.engine.tree import DraftTree, tree_rows
from eagleray.tests.support.interpreter import row_invariant_numpy

from .conftest import NUM_LAYERS

BLOCK = 4
TABLES = [[5, 2, 8, 0], [3, 9, 1, 6]]  # non-contiguous; block 11 = the pad block
PROMPTS = (6, 9)
WIDTH = 4  # the deepest path (depth 3) + 1
TREES = [
    DraftTree(torch.tensor([7, 11, 3, 19, 23]), torch.tensor([0, 0, 1, 1, 3]), torch.tensor([1, 1, 2, 2, 3])),
    DraftTree(torch.tensor([13, 2, 29]), torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3])),  # a chain
]


def _prefilled(model, seqs):
    """A KV cache holding the prompts' K/V but their last tokens' (the tree's roots)."""
    kv = model.make_kv_cache(num_blocks=12, block_size=BLOCK)
    attn = AttentionMetadata.build([len(s) - 1 for s in seqs], [0] * len(seqs), TABLES, BLOCK)
    model(torch.cat([s[:-1] for s in seqs]), torch.cat([torch.arange(len(s) - 1) for s in seqs]), attn, kv)
    return kv


def _slot(b: int, pos: int) -> int:
    return TABLES[b][pos // BLOCK] * BLOCK + pos % BLOCK


@row_invariant_numpy
def test_tree_rows_score_every_node_bitwise_like_plain_decoding_along_its_path(tiny_dir):
    model = LlamaModel.from_dir(tiny_dir, aux_layer_ids=[1, 2, NUM_LAYERS])
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 40, (n,), generator=g) for n in PROMPTS]
    starts, roots = [n - 1 for n in PROMPTS], [int(s[-1]) for s in seqs]
    with torch.inference_mode():
        tree_kv, plain_kv = _prefilled(model, seqs), _prefilled(model, seqs)
        tree = DecodeGraphRunner(model, tree_kv, 4, buckets=(16,), invariant=True, use_triton=True, tail_width=WIDTH)
        rows = tree_rows(TREES, roots, starts, torch.tensor(TABLES, dtype=torch.int32), BLOCK, WIDTH)
        logits, aux = (t.clone() for t in tree.run(rows))  # [R, V], [R, A]
        plain = DecodeGraphRunner(model, plain_kv, 4, buckets=(1,), invariant=True, use_triton=True)
        first = 0
        for b, t in enumerate(TREES):
            tokens = [roots[b]] + t.tokens.tolist()
            leaves = set(range(t.size + 1)) - set(t.parents.tolist())
            for leaf in sorted(leaves):
                for depth, node in enumerate(t.paths()[leaf]):  # plain decoding along the path, a token a step
                    pos = torch.tensor([starts[b] + depth])
                    one = DecodeRows.of(
                        torch.tensor([tokens[node]]), pos, torch.tensor(TABLES[b : b + 1], dtype=torch.int32), BLOCK
                    )
                    want, want_aux = plain.run(one)
                    assert torch.equal(logits[first + node], want[0]), f"sequence {b} node {node}: logits != plain"
                    assert torch.equal(aux[first + node], want_aux[0]), f"sequence {b} node {node}: aux != plain"
                    src, dst = _slot(b, starts[b] + node), _slot(b, starts[b] + depth)  # scratch, then its position
                    for cache, ref in ((tree_kv.k, plain_kv.k), (tree_kv.v, plain_kv.v)):
                        got = cache.view(NUM_LAYERS, -1, *cache.shape[3:])[:, src]  # [L, Hkv, D]
                        assert torch.equal(got, ref.view(NUM_LAYERS, -1, *ref.shape[3:])[:, dst])
            first += t.size + 1


def test_tree_rows_lay_out_nodes_with_their_paths():
    """tree_rows: node i at position start + depth, its K/V at cache index start + i, its tail the slots of its
    path's cache indices (padded with its own)."""
    rows = tree_rows(TREES[:1], [4], [5], torch.tensor(TABLES[:1], dtype=torch.int32), BLOCK, WIDTH)
    assert rows.input_ids.tolist() == [4, 7, 11, 3, 19, 23]
    assert rows.positions.tolist() == [5 + d for d in (0, 1, 1, 2, 2, 3)]
    assert rows.seq_lens.tolist() == [p + 1 for p in rows.positions.tolist()]
    assert rows.slots.tolist() == [_slot(0, 5 + i) for i in range(6)]
    assert rows.tail_start.tolist() == [5] * 6
    paths = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 1, 3, 5]]
    assert rows.tail_slots.tolist() == [[_slot(0, 5 + n) for n in p + [p[-1]] * (WIDTH - len(p))] for p in paths]


def test_rows_with_tails_wider_than_the_buffers_are_refused_with_the_fix(tiny_dir):
    import pytest

    from eagleray.platform.errors import EaglerayError

    model = LlamaModel.from_dir(tiny_dir, aux_layer_ids=[1, 2, NUM_LAYERS])
    runner = DecodeGraphRunner(model, model.make_kv_cache(12, BLOCK), 4, buckets=(16,), invariant=True, tail_width=2)
    rows = tree_rows(TREES, [1, 2], [5, 8], torch.tensor(TABLES, dtype=torch.int32), BLOCK, WIDTH)
    with pytest.raises(
        EaglerayError, match=r"tails of 4 positions but the row buffers hold tails of 2\n    fix: .*tail_width >= 4"
    ):
        runner.run(rows)


def _recorded(engine, monkeypatch, feed: str) -> tuple[list, list]:
    """Record the (tokens, parents) of every tree the engine drafts, and the logits of every depth's ``feed``."""
    from eagleray.serve.engine import spec_step, tree_draft

    trees, logits, real, call = [], [], tree_draft.draft_tree, getattr(tree_draft, feed).__call__

    def recording(*args):
        out = real(*args)
        trees.append([(t.tokens.tolist(), t.parents.tolist()) for t in out])
        return out

    def feeding(self, *args):
        out = call(self, *args)
        logits.append(out[0].float().clone())  # [B*k, Vd]
        return out

    monkeypatch.setattr(spec_step, "draft_tree", recording)
    monkeypatch.setattr(getattr(tree_draft, feed), "__call__", feeding)
    return trees, logits


def test_the_draft_tree_on_rows_equals_the_eager_draft_tree(target, tokenizer, tiny_dir, tmp_path, monkeypatch):
    """engine.decode_path='rows': the draft feeds each depth's frontier alone as rows (its fed ancestors through the
    tail) and never runs its eager forward; its logits at every depth are the eager draft's (fp32, up to rounding),
    and so are the trees it drafts."""
    from eagleray.platform.checkpoints.draft_factory import make_random_draft
    from eagleray.platform.checkpoints.target import TargetSpec
    from eagleray.platform.models.eagle3 import Eagle3Draft
    from eagleray.serve.engine import SamplingParams, tree_draft

    from .conftest import PROMPTS, make_engine

    path = make_random_draft(TargetSpec.from_dir(tiny_dir), tmp_path / "draft", aux_layer_ids=[1, 2, NUM_LAYERS])
    draft = Eagle3Draft.from_checkpoint(path, target)
    params, tree = SamplingParams(max_tokens=10, ignore_eos=True), dict(depth=4, topk=3, num_draft_tokens=8)
    eager = make_engine(target, tokenizer, draft, tree=tree, max_num_seqs=2)
    want, want_logits = _recorded(eager, monkeypatch, "_EagerFeed")
    eager.generate(PROMPTS, params)
    rows = make_engine(target, tokenizer, draft, tree=tree, decode_path="rows", max_num_seqs=2)
    got, got_logits = _recorded(rows, monkeypatch, "_RowFeed")
    monkeypatch.setattr(tree_draft, "_forward_fed", None)  # the eager draft forward must not run
    rows.generate(PROMPTS, params)
    assert len(want) > 4 and got == want
    assert len(got_logits) == len(want_logits) == 3 * len(want)  # depths 2..4 of every step
    for g, w in zip(got_logits, want_logits):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
