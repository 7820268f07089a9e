"""Whole conversations regenerated turn by turn on one engine, each answer on the target's own history.

EAGLE-3 and SpecForge regenerate multi-turn data this way: user turn i is answered given the
conversation so far *with the target's own earlier answers* (not the dataset's), so every assistant
turn of the result is the target's distribution and every one of them can be trained on.

Conversations run concurrently on one :class:`~eagleray.serve.engine.LLMEngine` (continuous
batching): when a turn finishes, the conversation's next turn waits in a ready list that joins the
engine in groups (``admit``), so prefill steps stay batched instead of one per finished turn; new
conversations start as others end.

A prompt (history + the new user turn) longer than ``prompt_cap`` tokens is truncated from the
left, never dropped: the oldest user/assistant pairs go first (system messages stay), then, if the
user turn alone is still too long, the start of its text. Each such turn is counted as truncated.
A turn the engine refuses is an error; the turns after it in that conversation cannot be asked and
are errors too (``earlier_turn_failed``), so ``turns in = answered + errors`` always holds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from eagleray.datagen.backends import batch_seed
from eagleray.platform.config.schemas import GenerationConfig
from eagleray.platform.errors import EaglerayError
from eagleray.platform.prompts import PromptRecord
from eagleray.serve.engine import LLMEngine, SamplingParams


class PromptTooLong(EaglerayError):
    """The system message and the template alone exceed the prompt cap: no left cut can make the turn fit."""


@dataclass
class TurnError:
    prompt_id: str  # the conversation's id
    turn: int  # 0-based index of the user turn
    kind: str  # engine_refused | earlier_turn_failed | prompt_too_long
    message: str


@dataclass
class Conversation:
    """A conversation being regenerated: its user turns and the target's answers so far."""

    record: PromptRecord
    system: list[dict]  # leading system message(s), kept whole
    users: list[str]  # user turn texts, in order
    history: list[dict] = field(default_factory=list)  # user/assistant messages so far (the target's answers)
    num_tokens: list[int] = field(default_factory=list)  # generated tokens per answered turn
    finish_reasons: list[str] = field(default_factory=list)
    truncated: int = 0  # turns whose prompt was cut from the left

    @classmethod
    def of(cls, record: PromptRecord) -> "Conversation":
        msgs = record.messages
        lead = 0
        while lead < len(msgs) and msgs[lead].role == "system":
            lead += 1
        users = [m.content for m in msgs[lead:] if m.role == "user"]
        return cls(record, [m.to_dict() for m in msgs[:lead]], users)

    @property
    def turn(self) -> int:
        return len(self.num_tokens)

    @property
    def done(self) -> bool:
        return self.turn >= len(self.users)

    def messages(self) -> list[dict]:
        return self.system + self.history

    def to_row(self) -> dict:
        """The output line: the conversation with the target's answers, per-turn token counts and truncations."""
        return {
            "prompt_id": self.record.prompt_id,
            "source": self.record.source,
            "messages": self.messages(),
            "num_tokens": self.num_tokens,
            "finish_reasons": self.finish_reasons,
            "truncated_turns": self.truncated,
        }


def fit_prompt(tokenize: Callable[[list[dict]], list[int]], tok, conv: Conversation, cap: int) -> tuple[list[int], bool]:
    """Token ids of ``conv``'s next prompt, cut from the left to at most ``cap`` tokens -> (ids, truncated)."""
    user = {"role": "user", "content": conv.users[conv.turn]}
    history = list(conv.history)
    ids = tokenize(conv.system + history + [user])
    if len(ids) <= cap:
        return ids, False
    while history and len(ids) > cap:
        history = history[2:]  # the oldest user/assistant pair (history alternates, starting with a user turn)
        ids = tokenize(conv.system + history + [user])
    if len(ids) <= cap:
        return ids, True
    content = tok(user["content"], add_special_tokens=False)["input_ids"]
    overhead = len(ids) - len(content)
    keep = cap - overhead
    while keep > 0:
        ids = tokenize(conv.system + [{"role": "user", "content": tok.decode(content[-keep:])}])
        if len(ids) <= cap:
            return ids, True
        keep -= max(1, len(ids) - cap)  # re-tokenising a cut text can merge differently: shrink by the excess
    raise PromptTooLong(
        f"turn {conv.turn} of {conv.record.prompt_id}: the system message and chat template alone take {overhead} tokens, "
        f"more than the prompt cap {cap}\n    fix: raise max_prompt_tokens (or max_seq_len)"
    )


