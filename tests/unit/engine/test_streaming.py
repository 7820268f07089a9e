"""Streaming: deltas arrive in order and concatenate to the final output (callback and async)."""

from __future__ import annotations

import asyncio

from eagleray.serve.engine import AsyncEngine, SamplingParams

from .conftest import PROMPTS, make_engine

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def test_callback_streaming_order(target, tokenizer, copy_draft):
    engine = make_engine(target, tokenizer, copy_draft, k=3)
    seen: dict[str, list] = {}
    ids = [engine.add_request(p, PARAMS, on_output=lambda o: seen.setdefault(o.request_id, []).append(o)) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    for rid in ids:
        outs = seen[rid]
        assert [t for o in outs for t in o.delta_token_ids] == outs[-1].token_ids
        assert "".join(o.delta_text for o in outs) == outs[-1].text
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    multi = [len(o.delta_token_ids) > 1 for outs in seen.values() for o in outs]
    assert any(multi), "speculation streams several tokens per step"


def test_async_engine_streams_concurrent_requests(target, tokenizer, copy_draft):
    engine = AsyncEngine(make_engine(target, tokenizer, copy_draft, k=2))
    reference = make_engine(target, tokenizer).generate(PROMPTS[:3], PARAMS)

    async def consume(prompt):
        return [o async for o in engine.add_request(prompt, PARAMS)]

    async def main():
        return await asyncio.gather(*(consume(p) for p in PROMPTS[:3]))

    streams = asyncio.run(main())
    for stream, ref in zip(streams, reference):
        assert [t for o in stream for t in o.delta_token_ids] == ref.token_ids
        assert stream[-1].finished and stream[-1].spec["num_drafts"] > 0


def test_a_slow_consumer_gets_the_steps_it_missed_in_one_item(target, tokenizer):
    """stream_batched: outputs queued while the consumer was busy come as one list, in order, nothing lost."""
    engine = AsyncEngine(make_engine(target, tokenizer))
    reference = make_engine(target, tokenizer).generate(PROMPTS[:2], PARAMS)

    async def consume(prompt, slow):
        items = []
        async for outs in engine.stream_batched(prompt, PARAMS):
            items.append(outs)
            if slow:
                await asyncio.sleep(0.05)  # several engine steps run meanwhile
        return items

    async def main():
        return await asyncio.gather(consume(PROMPTS[0], slow=True), consume(PROMPTS[1], slow=False))

    slow, fast = asyncio.run(main())
    for items, ref in ((slow, reference[0]), (fast, reference[1])):
        outs = [o for batch in items for o in batch]
        assert [t for o in outs for t in o.delta_token_ids] == ref.token_ids
        assert "".join(o.delta_text for o in outs) == ref.text
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert max(len(b) for b in slow) > 1 and len(slow) < len(reference[0].token_ids), "a slow consumer gets fewer items"
