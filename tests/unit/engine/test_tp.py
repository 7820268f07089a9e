"""Tensor parallelism in the engine: TP=2 (gloo, CPU) greedy output equals TP=1 token for token."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from eagleray.platform.errors import EaglerayError
from tests.unit.engine.conftest import NUM_LAYERS, PROMPTS, make_engine

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def scaled_dir(tiny_dir, tmp_path_factory):
    """The tiny target on disk with the conftest ``target`` fixture's weights (2-D weights x6)."""
    from eagleray.tests.support.tiny import scaled_copy

    return scaled_copy(tiny_dir, tmp_path_factory.mktemp("tp") / "target")


@pytest.fixture(scope="module")
def tp_models(scaled_dir, tmp_path_factory):
    """Rank 0 of a TP=2 target (+ a random draft with a replicated embedding); workers stopped after."""
    from eagleray.platform.config.schemas import DraftConfig, TargetConfig
    from eagleray.serve.engine.loader import close_target, load_models

    tcfg = TargetConfig(model=str(scaled_dir), tensor_parallel_size=2, device="cpu")
    target, draft, tok, _ = load_models(tcfg, DraftConfig(source="random"), tmp_path_factory.mktemp("tp-draft"))
    yield target, draft, tok, list(target.aux_layer_ids)  # aux ids of the random draft
    close_target(target)


def _greedy(engine) -> list[list[int]]:
    from eagleray.serve.engine import SamplingParams

    return [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]


@pytest.fixture(scope="module")
def tp1_plain(target, tokenizer):
    return _greedy(make_engine(target, tokenizer))


@pytest.mark.parametrize("mode", ["plain", "chain-copy", "tree-copy", "chain-random"])
def test_tp2_greedy_equals_tp1(tp_models, tp1_plain, copy_draft, mode):
    target, random_draft, tok, random_aux = tp_models
    target.set_aux_layers(random_aux if mode == "chain-random" else [1, 2, NUM_LAYERS])
    assert target.tp_workers.world == 2 and target.layers[0].self_attn.o_proj.tp.world == 2
    draft = {"plain": None, "chain-copy": copy_draft, "tree-copy": copy_draft, "chain-random": random_draft}[mode]
    tree = dict(depth=3, topk=2, num_draft_tokens=5) if mode == "tree-copy" else None
    engine = make_engine(target, tok, draft, k=3, tree=tree)
    assert _greedy(engine) == tp1_plain
    if mode == "chain-copy":
        assert engine.metrics.spec.num_accepted_tokens > 0  # the copy draft is accepted: rollback and commit both ran


def test_backend_choice_is_explicit():
    """'ray' needs the deployment's placement group, 'mp' takes none, anything else is refused (no fallback)."""
    from eagleray.serve.engine.tp_workers import TPLaunch

    assert TPLaunch().backend == "mp"
    with pytest.raises(EaglerayError, match="placement group"):
        TPLaunch("ray")
    with pytest.raises(EaglerayError, match="placement group"):
        TPLaunch("mp", placement_group=object())
    with pytest.raises(EaglerayError, match="unknown"):
        TPLaunch("threads")


def test_close_stops_workers(tp_models):
    """Last test of the module: engine.close() stops the workers of the shared TP target."""
    target, _, tok, _ = tp_models
    engine = make_engine(target, tok)
    procs = engine.target.workers.procs
    assert all(p.is_alive() for p in procs)
    engine.close()
    engine.close()  # idempotent
    assert not any(p.is_alive() for p in procs)
    assert not dist.is_initialized()
    with pytest.raises(EaglerayError, match="closed"):
        engine.generate(["hi"])


def test_mp_send_never_shares_rank0_tensors():
    """Pickling for a torch.multiprocessing queue moves a CPU tensor's storage into shared memory in
    the queue's feeder thread. Rank 0 must keep private tensors (it reads them while the thread runs):
    this raced once as a garbage slot index in the KV compaction."""
    import torch
    import torch.multiprocessing as mp

    from eagleray.serve.engine.tp_workers import TPWorkers

    q = mp.get_context("spawn").Queue()
    workers = TPWorkers(procs=[], queues=[q], errors=None, world=2)
    src, dst = torch.tensor([11, 12]), torch.tensor([10, 11])
    workers._send("move_kv", (1, src, dst))
    cmd, (rid, got_src, got_dst) = q.get(timeout=30)  # the feeder thread has pickled the payload by now
    assert (cmd, rid) == ("move_kv", 1)
    assert got_src.tolist() == [11, 12] and got_dst.tolist() == [10, 11]
    assert not src.is_shared() and not dst.is_shared()
    q.close()