@dataclass
class TurnStats:
    conversations: int = 0
    turns_in: int = 0
    answered: int = 0
    errors: int = 0
    truncated: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class TurnByTurn:
    """Regenerates conversations on ``engine``; ``on_done`` gets each finished :class:`Conversation`,
    ``on_error`` each :class:`TurnError` (both called on this thread, in completion order)."""

    def __init__(
        self,
        engine: LLMEngine,
        gen: GenerationConfig,
        prompt_cap: int,
        *,
        concurrency: int,
        on_done: Callable[[Conversation], None],
        on_error: Callable[[TurnError], None],
        progress: Callable[[TurnStats], None] | None = None,
    ):
        if prompt_cap + gen.max_tokens > engine.max_model_len:
            raise EaglerayError(
                f"prompt cap {prompt_cap} + generation.max_tokens {gen.max_tokens} > the engine's max_model_len "
                f"{engine.max_model_len}\n    fix: lower max_prompt_tokens (or max_seq_len) or generation.max_tokens"
            )
        self.engine, self.gen, self.cap = engine, gen, prompt_cap
        self.concurrency = concurrency
        self.admit = max(1, concurrency // 8)  # ready turns join the engine in groups of this many
        self.on_done, self.on_error, self.progress = on_done, on_error, progress
        self.stats = TurnStats()
        self._active: dict[str, Conversation] = {}
        self._ready: deque[Conversation] = deque()

    def run(self, records: Iterable[PromptRecord]) -> TurnStats:
        started = time.perf_counter()
        todo: Iterator[PromptRecord] = iter(records)
        exhausted = False
        while True:
            while not exhausted and len(self._active) + len(self._ready) < self.concurrency:
                rec = next(todo, None)
                if rec is None:
                    exhausted = True
                else:
                    self._start(Conversation.of(rec))
            if self._ready and (len(self._ready) >= self.admit or len(self._active) < self.admit or exhausted):
                self._submit_ready()
            if not self.engine.has_unfinished():
                if exhausted and not self._ready:
                    break
                continue
            for out in self.engine.step():
                if out.finished:
                    self._answered(self._active.pop(out.request_id), out)
            self.stats.seconds = time.perf_counter() - started
            if self.progress is not None:
                self.progress(self.stats)
        self.stats.seconds = time.perf_counter() - started
        return self.stats

    def _start(self, conv: Conversation) -> None:
        self.stats.conversations += 1
        self.stats.turns_in += len(conv.users)
        if conv.done:  # no user turn at all: nothing to answer
            self.on_done(conv)
        else:
            self._ready.append(conv)

    def _submit_ready(self) -> None:
        while self._ready:
            conv = self._ready.popleft()
            rid = f"{conv.record.prompt_id}:{conv.turn}"
            try:
                ids, cut = fit_prompt(self.engine.tokenize, self.engine.tokenizer, conv, self.cap)
                self.engine.add_request(ids, self._params(conv), request_id=rid)
            except PromptTooLong as err:
                self._fail(conv, "prompt_too_long", str(err))
                continue
            except EaglerayError as err:  # the engine's own refusals (KV cache too small for the request, ...)
                self._fail(conv, "engine_refused", str(err))
                continue
            conv.truncated += cut
            self.stats.truncated += cut
            self._active[rid] = conv

    def _params(self, conv: Conversation) -> SamplingParams:
        g = self.gen
        seed = batch_seed(g.seed, f"{conv.record.prompt_id}:{conv.turn}")
        return SamplingParams(temperature=g.temperature, top_p=g.top_p, max_tokens=g.max_tokens, seed=seed, detokenize=False)

    def _answered(self, conv: Conversation, out) -> None:
        text = self.engine.tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
        conv.history += [{"role": "user", "content": conv.users[conv.turn]}, {"role": "assistant", "content": text}]
        conv.num_tokens.append(len(out.token_ids))
        conv.finish_reasons.append(out.finish_reason or "")
        self.stats.answered += 1
        self.stats.generated_tokens += len(out.token_ids)
        if conv.done:
            self.on_done(conv)
        else:
            self._ready.append(conv)

    def _fail(self, conv: Conversation, kind: str, message: str) -> None:
        """This turn fails; the later turns cannot be asked; the answered part is still written."""
        failed = conv.turn
        self.on_error(TurnError(conv.record.prompt_id, failed, kind, message.splitlines()[0]))
        for t in range(failed + 1, len(conv.users)):
            self.on_error(TurnError(conv.record.prompt_id, t, "earlier_turn_failed", f"turn {failed} failed ({kind})"))
        self.stats.errors += len(conv.users) - failed
        if conv.history:
            self.on_done(conv)
