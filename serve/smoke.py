"""Smoke verification of a candidate draft: greedy speculative output must equal greedy plain output.

Runs two throw-away engines that share the serving engine's target weights (not its KV cache):
one plain, one with the candidate draft and speculation forced on (no adaptive policy, so every
decode step really speculates). A draft that makes greedy output differ breaks losslessness
(wrong vocab map, wrong aux wiring) and is refused before it serves anyone.
"""

from __future__ import annotations

from eagleray.platform.config.schemas import DraftConfig, PolicyConfig
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams

SMOKE_PROMPTS = ("Explain speculative decoding in one sentence.", "def fibonacci(n):")
SMOKE_TOKENS = 8


def _small_config(engine: LLMEngine, draft: DraftConfig | None, prompt_len: int) -> EngineConfig:
    bs = engine.config.block_size
    k = draft.num_speculative_tokens if draft else 0
    per_seq = (prompt_len + SMOKE_TOKENS + k + 2 + bs - 1) // bs + 2
    return EngineConfig(
        target=engine.config.target,
        draft=draft,
        max_num_seqs=len(SMOKE_PROMPTS),
        block_size=bs,
        num_kv_blocks=per_seq * len(SMOKE_PROMPTS) + 2,
        verify_backend=engine.config.verify_backend,
    )


def smoke_prompts(engine: LLMEngine) -> list[list[int]]:
    tok = engine.tokenizer
    return [list(tok(p, add_special_tokens=True)["input_ids"])[: engine.max_model_len // 2] for p in SMOKE_PROMPTS]


def smoke_verify(engine: LLMEngine, candidate: Eagle3Draft) -> dict:
    """Raise :class:`EaglerayError` when the candidate changes greedy output; return the facts otherwise."""
    prompts = smoke_prompts(engine)
    longest = max(len(p) for p in prompts)
    params = SamplingParams(temperature=0.0, max_tokens=SMOKE_TOKENS, ignore_eos=True)
    served = engine.config.draft
    k = served.num_speculative_tokens if served else 4
    dcfg = DraftConfig(
        source="smoke-candidate",
        num_speculative_tokens=k,
        tree=served.tree if served else None,
        policy=PolicyConfig(adaptive=False, watchdog_window=1 << 20, on_low_acceptance="warn"),
    )
    model = engine.target_model
    plain = LLMEngine(model, engine.tokenizer, _small_config(engine, None, longest)).generate(prompts, params)
    spec_engine = LLMEngine(model, engine.tokenizer, _small_config(engine, dcfg, longest), draft=candidate)
    spec = spec_engine.generate(prompts, params)
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a.token_ids != b.token_ids:
            raise EaglerayError(
                f"smoke verification failed: greedy output with the candidate draft differs from plain "
                f"decoding on smoke prompt {i} (plain {a.token_ids}, speculative {b.token_ids})\n"
                f"    fix: the draft breaks losslessness (vocab map d2t/t2d or aux wiring); do not serve it"
            )
    stats = spec_engine.metrics.snapshot()
    if stats["spec_decode_num_drafts"] == 0:
        raise EaglerayError("smoke verification failed: no speculative step ran with the candidate draft (engine bug)")
    return {
        "tokens": [o.token_ids for o in spec],
        "num_drafts": stats["spec_decode_num_drafts"],
        "tau": stats["spec_decode_mean_acceptance_length"],
    }
