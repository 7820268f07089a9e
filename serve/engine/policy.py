"""Run-time policy: cost-based adaptive speculation (the acceptance watchdog: :mod:`~eagleray.serve.engine.watchdog`).

- :class:`AdaptivePolicy` picks each decode step's draft length k (0 = a plain step) from measured
  costs: for a batch of B sequences, the predicted speedup of a chain of k drafts is

      speedup(B, k) = E(k) * t_plain(B) / max(t_plain(B), t_verify(B, k) + t_draft(B, k) + t_join(B))
      E(k) = 1 + sum_{i<k} a_i          a_i = P(the first i+1 drafts are accepted), measured per position

  with t_plain (a whole plain step), t_verify(B, k) (the rest of a speculative step after drafting: target forward +
  verification of k+1 tokens and the step's host work, so that it compares with t_plain; about flat in k while the step
  is memory-bound on a GPU, less so on a CPU) and t_draft(B, k) (the whole drafting of k tokens: the catch-up forward
  plus k-1 chain forwards and their launches; a catch-up over plain steps' tokens is not counted), and t_join(B, k)
  (the draft's catch-up over the prompts of sequences that joined - the draft's prefill, a cost of speculating at all;
  on the H200 it made SmolLM2's speculative steps at 32-64 sequences 25-30% dearer than the policy predicted). A
  sequence's catch-up is paid once, its tokens over its life, so the join time is a cost per token emitted (sequences
  join as others finish, after a number of tokens): t_join(B, k) = (catch-up seconds per prompt position x prompt
  positions joined per token emitted, :mod:`~eagleray.serve.engine.join_cost`) * B * E(k). Averaged over speculative
  steps instead, the catch-up a rare probe pays for a thousand plain steps' joins counted as the cost of every
  speculative step (10.6 ms at 64 SmolLM2 sequences on the H200, where a plain step costs 3.2), and the policy never
  speculated again. A speculative step costs at least a plain step (it runs the target over the same tokens, and
  drafts): a measurement below is noise. t_verify and t_draft are measured per batch-size bucket and per k as the
  median of the last ``RECENT`` steps (one whole step that took 59 ms, where plain steps take 1.2, made a moving
  average predict 30x for an untrained draft on the H200, and it speculated at 0.69x). Drafting is not k times a
  per-token cost: a step's fixed part (staging, the catch-up's replay) divided by k made one k=1 forward cost 0.24 ms a
  token against 0.11 at k=4 on the H200, and the policy kept k=1 where k=4 paid 1.28x. An unmeasured k lies on the line
  between the measured k around it; below every measured k, on the line from k = 0 (a plain step's cost for t_verify,
  nothing for t_draft) to the smallest measured one; above, the largest's; t_verify between two measured k takes the
  cheaper (optimistic: the k is tried, then its measurement decides). It speculates with the best k when that beats
  plain by ``margin``, else decodes plain and probes k_max now and then (the interval doubles after every probe that
  does not pay, up to ``max_probe_interval``, and stretches by the bucket's cost ratio of a speculative to a plain
  step), so a draft that starts to pay is noticed and one that does not costs about one step in ``max_probe_interval``.
  While it speculates with k < k_max, every ``probe_interval``-th speculative step drafts k_max (a tail probe):
  positions past k are measured only by steps that draft them, so an early underestimate of the tail would otherwise
  hold k low for good. Once the measured acceptance bounds every speedup below 1 + ``margin``, a batch size not seen
  yet starts plain instead of being measured with speculative steps, and probes come only every ``max_probe_interval``
  steps. A tree drafts a fixed topology: k is 0 or the tree.

  Before any acceptance is known a bucket is measured with k=1 steps (position 0 bounds every later position, and
  k=1 verifies the fewest rows), and a hopeless draft is probed with k=1; E(k) bounds each a_i by the ones before it.
  Until ``EVIDENCE`` sequences are verified, a step of more than ``MEASURE_SEQS`` sequences speculates on only
  ``MEASURE_SEQS`` of them (:meth:`AdaptivePolicy.measuring_seqs`; the others wait one step): the draft's first
  catch-up is over every prompt of the sequences that speculate, and at 32 sequences on the CPU it cost a random
  draft's run 4-15% of its time to learn that nothing is accepted.

  Acceptance a_i starts from an optimistic prior (every draft accepted, worth ``PRIOR`` verified sequences)
  averaged with the counts of the first ``EVIDENCE`` verified sequences, then follows the measured rate as a
  moving average over about ``ACCEPT_WINDOW`` verified sequences (a step weighs as many sequences as it verified); it
  is judged hopeless only after ``EVIDENCE`` sequences. (At batch 1 a verification is one
  Bernoulli draw: a draft accepting 41% at the first position rejects the first two drafts 35% of the time,
  which used to turn speculation off for a thousand steps.)
"""

