"""Per-request sampling parameters and the plain (non-speculative) token sampler.

Temperature 0 is greedy. top_k / top_p filter the target distribution *before* verification too,
so speculative sampling stays distributed exactly like plain sampling with the same parameters.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagleray.kernels import cpu_decode
from eagleray.platform.config.load import problems_from_validation
from eagleray.platform.errors import ConfigError


class SamplingParams(BaseModel):
    """How one request is sampled and when it stops."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0.0, le=100.0, description="Sampling temperature; 0 is greedy (argmax).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass: keep the smallest token set with this probability.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens; 0 keeps all.")
    max_tokens: int = Field(64, ge=1, description="Maximum generated tokens (the stop reason is 'length' when reached).")
    stop: list[str] = Field(default_factory=list, description="Stop strings; the text is cut before the first match.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end the request (kept in the token ids).")
    ignore_eos: bool = Field(False, description="Do not stop at the tokenizer's EOS token.")
    seed: int | None = Field(None, description="Seed of this request's random draws; None draws one from the engine's generator.")
    detokenize: bool = Field(
        True,
        description="Decode text every step; False leaves text empty (token ids only: batch regeneration, where decoding every stream each step costs more than the step).",
    )
    capture_states: bool = Field(
        False,
        description="Return the target's hidden states of this request (the aux rows the draft read and the final normed state) with its final output (RequestOutput.hidden); needs LLMEngine.enable_capture().",
    )

    @model_validator(mode="after")
    def _stop_needs_text(self) -> "SamplingParams":
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are matched in the text but detokenize is false; set detokenize: true or use stop_token_ids"
            )
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v):
        return [v] if isinstance(v, str) else v

    @classmethod
    def parse(cls, data: dict | None = None, *, prefix: str = "sampling_params", **kw) -> "SamplingParams":
        """Validate ``data``/``kw``; errors are a ConfigError naming the dotted field and the fix."""
        try:
            return cls.model_validate({**(data or {}), **kw})
        except ValidationError as err:
            raise ConfigError(problems_from_validation(err, prefix)) from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k / top-p drop. logits [N, V]; top_k [N] int (0 = off); top_p [N] float."""
    if bool((top_k <= 0).all()) and bool((top_p >= 1.0).all()):
        return logits
    vocab = logits.shape[-1]
    sorted_l, order = logits.sort(dim=-1, descending=True)  # [N, V]
    ranks = torch.arange(vocab, device=logits.device)  # [V]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [N]
    drop = ranks[None, :] >= k[:, None]  # [N, V]
    probs = sorted_l.softmax(-1)  # [N, V]
    before = probs.cumsum(-1) - probs  # [N, V] mass strictly before each token
    drop |= before >= top_p[:, None]
    sorted_l = sorted_l.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_l)


def scaled_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) in fp32; logits [N, V], temperature [N] (> 0 rows only matter)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # [N]
    return (logits.float() / t[:, None]).softmax(-1)  # [N, V]


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row from ``probs`` [M, V] by inverse CDF: one uniform from the row's own (CPU) generator, the
    first token whose cumulative mass (fp64) passes it -> [M] int64. Exactly the row's distribution (a token of zero
    mass is never drawn), the draw depends on the row alone (not on the rows beside it), and it costs a cumulative
    sum, where ``torch.multinomial`` draws an exponential per vocabulary entry (1.1 ms a 49k-entry row on a CPU core)
    and a loop over rows launches kernels per row on CUDA."""
    u = torch.tensor([float(torch.rand((), generator=g, dtype=torch.float64)) for g in generators], dtype=torch.float64)
    cdf = probs.double().cumsum(-1)  # [M, V]
    x = u.to(probs.device) * cdf[:, -1]  # [M]: the mass to pass
    return torch.searchsorted(cdf, x[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def sample_rows(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row: argmax where T == 0, else a draw from softmax(logits / T) (:func:`draw`). logits [N, V] -> [N];
    ``temperatures`` on the host, so choosing the sampled rows reads nothing back from the device."""
    out = cpu_decode.argmax_last(logits)  # [N]
    rows = [i for i, t in enumerate(temperatures) if t > 0]
    if rows:
        idx = torch.tensor(rows, device=logits.device)  # [M]
        temp = torch.tensor([temperatures[i] for i in rows], dtype=torch.float32, device=logits.device)  # [M]
        out[idx] = draw(scaled_probs(logits[idx], temp), [generators[i] for i in rows])
    return out
