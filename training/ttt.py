"""EAGLE-3 training-time test (TTT): the unrolled draft forward and its loss.

Data of one sequence (offline shards or the online target): tokens x_0..x_{T-1}, the target's aux
hidden states a_t [n_aux*H] (the inputs of the aux layers while reading x_t) and its final normed
hidden state f_t [H], whose logits ``lm_head(f_t)`` give p_t, the target's distribution of x_{t+1}.

Unroll, slot t (= "the last accepted token is x_t"), step i = 0..k-1 (k = ``ttt_steps``, default 7)::

    step 0: hidden = fc(a_t), input token x_{t+1}, position t
    step i: hidden = the draft's own next_hidden of step i-1 at slot t (fed back, not detached),
            input token x_{t+1+i} (the teacher-forced token: what greedy verification accepts),
            position t+i
    output: q_i(t) = softmax(lm_head(norm(layer(...)))) over the draft vocab, trained towards p_{t+1+i}

Attention at step i mirrors inference exactly: slot t attends to the step-0 keys of slots <= t
(the draft's KV cache of the accepted prefix) and to its own keys of steps 1..i (the tokens it
drafted since), i.e. causal over step 0 plus a diagonal per later step (as SpecForge does).

Loss (what this module computes, vs. the paper). The EAGLE-3 paper (arXiv 2503.01840) drops
EAGLE-1/2's feature-regression loss and trains only next-token prediction, with "training-time
test" feeding the draft its own outputs; it does not spell out weights. Like the EAGLE-3 and
SpecForge code we use soft labels and a decayed sum::

    P_i(t) = softmax over the draft vocab of target logits restricted to the draft vocab, at t+1+i
    m_i(t) = loss_mask[t+1+i] * [argmax of the FULL target logits at t+1+i is in the draft vocab]
    ploss_i = sum_t m_i(t) * ( -sum_v P_i(t)[v] * log q_i(t)[v] ) / max(1, sum_t m_i(t))
    loss = sum_i loss_decay**i * ploss_i                   (loss_decay 0.8)

Tokens whose target argmax lies outside the draft vocab are dropped from the loss, as SpecForge
does (``position_mask = t2d[target argmax] * loss_mask``): the draft can never propose them, and
renormalising over the draft vocab would teach it a wrong argmax. They still count in accuracy:
``acc_i = #(draft argmax mapped by d2t == target argmax, loss_mask=1) / #(loss_mask=1)`` at t+1+i,
so an out-of-vocab target token is a miss, exactly as in serving. SpecForge averages ploss over all
positions (``.mean()``); we divide by the trained positions so ploss is a per-token cross-entropy
independent of padding and batch composition.

Simulated τ: for every slot t with loss_mask[t+1]=1, the accepted length is ``1 + #leading steps i
with correct_i(t)``; ``sim_tau`` is its mean over EVERY slot. A chain does not start at every slot: it
starts after the previous step's accepted tokens, more often in hard stretches (right after a
rejection), so sim_tau overestimates what serving accepts even on the same text (2.07 vs 1.87 on 40
MT-bench answers). ``chain_tau`` (held-out evaluation only) walks each answer span as greedy chain
speculation of ``ttt_steps`` drafts does: from the slot before the span's first token, advance by the
accepted length, average the accepted lengths of the steps taken; this walk over the training code's hits on
those 40 answers gave the engine's τ count for count (1.869, 2,417 steps; the answers ran 8 tokens past the
engine's 128, whose last step drafts past the end). ``sim_tau_product = 1 + sum_i prod_{j<=i} acc_j``
(SpecForge's estimate, which treats steps as independent) is logged too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagleray.platform.models.eagle3 import Eagle3Draft


@dataclass
class TTTBatch:
    """One padded batch (padding at the end of each row; loss_mask is 0 there)."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] float 0/1
    aux: torch.Tensor  # [B, T, n_aux*H] target aux hidden states
    final_hidden: torch.Tensor  # [B, T, H] target final hidden state (after its norm)

    def to(self, device) -> "TTTBatch":
        return TTTBatch(*(x.to(device, non_blocking=True) for x in (self.input_ids, self.loss_mask, self.aux, self.final_hidden)))


@dataclass
class TTTOutput:
    loss: torch.Tensor  # [] weighted sum of plosses (has grad)
    stats: torch.Tensor  # [k, 4] detached sums: ploss numerator, ploss denominator, correct, acc denominator
    tau: torch.Tensor  # [2] detached: sum of accepted lengths, number of slots
    walk: torch.Tensor | None = None  # [2] in eval mode: the chain walk's sum of accepted lengths, steps (see chain_walk)