from __future__ import annotations

import logging

from eagleray.serve.engine.join_cost import JoinCost
from eagleray.serve.engine.policy_costs import Costs, add_wall, at_k, bucket

logger = logging.getLogger(__name__)

PRIOR = 2.0  # the optimistic prior (every draft accepted) counts as this many verified sequences
EVIDENCE = 16  # verified sequences before acceptance follows the measured rate and may be judged hopeless
MEASURE_SEQS = 8  # while acceptance is unknown, a larger step speculates on this many of its sequences
ACCEPT_WINDOW = 64  # after EVIDENCE, a_i is a moving average over about this many verified sequences
REDECIDE = 32  # plain choices between two scorings of every k while none pays (a speculative step rescores at once)
PLAIN_REFRESH = 32  # while speculating, one plain step in this many keeps a bucket's t_plain current


class AdaptivePolicy:
    """Chooses k per decode step from measured step costs and per-position acceptance (see module doc)."""

    def __init__(
        self,
        k_max: int,
        adaptive: bool = True,
        probe_interval: int = 32,
        margin: float = 0.03,
        can_lower_k: bool = True,
        max_probe_interval: int = 1024,
    ):
        self.k_max = k_max
        self.adaptive = adaptive
        self.margin = margin
        self.can_lower_k = can_lower_k
        self.min_probe_interval = probe_interval
        self.max_probe_interval = max(max_probe_interval, probe_interval)
        self.disabled = False  # forced off (watchdog action): no probes
        self.accept = [1.0] * k_max  # a_i, optimistic until measured
        self._seen = [0] * k_max  # sequences verified at position i while counting (up to EVIDENCE)
        self._hits = [0.0] * k_max  # of those, the ones whose first i+1 drafts were accepted
        self.costs: dict[int, Costs] = {}
        self.joins = JoinCost()  # t_join's rate (the engine tells it of prefills and finished sequences)
        self.k = k_max  # the choice for the last bucket decided
        self.speculating = True
        self._probe_interval = probe_interval
        self._since_probe = 0
        self._since_tail = 0  # speculative steps at k < k_max since the last one at k_max
        self.last_prediction: dict = {}

    # ------------------------------------------------------------------ decide
    def choose(self, batch: int = 1) -> int:
        """k for the next decode step of ``batch`` sequences; 0 means a plain step."""
        if self.disabled:
            return 0
        if not self.adaptive:
            return self.k_max
        c = self._bucket(batch)
        if c.decision_age < REDECIDE and self._since_probe + 1 < c.quiet_due:  # a kept plain decision, no probe due
            self._since_probe += 1  # (_plain_or_probe): counted off, not scored
            c.decision_age += 1
            c.chosen[0] += 1
            return 0
        k = self._choose(c, batch)
        c.chosen[k] = c.chosen.get(k, 0) + 1
        return k

    def _choose(self, c: Costs, batch: int) -> int:
        if c.spec_steps < 2 and not self._hopeless():
            return self._measure_k()  # measure this bucket's speculation costs (and acceptance) first
        if c.plain_steps < 2 or c.spec_steps < 2:
            return self._plain_or_probe(c, batch)
        k, speedup = self._decide(c, batch)
        self.last_prediction = {"batch": batch, "k": k, "predicted_speedup": round(speedup, 4)}
        if k > 0:
            c.since_plain += 1
            if c.since_plain > PLAIN_REFRESH:  # t_plain measured long ago (a cold start: 2.4 ms where it was 1.7 on the
                c.since_plain = 0  # H200 at 32 sequences) made speculation look 1.4x better than it was: measure it again
                return 0
            c.predicted[0] += 1
            c.predicted[1] += speedup
            self._since_probe = 0
            self._since_tail += 1
            if k < self.k_max and self.can_lower_k and self._since_tail >= self.min_probe_interval:
                self._since_tail = 0  # a tail probe: positions k.. are measured only by steps that draft them
                return self.k_max
            self._set(k)
            return k
        return self._plain_or_probe(c, batch, kept=True)

    def _measure_k(self) -> int:
        """The k a measuring step drafts: k_max, or 1 before any acceptance is known. Position 0's acceptance bounds
        every later one's, and a k=1 step verifies the fewest rows: a first k_max step at 32 sequences verified 160
        rows on the CPU (5x a plain step's) to learn that an untrained draft is never accepted."""
        return 1 if self.can_lower_k and self._seen[0] < EVIDENCE else self.k_max

    def measuring_seqs(self, batch: int) -> int:
        """How many of a speculative step's ``batch`` sequences speculate: all, or ``MEASURE_SEQS`` while no
        acceptance is known (the step only learns whether the draft is accepted at all; the draft's catch-up over
        the prompts of the rest is paid only once speculating is worth it)."""
        if self.adaptive and self._seen[0] < EVIDENCE and batch > MEASURE_SEQS:
            return MEASURE_SEQS
        return batch

    def _decide(self, c: Costs, batch: int) -> tuple[int, float]:
        """:meth:`best`, kept while it says plain until ``REDECIDE`` plain steps pass or a speculative step is
        observed (new costs, new acceptance): scoring every k took longer than the rest of a plain step's choosing."""
        if c.decision is None or c.decision[0] > 0 or c.decision_age >= REDECIDE:
            c.decision, c.decision_age, c.probe_ratio, c.quiet_due = self.best(batch), 0, None, 0.0
        c.decision_age += 1
        return c.decision

    def _bucket(self, batch: int) -> Costs:
        """The cost tables of ``batch``'s bucket (made the first time: a Costs built every step as a setdefault
        default cost more than the rest of choosing)."""
        b = bucket(batch)
        c = self.costs.get(b)
        if c is None:
            c = self.costs[b] = Costs()
        return c

    def _hopeless(self) -> bool:
        """Measured acceptance so low that no batch size can gain: verifying costs at least a plain step,
        so E(k_max) bounds the speedup. A new bucket then starts plain (and probes) instead of measuring."""
        return self._seen[0] >= EVIDENCE and self.expected_tokens(self.k_max) < 1 + self.margin

    def _plain_or_probe(self, c: Costs, batch: int, kept: bool = False) -> int:
        """A plain step, or a probe of k_max once the (cost-scaled, doubling) probe interval has passed. ``kept``: the
        bucket's plain decision is kept (:meth:`_decide`), so the choices up to its rescoring or the next probe are
        plain whatever plain steps observe: :meth:`choose` counts them off without scoring (``quiet_due``, the
        probe's due count, is forgotten with the decision when a speculative step is observed). Choosing took 6.4 µs a plain step on the
        dev CPU, a cost the plain engine does not pay (the H100's adaptive engine with an untrained draft: 0.97x)."""
        self._set(0)
        self._since_probe += 1
        hopeless = self._hopeless()
        interval = self.max_probe_interval if hopeless else self._probe_interval  # a draft never accepted: rarely
        due = interval * self._probe_ratio(c, batch)
        if self._since_probe >= due:
            self._since_probe = 0
            self._probe_interval = min(self._probe_interval * 2, self.max_probe_interval)
            return 1 if self.can_lower_k and hopeless else self.k_max  # a hopeless draft: is position 0 accepted now?
        if kept:
            c.quiet_due = due
        return 0

    def _probe_ratio(self, c: Costs, batch: int) -> float:
        """A probe costing r plain steps loses ~r - 1: probe r times less often. Scored with the bucket's decision (every
        REDECIDE plain choices, or new costs): every plain step it was ~5 of its choosing's 9 µs (dev CPU)."""
        if self._measured(c) and c.probe_ratio is None:
            c.probe_ratio = max(1.0, self._step_cost(c, self.k_max, batch) / c.plain)
        return c.probe_ratio if self._measured(c) else 1.0

    def best(self, batch: int) -> tuple[int, float]:
        """(k, predicted speedup) with the largest predicted speedup; (0, 1.0) unless one beats 1 + margin."""
        c = self.costs.get(bucket(batch))
        if c is None or not self._measured(c):
            return 0, 1.0
        ks = range(1, self.k_max + 1) if self.can_lower_k else [self.k_max]
        tokens = self._expected_all()  # E(k) of every k once (scoring every k took 27 µs on the dev CPU, 21 so)
        speedup, k = max((self.predicted_speedup(batch, k, tokens), k) for k in ks)
        return (k, speedup) if speedup > 1 + self.margin else (0, 1.0)

    def predicted_speedup(self, batch: int, k: int, tokens: list[float] | None = None) -> float:
        """E(k) x t_plain / the speculative step's cost, the costs on the wall clock (:mod:`step_wall`). E(k) is the
        acceptance pooled over every speculative step, not the tokens of k's own latest steps: at batch 1 a window
        of 16 unlucky steps froze a low mean (no step at k measured it again), and the champion decoded plain 14,104
        of 17,240 steps on the H200 (0.96x; k=4 steps measured 1.37x)."""
        c, tokens = self.costs[bucket(batch)], tokens or self._expected_all()  # [E(0) .. E(k_max)]
        return tokens[k] * c.plain / self._spec_cost(c, self._step_cost(c, k, batch, tokens))

    @staticmethod
    def _measured(c: Costs) -> bool:
        return c.plain is not None and bool(c.verify_by_k) and bool(c.draft_by_k)

    @staticmethod
    def _spec_cost(c: Costs, seconds: float) -> float:
        """At least a plain step's (module doc): under load a draft accepting nothing measured 1.25x, and was kept."""
        return max(seconds, c.plain)

    def _step_cost(self, c: Costs, k: int, batch: int, tokens: list[float] | None = None) -> float:
        """t_verify(k) + t_draft(k) + t_join(k): the seconds of a speculative step of ``batch`` sequences drafting k
        (``tokens``: :meth:`_expected_all`, if the caller has it)."""
        return self._verify_cost(c, k) + at_k(c.draft_by_k, k, 0.0) + self._join_cost(c, k, batch, tokens)

    def _join_cost(self, c: Costs, k: int, batch: int, tokens: list[float] | None = None) -> float:
        """t_join: the catch-up over joined prompts that a step emitting batch * E(k) tokens pays, on average."""
        return self.joins.per_token * batch * (tokens[k] if tokens else self.expected_tokens(k))

    @staticmethod
    def _verify_cost(c: Costs, k: int) -> float:
        """t_verify at k (see :func:`~eagleray.serve.engine.policy_costs.at_k`), from a plain step's cost at k = 0: verifying fewer rows is expected
        cheaper (with only k_max probed, taking its cost for every k kept the shorter chains untried); between two
        measured k the cheaper (on a CPU verifying 2 tokens can cost less than 1: another kernel path)."""
        return at_k(c.verify_by_k, k, c.plain, between="min")

    def expected_tokens(self, k: int) -> float:
        """E(k) = 1 + sum of a_i over the first k positions (tokens per verification step), each a_i bounded by the
        ones before it (the first i+1 drafts are accepted only if the first i are): a position not measured yet keeps
        its optimistic prior only up to what the positions before it measured."""
        return self._expected_all()[min(k, self.k_max)]  # a tree's k is its depth, k_max

    def _expected_all(self) -> list[float]:
        """[E(0), E(1), .., E(k_max)] (:meth:`expected_tokens`)."""
        out, bound = [1.0], 1.0
        for a in self.accept:
            bound = min(bound, a)
            out.append(out[-1] + bound)
        return out

    def _set(self, k: int) -> None:
        speculating = k > 0
        if speculating != self.speculating or (speculating and k != self.k):
            logger.info("adaptive speculation: %s", f"k={k}" if speculating else "plain decoding (speculation would not pay)")
        self.speculating = speculating
        if speculating:
            self.k = k

    # ------------------------------------------------------------------ observe
    def observe_plain(self, batch: int, seconds: float) -> None:
        self._bucket(batch).observe_plain(batch, seconds)
        self.joins.emitted(batch)

    def observe_spec_wall(
        self, batch: int, k: int, draft: float, lag: float, accepted: list[int], join: tuple[float, int], seconds: float
    ) -> None:
        """A speculative step of ``seconds`` from its start to the next step's start (:mod:`step_wall`): verifying
        is what is left after drafting and after the catch-up over plain steps' positions (``lag``, of which ``join``
        = (seconds, prompt positions) is the draft's prefill of joined sequences, counted per token)."""
        self.observe_spec(batch, k, max(seconds - draft - lag, 0.0), draft, accepted, *join)

    def observe_spec(
        self,
        batch: int,
        k: int,
        verify_seconds: float,
        draft_seconds: float,
        accepted: list[int],
        join_seconds: float = 0.0,
        join_positions: int = 0,
    ) -> None:
        """A speculative step: its verify and draft time, each sequence's accepted count (of k drafts), and the
        draft's catch-up over the prompts of sequences that joined since the last one (seconds, prompt positions)."""
        c = self._bucket(batch)
        for other in self.costs.values():  # new costs and acceptance: every kept plain decision is stale
            other.decision = other.probe_ratio = None
            other.quiet_due = 0.0
        self.joins.caught_up(join_seconds, join_positions)
        self.joins.emitted(len(accepted) + sum(accepted))
        c.verify_by_k[k] = c.update(("verify", k), verify_seconds)
        c.draft_by_k[k] = c.update(("draft", k), draft_seconds)
        c.spec_steps += 1
        if accepted:
            tokens = len(accepted) + sum(accepted)
            add_wall(c, k, len(accepted), tokens, verify_seconds + draft_seconds + self.joins.per_token * tokens)
        rates = [sum(n > i for n in accepted) / len(accepted) for i in range(min(k, self.k_max))] if accepted else []
        for i, rate in enumerate(rates):
            self._observe_accept(i, rate, len(accepted))
        seconds = verify_seconds + draft_seconds + self._join_cost(c, k, batch)
        step_pays = c.plain is not None and (1 + sum(rates)) * c.plain / self._spec_cost(c, seconds) > 1 + self.margin
        if step_pays or self.best(batch)[0] > 0:
            self._probe_interval = self.min_probe_interval  # it pays (again): keep measuring it
            if step_pays:
                self._since_probe = self.max_probe_interval * 1000  # probe again at the next plain choice

    def _observe_accept(self, i: int, rate: float, sequences: int) -> None:
        """a_i: prior + counts until EVIDENCE sequences (then the plain measured mean), a moving average after."""
        if self._seen[i] >= EVIDENCE:  # weighted by sequences: at batch 1 a step is one Bernoulli draw, not a rate
            w = min(1.0, sequences / ACCEPT_WINDOW)
            self.accept[i] = (1 - w) * self.accept[i] + w * rate
            return
        self._hits[i] += rate * sequences
        self._seen[i] += sequences
        if self._seen[i] >= EVIDENCE:
            self.accept[i] = self._hits[i] / self._seen[i]
        else:
            self.accept[i] = (self._hits[i] + PRIOR) / (self._seen[i] + PRIOR)

    # ------------------------------------------------------------------ overrides
    def disable(self, reason: str) -> None:
        self.disabled = True
        self.speculating = False
        logger.warning("speculation disabled: %s", reason)

    def enable(self) -> None:
        """A new draft: forget its predecessor's acceptance and costs."""
        self.disabled = False
        self.speculating = True
        self.k = self.k_max
        self.accept = [1.0] * self.k_max
        self._seen = [0] * self.k_max
        self._hits = [0.0] * self.k_max
        self.costs.clear()
        self.joins = JoinCost()
        self._probe_interval = self.min_probe_interval
        self._since_probe = 0
        self._since_tail = 0

    def snapshot(self) -> dict:
        """Per bucket: costs, the k chosen now and over the run, predicted and measured speedups (:mod:`policy_report`)."""
        from eagleray.serve.engine.policy_report import snapshot

        return snapshot(self)
