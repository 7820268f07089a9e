"""LLMEngine: add requests, step (prefill | plain decode | speculative decode), stream, generate.

engine = LLMEngine.from_config(EngineConfig(draft=DraftConfig(source="random")))
outs = engine.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, Iterable

import torch

from eagleray.kernels import cpu_decode
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.llama import LlamaModel
from eagleray.serve.engine import startup
from eagleray.serve.engine.admission import check_request
from eagleray.serve.engine.block_manager import BlockManager
from eagleray.serve.engine.config import EngineConfig
from eagleray.serve.engine.draft_catch_up import joined_positions
from eagleray.serve.engine.draft_slot import DraftSlot
from eagleray.serve.engine.metrics import EngineMetrics
from eagleray.serve.engine.model_runner import TargetRunner
from eagleray.serve.engine.outputs import CapturedHidden, Detokenizer, RequestOutput, make_output
from eagleray.serve.engine.policy import AdaptivePolicy
from eagleray.serve.engine.profile import StepProfiler
from eagleray.serve.engine.sampling import SamplingParams
from eagleray.serve.engine.scheduler import Scheduler
from eagleray.serve.engine.sequence import Sequence
from eagleray.serve.engine.spec_context import SeqResult
from eagleray.serve.engine.spec_step import chain_step, tree_step
from eagleray.serve.engine.step_wall import StepWall
from eagleray.serve.engine.target_steps import TargetSteps
from eagleray.serve.engine.watchdog import AcceptanceWatchdog

logger = logging.getLogger(__name__)
Prompt = str | list[int] | list[dict]  # text, token ids, or OpenAI chat messages


class LLMEngine:
    def __init__(self, target: LlamaModel, tokenizer, config: EngineConfig, draft: Eagle3Draft | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.device = target.norm.weight.device
        self.linear_backend = cpu_decode.configure(config.cpu_kernels) if self.device.type == "cpu" else "cuda"
        self.heap_mmap_threshold = startup.configure_heap(config, self.device)
        self.threads = startup.CpuThreads(self.linear_backend == "native")
        self.max_model_len = min(
            config.target.max_model_len or target.arch.max_positions or 4096, target.arch.max_positions or 1 << 30
        )
        nblocks = config.num_kv_blocks or startup.default_num_blocks(config, target, draft, self.max_model_len)
        dcfg = config.draft
        self.tree = dcfg.tree if dcfg is not None else None
        k_max = (self.tree.depth if self.tree is not None else dcfg.num_speculative_tokens) if dcfg is not None else 0
        self.use_rows = startup.use_rows(config, target, self.device)
        self.blocks = BlockManager(nblocks, config.block_size)
        self.scheduler = Scheduler.for_engine(self.blocks, config, self.device)
        # rows a step runs a sequence: a chain verifies k+1, a tree drafts topk a depth and verifies its nodes and root
        verified = k_max + 1 if self.tree is None else max(self.tree.num_draft_tokens + 1, self.tree.topk)
        rows = config.max_num_seqs * verified if self.use_rows else 0
        if rows and config.prefill_rows:
            rows = max(rows, min(config.prefill_rows, startup.PREFILL_REPLAY_ROWS))  # prompt rows a replay
        max_blocks = self.blocks.blocks_for(self.max_model_len + self._lookahead(k_max))
        # with graphs one more block, never handed out, takes the padding rows' K/V (the cache's last slot)
        depth = self.tree.depth if self.tree is not None else 0  # tails: a node's path, the root to itself
        self.target = TargetRunner(
            target, nblocks + 1 if self.use_rows else nblocks, config.block_size, rows, max_blocks, depth + 1
        )
        if self.use_rows:
            self.target.rows.capture()  # CUDA: every bucket's graph now (a no-op on CPU)
        self.metrics = EngineMetrics(prefix=self.blocks.stats)
        self.prof = StepProfiler(self.device, config.profile_steps)
        self.wall = StepWall()  # the policy's clock: a decode step lasts until the next step starts
        self.steps = TargetSteps(self.target, self.blocks.block_size, self.device, self.prof, self.threads, self.use_rows, config)
        if self.use_rows:
            self.steps.capture()  # CUDA: the staged plain step's graph of every bucket (a no-op on CPU)
        self.detok = Detokenizer(tokenizer)
        self.eos_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self._rng = random.Random(config.seed)
        self._seqs: dict[str, Sequence] = {}
        self._callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        steps = k_max - 1 if self.tree is None else 0
        self.drafts = DraftSlot(
            self.target, config.verify_backend, self.prof, self.use_rows, steps, config.max_num_seqs, depth, self.threads
        )
        self._last_accepted: list[int] = []  # accepted drafts per sequence of the last speculative step
        self.capture_width = 0  # > 0 after enable_capture: the target's aux rows end with its final hidden [H]
        self.policy = AdaptivePolicy(
            k_max, dcfg.policy.adaptive if dcfg else False, config.plain_probe_interval, can_lower_k=self.tree is None
        )
        self.watchdog = AcceptanceWatchdog(dcfg.policy, self._on_low_acceptance) if dcfg else None
        if draft is not None:
            if dcfg is None:
                raise EaglerayError(
                    "a draft model was given but config.draft is None\n    fix: set config.draft (num_speculative_tokens, tree, policy)"
                )
            self.drafts.install(draft)
            self.metrics.speculation_enabled = True
        self._use_prefix_cache()

    @classmethod
    def from_config(cls, config: EngineConfig, workdir=None, tp_launch=None) -> "LLMEngine":
        """``tp_launch``: how tensor-parallel ranks start (a :class:`~eagleray.serve.engine.tp_workers.TPLaunch`; default 'mp')."""
        from eagleray.serve.engine.loader import load_models

        target, draft, tokenizer, _ = load_models(config.target, config.draft, workdir, tp_launch)
        return cls(target, tokenizer, config, draft)

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> str:
        """Queue a request; ``on_output`` is called with each step's delta (streaming)."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        need = self.blocks.blocks_for(len(ids) + params.max_tokens + self._lookahead(self.policy.k_max))
        check_request(ids, params, self.max_model_len, need, self.blocks.num_blocks, bool(self.capture_width))
        rid = request_id or f"req-{len(self._seqs)}-{self._rng.getrandbits(32):08x}"
        if rid in self._seqs:
            raise EaglerayError(f"request_id {rid!r} is already in use\n    fix: pass a unique request_id")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        seq = Sequence(ids, params, rid, seed=seed, generator=torch.Generator().manual_seed(seed))
        self._seqs[rid] = seq
        if on_output is not None:
            self._callbacks[rid] = on_output
        self.scheduler.add(seq)
        return rid

    def enable_capture(self) -> None:
        """Let requests ask for the target's hidden states (``SamplingParams.capture_states``).

        The target then appends its final normed state to the aux rows it returns (one concatenation
        a step); the draft still reads only its aux columns."""
        if self.drafts.spec is None:
            raise EaglerayError(
                "capture needs a draft: without one the target computes no aux hidden states\n"
                "    fix: serve with a draft (draft.source), or turn capture off"
            )
        if self.target.rows is not None:
            raise EaglerayError(
                f"capture reads the target's final hidden states from the varlen forward; engine.decode_path "
                f"{self.config.decode_path!r} runs the row step, which returns logits only\n"
                f"    fix: set engine.decode_path: varlen while capturing"
            )
        self.target.capture_final = True
        self.capture_width = self.target.model.hidden_size

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            self.scheduler.abort(seq)
        self._callbacks.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.wall.idle()  # waiting for requests is no step's cost

    # ----------------------------------------------------------------- drafts
    def swap_draft(self, draft: Eagle3Draft, aux_layer_ids: list[int] | None = None) -> None:
        """Hot-swap between steps: running sequences are recomputed so no draft state crosses the swap.

        ``aux_layer_ids``: the target layers ``draft`` reads (default: what the target captures now,
        i.e. the caller already set them with :meth:`set_aux_layers`).
        """
        self.scheduler.preempt_all()
        self.drafts.install(draft, aux_layer_ids)
        self._use_prefix_cache()
        self.metrics.speculation_enabled = True
        self.policy.enable()
        self.wall.drop()  # the step before the swap: the old draft's, its interval holding the swap's seconds
        if self.watchdog is not None:
            self.watchdog.reset()

    def _on_low_acceptance(self, action: str, tau: float) -> None:
        self.metrics.watchdog_fired = True
        if action == "disable":
            self.policy.disable(f"acceptance watchdog (τ={tau:.3f})")
        elif action == "rollback":
            if self.drafts.request_rollback():
                logger.warning("acceptance watchdog: rolling back to the previous draft")
            else:
                self.policy.disable(f"acceptance watchdog (τ={tau:.3f}); no previous draft to roll back to")

    # ----------------------------------------------------------------- step
    def _use_prefix_cache(self) -> None:  # engine.prefix_caching, keyed for the draft installed now (or none)
        self.blocks.use_prefix_cache(startup.prefix_caching(self.config, self.device), self.drafts.spec is not None)

    def _lookahead(self, k: int) -> int:
        if k == 0:
            return 1
        if self.tree is not None:
            return max(self.tree.num_draft_tokens + 1, self.tree.topk * (self.tree.depth - 1))
        return k + 1

    def step(self) -> list[RequestOutput]:
        """One engine step; returns an output (delta) for every request that advanced."""
        with self.threads.stepping():
            started = self.wall.begin()  # the last decode step's interval ends here
            k, batch = self._schedule()
            if batch is None:
                self.wall.idle()
                return []
            results, seconds = self._run(batch, k)
            return self._postprocess(batch, k, results, seconds, started)

    def _schedule(self):
        """-> (k, batch): a pending rollback first, then the draft length and the sequences of this step."""
        with self.prof.phase("schedule"):
            rollback = self.drafts.take_rollback()
            if rollback is not None:
                self.swap_draft(*rollback)  # drafts may read different target layers
            k = self.policy.choose(max(len(self.scheduler.running), 1)) if self.drafts.spec is not None else 0
            batch = self.scheduler.schedule(self._lookahead(k))
            if k and batch is not None and not batch.is_prefill:  # while acceptance is unknown, a few speculate
                batch = batch.least_behind(self.policy.measuring_seqs(len(batch.seqs)))
            return k, batch

    def _run(self, batch, k: int) -> tuple[list[SeqResult], float]:
        """Prefill, plain decode or a speculative step -> one result per sequence, and the seconds it took."""
        t0 = time.perf_counter()
        if batch.is_prefill:
            if self.drafts.spec is not None:  # the prompt positions the draft will catch up on (join_cost)
                self.policy.joins.joined(joined_positions(batch.joining), len(batch.joining))
                self.policy.joins.emitted(batch.decoding)  # the running sequences' tokens of a mixed step
            results = self.steps.prefill(batch.seqs, batch.chunk)
        else:
            results = self.steps.decode(batch.seqs, self.drafts.spec is not None) if k == 0 else self._speculate(batch.seqs, k)
        return results, time.perf_counter() - t0

    def _postprocess(self, batch, k: int, results: list[SeqResult], seconds: float, started: float) -> list[RequestOutput]:
        """Commit each sequence's tokens (a partial prompt's positions), emit its output, account the step."""
        seqs = batch.completing
        with self.prof.phase("commit"):
            if batch.chunk:
                self._commit_chunk(batch.seqs[-1], results[-1], batch.chunk)
            kept = [self._commit(seq, res) for seq, res in zip(seqs, results)]
        with self.prof.phase("output"):
            shown = [seq for seq in seqs if seq.params.detokenize]
            texts = dict(zip(map(id, shown), self.detok.update_many(shown)))  # one batched decode a step
            outputs = [self._emit(seq, toks, texts.get(id(seq), ("", ""))) for seq, toks in zip(seqs, kept)]
        self._account(batch, k, sum(map(len, kept)), seconds, started)
        return outputs

    def _account(self, batch, k: int, emitted: int, seconds: float, started: float) -> None:
        """Metrics, the adaptive policy's cost tables and the profiler, after a step (``seconds`` of model work in a
        step that started at ``started``; its ``whole`` time inside the engine, scheduling and outputs included)."""
        whole = self.wall.clock() - started
        n = len(batch.seqs)
        kind = "prefill" if batch.is_prefill else ("spec" if k else "plain")
        times = {"prefill": self.metrics.prefill, "spec": self.metrics.speculative, "plain": self.metrics.plain}[kind]
        times.add(emitted, seconds, whole)
        # the policy compares whole steps, until the next one starts (StepWall): host work is paid per step, so a step
        # emitting two tokens a sequence halves it (at 64 sequences on the H200 k=4 gained 1.10x wall, its model 0.67x)
        if kind == "plain" and self.drafts.spec is not None and self.steps.measured:  # a capture is no measurement
            self.wall.defer(started, whole, self.policy.observe_plain, n)
        elif kind == "spec" and self.drafts.spec.measured:  # a step that captured a graph is no measurement
            spec = self.drafts.spec
            args = (n, k, spec.draft_seconds, spec.lag_seconds, self._last_accepted, (spec.join_seconds, spec.join_positions))
            self.wall.defer(started, whole, self.policy.observe_spec_wall, *args)
        self.prof.end_step(kind, n)
        self.metrics.current_k = self.policy.k if self.policy.speculating else 0
        self.metrics.speculation_enabled = self.drafts.spec is not None and self.policy.speculating
        self.metrics.num_preemptions = self.scheduler.num_preemptions

    def _speculate(self, seqs: list[Sequence], k: int) -> list[SeqResult]:
        if self.tree is not None:
            results = tree_step(self.drafts.spec, seqs, self.tree.depth, self.tree.topk, self.tree.num_draft_tokens)
        else:
            results = chain_step(self.drafts.spec, seqs, k)
        max_pos = self.tree.depth if self.tree is not None else k
        self._last_accepted = [res.num_accepted for res in results]
        for seq, res in zip(seqs, results):
            seq.spec.record(res.num_draft_tokens, res.num_accepted, max_pos)
            self.metrics.record_verification(res.num_draft_tokens, res.num_accepted, max_pos)
            if self.watchdog is not None:
                self.watchdog.observe(res.num_accepted)
        return results

    def _commit(self, seq: Sequence, res: SeqResult) -> list[int]:
        """Append accepted tokens, keep committed KV (compacting tree paths), roll back the rest -> tokens kept."""
        old_cached = seq.num_cached
        room = self.max_model_len - seq.num_tokens
        kept = seq.append_tokens(res.tokens[: max(room, 1)], self.eos_id)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        if res.src_positions is not None:
            moves = self.blocks.compaction(seq, res.src_positions[: len(kept)], old_cached)  # a tree's accepted path
            if moves:
                self.target.move_kv(*(torch.tensor(x, dtype=torch.int64, device=self.device) for x in zip(*moves)))
        seq.num_cached = seq.num_tokens - 1
        self.blocks.register(seq)  # its blocks now committed, for the prefix cache
        if self.drafts.spec is not None and res.aux is not None:
            seq.append_aux(res.aux.head(seq.num_cached - old_cached))  # the newly committed positions' rows
        seq.step += 1
        self.blocks.truncate(seq, seq.num_tokens)
        return kept

    def _commit_chunk(self, seq: Sequence, res: SeqResult, n: int) -> None:
        """A partial prompt's ``n`` positions scored: committed, their aux rows queued; no token, no output (its blocks
        go to the prefix cache with its last chunk's commit)."""
        seq.num_cached += n
        if self.drafts.spec is not None:
            seq.append_aux(res.aux)

    def _emit(self, seq: Sequence, kept: list[int], texts: tuple[str, str]) -> RequestOutput:
        """Finish the request if it stopped (``texts``: its text and delta, a stop string found), build its output
        and call its callback."""
        text, delta_text = texts
        if seq.finish_reason is None and seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        hidden = None
        if seq.finish_reason is not None:
            if seq.captured is not None:  # before its blocks are released: the cached ones keep their rows
                rows = seq.take_captured()  # [T, A + H]
                self.blocks.keep_captured(seq, rows)
                hidden = CapturedHidden.of(rows, self.capture_width, self.aux_layer_ids)
            self.scheduler.finish(seq)
            self.detok.forget(seq)
            self.metrics.num_requests_finished += 1
            self._seqs.pop(seq.request_id, None)
            if self.drafts.spec is not None:
                self.policy.joins.finished(seq.joined_positions, len(seq.output_token_ids))
        out = make_output(seq, kept, text, delta_text)
        out.hidden = hidden
        cb = self._callbacks.pop(out.request_id, None) if out.finished else self._callbacks.get(out.request_id)
        if cb is not None:
            cb(out)
        return out

    def close(self) -> None:
        """Release the target's tensor-parallel workers (idempotent; no-op for one rank)."""
        self.target.close()

    # ----------------------------------------------------------------- offline API
    def generate(
        self, prompts: Iterable[Prompt], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise EaglerayError(
                f"{len(prompts)} prompts but {len(plist)} sampling params\n    fix: pass one SamplingParams or one per prompt"
            )
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    # ----------------------------------------------------------------- accessors for callers outside the engine
    def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids the engine runs for ``prompt`` (messages -> chat template, text -> tokenizer, ids as given)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            out = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
            return list(out["input_ids"])
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return [int(t) for t in prompt]

    @property
    def current_draft(self) -> Eagle3Draft | None:
        """The draft serving now; None when the engine decodes without speculation."""
        return self.drafts.current

    @property
    def previous_draft(self) -> Eagle3Draft | None:
        """The draft that served before the last swap (what a rollback returns to); None before any swap."""
        return self.drafts.previous

    @property
    def target_model(self) -> LlamaModel:
        """The target decoder the engine runs (to load a draft against it, or to build another engine on it)."""
        return self.target.model

    @property
    def aux_layer_ids(self) -> list[int]:
        """The target layers whose hidden states the target captures now (what a draft reads)."""
        return list(self.target.model.aux_layer_ids)

    def set_aux_layers(self, layer_ids: list[int]) -> None:
        """Capture ``layer_ids`` from the next forward on (a candidate draft's layers, before it is smoke-verified)."""
        self.target.model.set_aux_layers(layer_ids)

    @property
    def tensor_parallel(self) -> dict | None:
        """The target's tensor-parallel workers (``TPWorkers.describe``); None for one rank."""
        return None if self.target.workers is None else self.target.workers.describe()