class TTTModel(nn.Module):
    """A trainable :class:`Eagle3Draft` plus the frozen target pieces TTT needs (embedding, lm_head)."""

    def __init__(
        self,
        draft: Eagle3Draft,
        embed: torch.Tensor,
        target_head: torch.Tensor,
        t2d: torch.Tensor,
        ttt_steps: int = 7,
        loss_decay: float = 0.8,
    ):
        super().__init__()
        self.draft = draft
        self.ttt_steps, self.loss_decay = ttt_steps, loss_decay
        # Frozen target tensors: buffers (moved by .to, never trained, not in the draft's state).
        self.register_buffer("embed", embed.detach().clone(), persistent=False)  # [V, H]
        self.register_buffer("target_head", target_head.detach().clone(), persistent=False)  # [V, H]
        self.register_buffer("t2d", t2d.to(torch.bool), persistent=False)  # [V]
        self.register_buffer("draft_ids", torch.nonzero(t2d).flatten(), persistent=False)  # [Vd] target id of each draft id

    def targets(
        self, final_hidden: torch.Tensor, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Target distribution over the draft vocab [B, T, Vd], full-vocab argmax [B, T], in-draft-vocab [B, T].

        With ``keep`` [B, T] bool only those positions are computed (the loss-masked ones: every other
        position is multiplied by loss_mask = 0 downstream); the rest hold zeros / argmax 0.
        """
        with torch.no_grad():
            b, t, _ = final_hidden.shape
            keep = torch.ones(b, t, dtype=torch.bool, device=final_hidden.device) if keep is None else keep
            logits = final_hidden[keep].float() @ self.target_head.float().T  # [N, V]
            argmax = torch.zeros(b, t, dtype=torch.long, device=final_hidden.device)  # [B, T]
            argmax[keep] = logits.argmax(-1)
            probs = final_hidden.new_zeros(b, t, self.draft_ids.numel(), dtype=torch.float32)  # [B, T, Vd]
            # .float(): under CPU autocast the matmul above yields bf16 logits and softmax keeps bf16.
            probs[keep] = torch.softmax(logits[:, self.draft_ids].float(), dim=-1)
            return probs, argmax, self.t2d[argmax]

    def forward(self, batch: TTTBatch) -> TTTOutput:
        ids, mask = batch.input_ids, batch.loss_mask.float()  # [B, T]
        b, t = ids.shape
        k = min(self.ttt_steps, t - 1)
        keep = mask > 0  # [B, T] loss-masked positions: the only ones whose logits enter loss or accuracy
        probs, argmax, in_vocab = self.targets(batch.final_hidden, keep)
        hidden = self.draft.combine_hidden_states(batch.aux)  # [B, T, H]
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        losses, stats, correct = [], [], []
        for i in range(k):
            n = t - 1 - i  # slots whose target position t+1+i exists
            step_ids = F.pad(ids[:, 1 + i :], (0, 1 + i))  # [B, T] x_{t+1+i}
            positions = torch.arange(t, device=ids.device) + i  # [T]
            normed, hidden = self.step(step_ids, positions, hidden, cache)  # [B, T, H] each
            sl = slice(1 + i, None)  # target positions t+1+i of slots 0..n-1
            sel = keep[:, sl]  # [B, n]; the draft lm_head runs on these slots only
            logits = self.draft.compute_logits(normed[:, :n][sel])  # [N, Vd]
            ploss, row, hit_sel = step_terms(
                logits, probs[:, sl][sel], mask[:, sl][sel], in_vocab[:, sl][sel], argmax[:, sl][sel], self.draft_ids
            )
            hit = mask.new_zeros(b, n)  # [B, n]
            hit[sel] = hit_sel
            losses.append(self.loss_decay**i * ploss)
            correct.append(F.pad(hit, (0, t - 1 - n)))  # [B, T-1]
            stats.append(row)
        stats_t = F.pad(torch.stack(stats), (0, 0, 0, self.ttt_steps - k))  # [ttt_steps, 4], zero rows if T <= k
        walk = None if self.training else chain_walk(correct, mask)  # a host sync: held-out evaluation only
        return TTTOutput(loss=torch.stack(losses).sum(), stats=stats_t, tau=_sim_tau(correct, mask), walk=walk)

    def step(
        self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over every slot: ids [B, T], positions [T], hidden [B, T, H] -> normed, next_hidden [B, T, H]."""
        d, layer = self.draft, self.draft.midlayer
        embeds = F.embedding(ids, self.embed).to(hidden.dtype)  # [B, T, H]
        normed_hidden = layer.hidden_norm(hidden)  # [B, T, H]
        residual = normed_hidden if layer.norm_before_residual else hidden  # [B, T, H]
        x = torch.cat([layer.input_layernorm(embeds), normed_hidden], dim=-1)  # [B, T, 2H]
        h = ttt_attention(layer.self_attn, x, positions, cache) + residual  # [B, T, H]
        pre = layer.mlp(layer.post_attention_layernorm(h)) + h  # [B, T, H]
        normed = d.norm(pre)  # [B, T, H]
        return normed, (normed if d.norm_output else pre)


def step_terms(
    logits: torch.Tensor,
    probs: torch.Tensor,
    loss_mask: torch.Tensor,
    in_vocab: torch.Tensor,
    target_argmax: torch.Tensor,
    draft_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TTT step's loss terms (module doc): logits [..., Vd], probs [..., Vd], masks/argmax [...]
    (any leading shape: [B, n], or [N] for the gathered loss-masked slots).

    Returns ploss [] (with grad), stats row [4] (ploss numerator, trained positions, hits, loss-masked
    positions; detached) and hits [...] (draft argmax mapped to target ids == target argmax, masked).
    """
    m = loss_mask * in_vocab.float()  # [B, n] trained positions
    ce = -(probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B, n]
    num, den = (ce * m).sum(), m.sum()
    hit = (draft_ids[logits.argmax(-1)] == target_argmax).float() * loss_mask  # [B, n]
    row = torch.stack([num.detach(), den, hit.sum(), loss_mask.sum()])
    return num / den.clamp_min(1.0), row, hit.detach()


def ttt_attention(
    attn: nn.Module, x: torch.Tensor, positions: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """x [B, T, 2H] -> [B, T, H]; appends this step's (k, v) [B, Hkv, T, D] to ``cache``.

    Keys: step 0 causal over slots, steps 1..i only the query's own slot (diagonal).
    """
    b, t, _ = x.shape
    hq, hkv, dim = attn.heads, attn.kv_heads, attn.head_dim
    q = attn.q_proj(x).view(b * t, hq, dim)  # [B*T, Hq, D]
    k = attn.k_proj(x).view(b * t, hkv, dim)  # [B*T, Hkv, D]
    v = attn.v_proj(x).view(b, t, hkv, dim).transpose(1, 2)  # [B, Hkv, T, D]
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = attn.rotary(positions.repeat(b), q, k)
    q = q.view(b, t, hq, dim).transpose(1, 2)  # [B, Hq, T, D]
    k = k.view(b, t, hkv, dim).transpose(1, 2)  # [B, Hkv, T, D]
    cache.append((k, v))
    rep = hq // hkv
    keys = [c[0].repeat_interleave(rep, dim=1) for c in cache]  # each [B, Hq, T, D]
    vals = [c[1].repeat_interleave(rep, dim=1) for c in cache]  # each [B, Hq, T, D]
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # [T, T]
    s0 = (q @ keys[0].transpose(-1, -2)) * attn.scale  # [B, Hq, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [(q * kj).sum(-1, keepdim=True) * attn.scale for kj in keys[1:]]  # each [B, Hq, T, 1]
    p = torch.cat([s0, *diag], dim=-1).float().softmax(-1).to(q.dtype)  # [B, Hq, T, T+i]
    out = p[..., :t] @ vals[0]  # [B, Hq, T, D]
    for j, vj in enumerate(vals[1:]):
        out = out + p[..., t + j : t + j + 1] * vj  # [B, Hq, T, D]
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, hq * dim))  # [B, T, H]


def _sim_tau(correct: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """[sum of accepted lengths, number of slots] over slots t with loss_mask[t+1]=1 (see module doc)."""
    c = torch.stack(correct)  # [k, B, T-1]
    run = torch.cumprod(c, dim=0).sum(0)  # [B, T-1] leading correct steps
    slots = mask[:, 1:]  # [B, T-1]
    return torch.stack([((1.0 + run) * slots).sum(), slots.sum()]).detach()


def chain_walk(correct: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """[sum of accepted lengths, steps] of greedy chain speculation walked over each answer span (see module doc):
    a step at slot t accepts ``1 + leading correct drafts`` and the next starts that many slots later, until the
    span (a run of loss_mask = 1) ends."""
    run = torch.cumprod(torch.stack(correct), dim=0).sum(0).round().long().tolist()  # [B][T-1] leading correct drafts
    masks = (mask > 0).tolist()  # [B][T]
    total = steps = 0
    for r, m in zip(run, masks):
        t = 0
        while t < len(r):
            if not m[t + 1] or (t > 0 and m[t]):  # not the slot before an answer span's first token
                t += 1
                continue
            while t < len(r) and m[t + 1]:  # one step: accepted r[t] drafts and the target's own token
                total, steps = total + 1 + r[t], steps + 1
                t += 1 + r[t]
    return torch.tensor([float(total), float(steps)], device=mask.device)


def summarize(stats: torch.Tensor, tau: torch.Tensor, decay: float, walk: torch.Tensor | None = None) -> dict[str, float]:
    """Accumulated sums -> loss, ploss_i, acc_i, sim_tau, sim_tau_product (floats)."""
    out: dict[str, float] = {}
    loss, surv, tau_prod = 0.0, 1.0, 1.0
    for i, (num, den, hit, lm) in enumerate(stats.tolist()):
        out[f"ploss_{i}"] = num / max(den, 1.0)
        out[f"acc_{i}"] = hit / max(lm, 1.0)
        loss += decay**i * out[f"ploss_{i}"]
        surv *= out[f"acc_{i}"]
        tau_prod += surv
    out["loss"] = loss
    out["sim_tau"] = float(tau[0] / tau[1].clamp_min(1.0))
    out["sim_tau_product"] = tau_prod
    if walk is not None:
        out["chain_tau"] = float(walk[0] / walk[1].clamp_min(1.0))
    return out
