"""The engine's draft slot: the serving draft, the one before it, and the target layers each reads.

    install(draft, aux_layer_ids)   the serving draft becomes the previous one; ``draft`` serves,
                                    reading ``aux_layer_ids`` of the target (default: what it captures now)
    request_rollback()              the watchdog's action: back to the previous draft at the next step
    take_rollback()                 (draft, aux ids) of a pending rollback, once

A draft swap recomputes running sequences (the engine preempts them); this module holds no
sequence state, only which draft runs and what it reads.
"""

from __future__ import annotations

from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.spec_graphs import ChainStepGraphs
from eagleray.serve.engine.model_runner import DraftRunner, TargetRunner, row_buckets
from eagleray.serve.engine.profile import StepProfiler
from eagleray.serve.engine.spec_context import SpecContext
from eagleray.serve.engine.startup import CpuThreads
from eagleray.serve.engine.verifier import Verifier


class DraftSlot:
    """``draft_rows``: run the draft on row graphs sized like the target's; for a chain (``tree_depth`` 0) also greedy
    chain steps of up to ``max_seqs`` sequences on :class:`ChainStepGraphs`, of up to ``chain_steps`` + 1 tokens
    (k_max - 1: the greedy chain steps the step graphs are captured for); for a tree of ``tree_depth`` its nodes as
    rows with tails (:mod:`~eagleray.serve.engine.tree_draft`)."""

    def __init__(
        self,
        target: TargetRunner,
        verify_backend: str,
        prof: StepProfiler,
        draft_rows: bool,
        chain_steps: int,
        max_seqs: int,
        tree_depth: int,
        threads: CpuThreads,
    ):
        self.target = target
        self.threads = threads
        self.max_seqs = max_seqs
        self.verify_backend = verify_backend
        self.prof = prof
        self.chain_steps, self.tree_depth = chain_steps, tree_depth
        # max rows, max blocks, tail width (a tree node attends to up to tree_depth - 1 drafted ancestors and itself)
        self.rows = (target.rows.buckets[-1], target.rows.max_blocks, tree_depth) if draft_rows else (0, 0, 0)
        self.spec: SpecContext | None = None  # what a speculative step runs with the serving draft
        self.aux_layer_ids: list[int] = []  # the target layers the serving draft reads
        self.previous: Eagle3Draft | None = None
        self.previous_aux: list[int] = []  # the target layers ``previous`` reads
        self.rollback_pending = False

    @property
    def current(self) -> Eagle3Draft | None:
        return self.spec.draft.draft if self.spec is not None else None

    def install(self, draft: Eagle3Draft, aux_layer_ids: list[int] | None = None) -> None:
        """Serve ``draft``; the serving draft (if any) becomes the previous one."""
        if self.spec is not None:
            self.previous, self.previous_aux = self.current, list(self.aux_layer_ids)
        if aux_layer_ids is not None:
            self.target.model.set_aux_layers(aux_layer_ids)
        runner = DraftRunner(draft, self.target.kv.num_blocks, self.target.block_size, *self.rows)
        if runner.rows is not None:  # CUDA: every bucket's graph now, not inside the first requests' steps
            runner.rows.capture()  # catch-up and chain rows; greedy chains run on ChainStepGraphs below
        self.aux_layer_ids = list(self.target.model.aux_layer_ids)
        verifier = Verifier(self.verify_backend, draft.d2t, self.target.vocab_size)
        graphs = None
        if runner.rows is not None and self.tree_depth == 0:
            graphs = ChainStepGraphs(
                self.target.rows, runner.rows, verifier.chain_greedy, row_buckets(self.max_seqs), self.chain_steps + 1
            )
            graphs.capture(range(1, self.chain_steps + 2))  # CUDA: every bucket and k now, not inside requests' steps
        self.spec = SpecContext(self.target, runner, verifier, self.prof, self.threads, graphs=graphs)

    def request_rollback(self) -> bool:
        """Switch back to the previous draft before the next step; False when there is none."""
        if self.previous is None:
            return False
        self.rollback_pending = True
        return True

    def take_rollback(self) -> tuple[Eagle3Draft, list[int]] | None:
        """The (draft, aux layer ids) a pending rollback returns to; clears it. None when none is pending."""
        if not self.rollback_pending:
            return None
        self.rollback_pending = False
        return self.previous, self.previous_aux
