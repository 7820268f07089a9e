"""The per-worker training loop (Ray Train worker or local process): TTT steps, logging, checkpoints, eval.

Optimiser: AdamW(betas 0.9, 0.95), linear warmup then cosine to ``min_lr_ratio``, grad-norm clip
(0.5), bf16 autocast on CUDA (``autocast: auto``). A checkpoint directory holds ``draft/`` (the
vLLM-loadable draft with its metadata) and ``state.pt`` (step, optimiser, scheduler); resuming
restores both and skips the batches already consumed. Metrics go to MLflow from rank 0 only.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.nn.parallel import DistributedDataParallel

from eagleray.platform.config.schemas import TrainingConfig
from eagleray.training.build import draft_module, export
from eagleray.training.plan import Plan, batch_streams, make_plan
from eagleray.training.session import Session
from eagleray.training.ttt import TTTBatch, TTTModel, TTTOutput, summarize

STATE, DRAFT = "state.pt", "draft"


def lr_lambda(cfg: TrainingConfig, horizon: Callable[[], int] | None = None):
    """Multiplier of the peak lr at optimizer step s (0-based): linear warmup, then cosine to the horizon
    (``max_steps``, or the :class:`Horizon`'s current estimate)."""
    total = horizon or (lambda: cfg.max_steps)

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, total() - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class Horizon:
    """The step at which the schedule ends and training stops: ``max_steps``; with ``max_minutes``, re-fitted at
    every log point from the last interval's seconds per step, so the cosine ends when the wall-clock budget does
    (rank 0's estimate, shared by all ranks: every rank stops at the same step). Never below the current step,
    never above ``max_steps``."""

    def __init__(self, cfg: TrainingConfig):
        self.steps, self.cap = cfg.max_steps, cfg.max_steps
        self.deadline = None if cfg.max_minutes is None else time.perf_counter() + 60.0 * cfg.max_minutes
        self.mark: tuple[int, float] | None = None  # (step, time) of the last refit

    def __call__(self) -> int:
        return self.steps

    def refit(self, step: int, session: Session) -> None:
        """At a log point (collective: every rank calls it)."""
        if self.deadline is None or step >= self.steps:
            return  # no budget, or the horizon is reached: stop there (re-fitting would lift the decayed lr again)
        now = time.perf_counter()
        estimate = self.cap
        if self.mark is not None and step > self.mark[0]:
            per_step = (now - self.mark[1]) / (step - self.mark[0])
            estimate = step + int(max(0.0, self.deadline - now) / per_step)
        self.mark = (step, now)
        shared = torch.tensor([float(estimate if session.rank == 0 else 0)], device=session.device)
        self.steps = max(step, min(self.cap, int(session.all_reduce_sum(shared).item())))


def use_bf16(cfg: TrainingConfig, device: torch.device) -> bool:
    return cfg.autocast == "bf16" or (cfg.autocast == "auto" and device.type == "cuda")


def make_optimizer(model: TTTModel, cfg: TrainingConfig, horizon: Callable[[], int] | None = None):
    """AdamW(betas 0.9, 0.95) over the trainable parameters and the warmup+cosine LambdaLR schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, horizon))


def train_step(net, batch: TTTBatch, opt, sched, amp: bool, grad_clip: float) -> tuple[TTTOutput, float, float]:
    """One optimiser step (the trainer's, also timed by ``jobs/bench/train_step``): forward under bf16 autocast
    when ``amp``, backward, grad-norm clip, AdamW step, schedule step.

    ``net``: the TTTModel or its DDP wrapper; ``batch`` already on the device. Returns the output,
    the grad norm before clipping (a float: one host sync) and the lr the step used.
    """
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=amp):
        out = net(batch)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    params = [p for group in opt.param_groups for p in group["params"]]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    lr = sched.get_last_lr()[0]
    opt.step()
    sched.step()
    return out, grad_norm, lr


def save_checkpoint(out: Path, model: TTTModel, plan: Plan, opt, sched, step: int, notes: dict[str, Any]) -> Path:
    export(model.draft, plan.init, out / DRAFT, plan.metadata({"step": step, **notes}))
    torch.save({"step": step, "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, out / STATE)
    return out


def is_complete(ckpt: Path) -> bool:
    """Every file of a checkpoint directory is present (it may have been cut off mid-upload)."""
    return all((ckpt / f).is_file() for f in (STATE, f"{DRAFT}/config.json", f"{DRAFT}/model.safetensors"))


def restore(ckpt: Path | None, model: TTTModel, opt, sched) -> int:
    """Load a checkpoint directory into model/optimiser/scheduler; returns its step (0 without one)."""
    if ckpt is None:
        return 0
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / DRAFT / "model.safetensors"))
    model.draft.load_state_dict({k: v for k, v in weights.items() if k not in ("d2t", "t2d")})
    state = torch.load(ckpt / STATE, map_location="cpu", weights_only=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return int(state["step"])


@torch.no_grad()
def evaluate(model: TTTModel, batches: Iterable[TTTBatch], device: torch.device, amp: bool) -> dict[str, float]:
    """Held-out ploss_i, acc_i, sim_tau and chain_tau (see training.ttt) prefixed ``eval/``."""
    model.eval()
    stats = torch.zeros(model.ttt_steps, 4, device=device)
    tau = torch.zeros(2, device=device)
    walk = torch.zeros(2, device=device)
    n = 0
    for batch in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = model(batch.to(device))
        stats += out.stats
        tau += out.tau
        walk += out.walk
        n += 1
    model.train()
    if n == 0:
        return {}
    return {f"eval/{k}": v for k, v in summarize(stats.cpu(), tau.cpu(), model.loss_decay, walk.cpu()).items()}


class Meter:
    """Sums of TTT stats between two log points, reduced over ranks."""

    def __init__(self, k: int, device: torch.device):
        self.k, self.device = k, device
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(self.k * 4 + 3, device=self.device)  # stats [k*4], tau [2], tokens
        self.started = time.perf_counter()

    def add(self, out, tokens: int) -> None:
        self.sums += torch.cat([out.stats.flatten(), out.tau, torch.tensor([float(tokens)], device=self.device)])

    def reduce(self, session: Session, decay: float) -> dict[str, float]:
        s = session.all_reduce_sum(self.sums.clone()).cpu()
        k = self.k
        metrics = summarize(s[: k * 4].view(k, 4), s[k * 4 : k * 4 + 2], decay)
        metrics["tokens_per_s"] = float(s[-1]) / max(1e-9, time.perf_counter() - self.started)
        self.reset()
        return metrics


def train_worker(cfg: TrainingConfig, session: Session, run_id: str | None = None) -> dict[str, float]:
    """Train until the :class:`Horizon` (``max_steps``, or the ``max_minutes`` budget); returns the last reported
    metrics (rank 0 has the eval ones)."""
    torch.manual_seed(cfg.seed)
    plan = make_plan(cfg)
    dev = session.device
    model = TTTModel(draft_module(plan.init), plan.embed, plan.head, plan.init.t2d, cfg.ttt_steps, cfg.loss_decay).to(dev)
    horizon = Horizon(cfg)
    opt, sched = make_optimizer(model, cfg, horizon)
    step = restore(session.latest_checkpoint(), model, opt, sched)
    resumed_from = step
    net = model
    if session.world > 1:
        net = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None, broadcast_buffers=False)
    train, eval_factory = batch_streams(plan, session.rank, session.world, dev, skip=step)
    logger = _step_logger(cfg, run_id, horizon) if session.rank == 0 else None
    if logger is not None and resumed_from > 0:
        logger.restarted(resumed_from)
    meter, amp, metrics = Meter(cfg.ttt_steps, dev), use_bf16(cfg, dev), {}
    while step < horizon.steps:
        batch = next(train).to(dev)
        out, grad_norm, lr = train_step(net, batch, opt, sched, amp, cfg.grad_clip)
        step += 1
        meter.add(out, int(batch.loss_mask.sum()))
        if step % cfg.log_every == 0 or step >= horizon.steps:
            horizon.refit(step, session)
            metrics = {**meter.reduce(session, cfg.loss_decay), "lr": lr, "grad_norm": grad_norm, "horizon": horizon.steps}
            if logger is not None:
                logger(metrics, step)
        final = step >= horizon.steps
        if final:
            train.close()  # stops the stream's background tokenizing before the final eval tokenizes
        if step % cfg.checkpoint_every == 0 or final:
            metrics = _checkpoint(
                cfg, session, plan, model, opt, sched, step, final, metrics, eval_factory, amp, logger, resumed_from
            )
        _maybe_die(cfg, session, step)
        if cfg.testing.step_delay_s:
            time.sleep(cfg.testing.step_delay_s)
    return metrics


def _checkpoint(cfg, session, plan, model, opt, sched, step, final, metrics, eval_factory, amp, logger, resumed_from):
    """Rank 0 saves (and at the end evaluates); every rank reports (Ray's report is collective)."""
    metrics = {**metrics, "step": step, "resumed_from_step": resumed_from}
    with tempfile.TemporaryDirectory(prefix="eagleray-ckpt-") as tmp:
        ckpt = None
        if session.rank == 0:
            if final:
                metrics.update(evaluate(model, eval_factory(), session.device, amp))
                if logger is not None:
                    logger({k: v for k, v in metrics.items() if k.startswith("eval/")}, step)
            notes = {k: v for k, v in metrics.items() if k.startswith("eval/")}
            ckpt = save_checkpoint(Path(tmp), model, plan, opt, sched, step, notes)
        session.report(metrics, ckpt)
    return metrics


def _step_logger(cfg: TrainingConfig, run_id: str | None, horizon: Callable[[], int]):
    if run_id is None:
        return ConsoleProgress(horizon)
    from eagleray.training.tracking import StepLogger

    return StepLogger(cfg.mlflow.tracking_uri, run_id)


class ConsoleProgress:
    """Rank 0's progress line when no MLflow run tracks the training (a local run, a lent GPU machine):
    step, loss, first-step accuracy, simulated τ, tokens/s and the ETA."""

    def __init__(self, horizon: Callable[[], int]):
        self.horizon, self.started = horizon, time.perf_counter()

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        if "loss" not in metrics:  # the final eval/* metrics
            print(f"train: eval at step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()), flush=True)
            return
        elapsed = time.perf_counter() - self.started
        total = self.horizon()
        eta = elapsed / max(step, 1) * (total - step)
        print(
            f"train: step {step}/{total} loss {metrics['loss']:.3f} acc_0 {metrics.get('acc_0', 0.0):.3f} "
            f"sim_tau {metrics.get('sim_tau', 0.0):.3f} {metrics.get('tokens_per_s', 0.0):.0f} tok/s, ETA {eta / 60:.1f} min",
            flush=True,
        )

    def restarted(self, step: int) -> None:
        print(f"train: resumed from step {step}", flush=True)


def _maybe_die(cfg: TrainingConfig, session: Session, step: int) -> None:
    """Testing hook: rank 0 SIGKILLs itself once at ``testing.kill_worker_at_step``."""
    at = cfg.testing.kill_worker_at_step
    if at is None or step != at or session.rank != 0:
        return
    cfg.testing.kill_once(cfg.output_dir, f"after step {step}")
