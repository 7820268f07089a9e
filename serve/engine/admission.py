"""What :meth:`LLMEngine.add_request` refuses before a request is queued, each refusal naming the limit and the fix."""

from __future__ import annotations

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine.sampling import SamplingParams


def check_request(ids: list[int], params: SamplingParams, max_model_len: int, need: int, num_blocks: int, capture: bool) -> None:
    """``ids``: the prompt's tokens; ``need``: the KV blocks the request may grow to; ``capture``: whether the engine
    captures hidden states (``LLMEngine.enable_capture``)."""
    if not ids:
        raise EaglerayError("prompt is empty\n    fix: pass a non-empty prompt")
    if len(ids) >= max_model_len:
        raise EaglerayError(f"prompt has {len(ids)} tokens, max_model_len is {max_model_len}\n    fix: shorten the prompt")
    if need > num_blocks:
        raise EaglerayError(
            f"request needs up to {need} KV blocks (prompt {len(ids)} + max_tokens {params.max_tokens} tokens), "
            f"the cache has {num_blocks}\n    fix: raise engine.num_kv_blocks or lower max_tokens"
        )
    if params.capture_states and not capture:
        raise EaglerayError(
            "capture_states is set but this engine does not capture hidden states\n"
            "    fix: call LLMEngine.enable_capture() first (serving: set serving.capture)"
        )
