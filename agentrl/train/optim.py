"""AdamW, the warmup + cosine schedule, gradient clipping and the non-finite step guard.

One optimizer step per batch. A step whose loss or gradient norm is not finite is skipped whole (no update, no
schedule advance, gradients cleared) and counted: one bad batch (an engine logprob of -inf, an overflow) should
not write NaN into weights that the engine is generating from at that very moment. Too many in a row means the
run itself is broken, and it stops.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from agentrl.train.config import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; matrices decay, vectors (norms, biases) do not.

    The fused kernel is used when every parameter lives on CUDA: one launch for the whole update instead of a
    handful per tensor. Elsewhere (the CPU tests) the default implementation runs.
    """
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)


class WarmupCosine:
    """LR multiplier: linear warmup from 1/warmup to 1, then cosine down to `min_ratio` at `total_steps`.

    A class rather than a closure so that LambdaLR's state_dict records its fields with the checkpoint.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.0):
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(cfg.warmup_steps, total_steps, cfg.min_lr_ratio))


def retarget_schedule(scheduler, lr: float, total_steps: int) -> None:
    """Make a resumed schedule the one the run asks for: a checkpoint restores the step count, and with it the
    length and peak it was saved with, so a run extended from 2 to 4 steps would otherwise train at lr 0."""
    for fn in scheduler.lr_lambdas:
        fn.total_steps = total_steps
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def clip_grad_norm(params, max_norm: float | None) -> torch.Tensor:
    """Total gradient norm before clipping; clips to `max_norm` unless None (the norm is still wanted for logs)."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    if max_norm is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    # Under tensor parallelism the gradients are DTensors and so is their norm (already the whole model's, summed
    # over the shards); the caller wants a plain number.
    return norm.full_tensor() if _is_dtensor(norm) else norm


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def should_skip(loss: torch.Tensor | float, grad_norm: torch.Tensor | float) -> bool:
    """True when the step must not be applied: a non-finite loss or gradient norm."""
    values = torch.stack([torch.as_tensor(loss, dtype=torch.float32).detach().reshape(()).cpu(),
                          torch.as_tensor(grad_norm, dtype=torch.float32).detach().reshape(()).cpu()])
    return not bool(torch.isfinite(values).all())


@dataclass
class StepResult:
    grad_norm: float
    lr: float
    skipped: bool


@dataclass
class PendingStep:
    """A step whose update is launched and not yet read back: `skip` is a host bool where the host decided before
    the update, or a device flag where the optimizer skipped on the device by itself (`Stepper.launch`)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    skip: bool | torch.Tensor


class Stepper:
    """Clip, check, step (or skip and count), advance the schedule, clear gradients: the end of every train step.

    In two halves so the host never waits on the device between the last backward and the update: `launch` queues
    the clip and the update (the part that writes the weights, which a caller wraps in the engine's pause), and
    `finish` reads the loss, the norm and the skip decision back in one transfer, then does the host's bookkeeping.
    With a fused AdamW the optimizer skips a non-finite step on the device (`found_inf`, the flag AMP's grad scaler
    hands it: no update, no moment decay, its step count restored), so nothing waits; otherwise (the CPU) the host
    reads the loss and norm first and decides, as `step` always did."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, cfg: OptimConfig):
        self.model, self.optimizer, self.scheduler, self.cfg = model, optimizer, scheduler, cfg
        self.skipped_total = 0
        self.skipped_in_a_row = 0

    def step(self, loss: torch.Tensor) -> StepResult:
        return self.finish(self.launch(loss))

    def launch(self, loss: torch.Tensor) -> PendingStep:
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if self.skips_on_device:
            loss = loss.detach().to(grad_norm.device, torch.float32)
            bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
            self.optimizer.found_inf = bad.float()
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
            return PendingStep(loss, grad_norm, lr, bad)
        skip = should_skip(loss, grad_norm)
        if not skip:
            self.optimizer.step()
        return PendingStep(loss, grad_norm, lr, skip)

    @functools.cached_property
    def skips_on_device(self) -> bool:
        """The optimizer takes AMP's `found_inf` flag: torch's fused Adam and AdamW (`build_optimizer` fuses on CUDA),
        over plain tensors. Tensor-parallel (DTensor) parameters keep the host's decision: a plain flag beside sharded
        parameters in the fused op is a mix this project has not run on a GPU."""
        if not getattr(self.optimizer, "_step_supports_amp_scaling", False):
            return False
        return not any(_is_dtensor(p) for group in self.optimizer.param_groups for p in group["params"])

    def finish(self, pending: PendingStep) -> StepResult:
        if isinstance(pending.skip, torch.Tensor):  # one transfer for all three
            loss, grad_norm, bad = torch.stack([pending.loss, pending.grad_norm.float(),
                                                pending.skip.float()]).tolist()
            skip = bool(bad)
        else:
            loss, grad_norm, skip = float(pending.loss.detach()), float(pending.grad_norm), pending.skip
        if skip:
            self.skipped_total += 1
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row >= self.cfg.max_consecutive_skips:
                raise RuntimeError(f"{self.skipped_in_a_row} steps in a row had a non-finite loss or gradient norm "
                                   f"(last loss {loss}, grad norm {grad_norm}); stopping the run")
        else:
            self.skipped_in_a_row = 0
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm=grad_norm, lr=pending.lr, skipped=skip)

    def state_dict(self) -> dict:
        return {"skipped_total": self.skipped_total, "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: dict):
        self.skipped_total = int(state["skipped_total"])
        self.skipped_in_a_row = int(state["skipped_in_a_row"])
