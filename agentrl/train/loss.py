"""Token-level clipped policy-gradient loss (GRPO / DAPO / Dr.GRPO) against the engine's behaviour logprobs.

This trainer takes one optimizer step per batch while the engine keeps generating from the same weights (zero
sync), so there is no separate "old" policy to recompute: the old logprobs are the behaviour logprobs the engine
sampled with, and the ratio is `r = exp(current - behaviour)`.

That ratio is already the importance weight of the gradient (`d(r * A) = r * A * d log pi`), so truncated
importance sampling caps *that* weight at `tis_cap` rather than multiplying a second copy of it in (which would
weight the gradient by r squared): the surrogate is scaled by `min(r, cap) / r`, with `r` detached, giving a
gradient weight of `min(r, cap)`. This matters where the clip does not act: for a negative advantage the PPO
surrogate keeps `r * A` however large r grows, and a token the engine found unlikely but the trainer does not
(a kernel or precision mismatch, or staleness) would otherwise dominate the step.

Aggregation, written as `sum_t w_t * loss_t / D` so that a batch split into micro-batches sums to the same loss
when each part is given the whole batch's `D` (`loss_denominator`):
- grpo:    w_t = 1 / (kept tokens of t's sample),  D = samples with a kept token  (sequence mean, then batch mean)
- dapo:    w_t = 1,                                D = kept tokens                 (token mean over the batch)
- dr_grpo: w_t = 1,                                D = samples * dr_grpo_max_tokens (constant normaliser)
Tokens older than `current_version - max_staleness` are dropped (`stale_weight = 0`, out of every count) or
down-weighted (kept in the counts, with weight `stale_weight`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from agentrl.train.config import LossConfig
from agentrl.train.pack import TrainableTokens

_MAX_LOG_RATIO = 20.0  # exp(20) = 4.9e8, far past any clip or cap; keeps inf * 0 from turning into nan


def _keep_weights(tokens: TrainableTokens, cfg: LossConfig, current_version: int) -> torch.Tensor:
    keep = torch.ones(len(tokens), dtype=torch.float32, device=tokens.versions.device)
    if cfg.max_staleness is not None:
        stale = tokens.versions < current_version - cfg.max_staleness
        keep = torch.where(stale, torch.full_like(keep, cfg.stale_weight), keep)
    return keep


def _token_weights(tokens: TrainableTokens, cfg: LossConfig, current_version: int):
    keep = _keep_weights(tokens, cfg, current_version)
    kept = (keep > 0).float()
    if cfg.type == "grpo":
        per_sample = torch.zeros(tokens.num_samples, dtype=torch.float32, device=keep.device)
        per_sample.index_add_(0, tokens.sample_index, kept)
        weights = keep / per_sample[tokens.sample_index].clamp(min=1)
        denominator = (per_sample > 0).sum().float()
    elif cfg.type == "dapo":
        weights, denominator = keep, kept.sum()
    else:
        weights = keep
        denominator = torch.full((), float(tokens.num_samples * cfg.dr_grpo_max_tokens), device=keep.device)
    return weights, denominator


def loss_denominator(tokens: TrainableTokens, cfg: LossConfig, current_version: int) -> torch.Tensor:
    """`D` of the whole batch, for callers that run it as several micro-batches (pass it to each `policy_loss`)."""
    return _token_weights(tokens, cfg, current_version)[1]


def samples_loss_denominator(samples: Sequence, cfg: LossConfig, current_version: int) -> float:
    """`D` of a batch of samples without packing them: what `loss_denominator` gives for their packed batch. Callers
    that train only part of a batch divide by the whole one's: replicas (each trains its share) and a trainer that
    leaves out the samples that carry no gradient (`carries_gradient`)."""
    versions = [np.asarray(s.versions[1:], dtype=np.int64)[np.asarray(s.trainable[1:], dtype=bool)] for s in samples]
    m = sum(len(v) for v in versions)
    index = np.repeat(np.arange(len(samples)), [len(v) for v in versions])
    tokens = TrainableTokens(target_ids=torch.zeros(m, dtype=torch.long), behaviour_logprobs=torch.zeros(m),
                             advantages=torch.zeros(m),
                             versions=torch.from_numpy(np.concatenate(versions) if versions else np.zeros(0, np.int64)),
                             sample_index=torch.from_numpy(index), num_samples=len(samples))
    return float(loss_denominator(tokens, cfg, current_version))


def carries_gradient(sample) -> bool:
    """Whether `sample` can move the parameters. Every loss here is a sum of per-token terms each scaled by its
    sample's advantage (the clip, the importance cap and the staleness weight only rescale them), so a sample whose
    advantage is 0 (a group whose members all scored alike) adds exactly zero to the gradient; its tokens still
    count in `D`, which `samples_loss_denominator` takes over the whole batch."""
    return sample.advantage != 0.0


class TokenLoss:
    """Each trained token's term of the policy loss: `policy_loss` is the sum of `self(logprobs)`.

    Every term is a function of its own token's logprob (the weights and the denominator are fixed before the
    forward), so the chunked lm_head can take the loss's gradient chunk by chunk while the chunk's logits are still
    there (`lm_head.chunked_logprobs(token_loss=...)`) instead of computing them again in the backward.
    """

    def __init__(self, tokens: TrainableTokens, cfg: LossConfig, *, current_version: int,
                 denominator: torch.Tensor | float | None = None, device: torch.device | None = None):
        tokens = tokens.to(device if device is not None else tokens.behaviour_logprobs.device)
        weights, own_denominator = _token_weights(tokens, cfg, current_version)
        device = weights.device
        if denominator is None:
            d = own_denominator
        elif isinstance(denominator, torch.Tensor):
            d = denominator.to(device=device, dtype=torch.float32)
        else:  # a host number: a fill kernel takes it as an argument, where as_tensor would copy it and wait
            d = torch.full((), float(denominator), dtype=torch.float32, device=device)
        self.tokens, self.cfg = tokens, cfg
        self.scale = weights / d.clamp(min=1)

    def __call__(self, logprobs: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The terms `[end - start]` of tokens `start:end`, from their logprobs (differentiable in them)."""
        end = len(self.tokens) if end is None else end
        cfg = self.cfg
        behaviour, adv = self.tokens.behaviour_logprobs[start:end], self.tokens.advantages[start:end]
        ratio = torch.exp((logprobs.float() - behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        surrogate = torch.minimum(ratio * adv, clipped * adv)
        if cfg.tis_cap is not None:
            w = ratio.detach()
            surrogate = surrogate * (w.clamp(max=cfg.tis_cap) / w)
        return -surrogate * self.scale[start:end]

    def metrics(self, logprobs: torch.Tensor, entropy: torch.Tensor | None, current_version: int) -> PendingMetrics:
        tokens = self.tokens
        return _metrics(logprobs.detach().float() - tokens.behaviour_logprobs, tokens.advantages, tokens, self.cfg,
                        current_version, entropy)


def policy_loss(logprobs: torch.Tensor, tokens: TrainableTokens, cfg: LossConfig, *, current_version: int,
                entropy: torch.Tensor | None = None, denominator: torch.Tensor | float | None = None,
                defer_metrics: bool = False):
    """Loss (a scalar with grad) and a metrics dict of python numbers for the `[M]` trained tokens of a batch.

    `logprobs` / `entropy` come from `packed_token_logprobs`, in `tokens`' order. `current_version` is the policy
    version the parameters hold now (staleness is measured against it). `defer_metrics` returns them as
    `PendingMetrics` (resolve after the step's last backward) instead of syncing for them now.
    """
    if logprobs.shape != tokens.behaviour_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} do not match {len(tokens)} trained tokens")
    terms = TokenLoss(tokens, cfg, current_version=current_version, denominator=denominator, device=logprobs.device)
    loss = terms(logprobs).sum()
    pending = terms.metrics(logprobs, entropy, current_version)
    return loss, (pending if defer_metrics else pending.resolve())


class PendingMetrics:
    """A micro-batch's metrics still on the device: `resolve()` brings them to the host (one sync). A step of
    several micro-batches resolves them all after its last backward, so the host never waits on the device in
    between (each wait there left the device idle while the host queued the next forward)."""

    def __init__(self, names, values, staleness, n: int, current_version: int):
        self.names, self.values, self.staleness, self.n, self.current_version = names, values, staleness, n, current_version

    def resolve(self) -> dict:
        if self.n == 0:
            return {"tokens": 0}
        out = dict(zip(self.names, self.values.tolist()))  # one host sync for every scalar
        if out["staleness_min"] < 0:
            raise ValueError(f"tokens carry policy versions newer than the current one ({self.current_version}): "
                             f"the engine and the trainer disagree on the version counter")
        out["tokens"] = self.n
        out["stale_tokens"] = int(out["stale_tokens"])
        counts = torch.bincount(self.staleness).tolist()
        out["staleness_hist"] = {s: c for s, c in enumerate(counts) if c}
        del out["staleness_min"]
        return out


@torch.no_grad()
def _metrics(log_ratio, adv, tokens: TrainableTokens, cfg: LossConfig, current_version: int, entropy) -> PendingMetrics:
    n = log_ratio.numel()
    if n == 0:
        return PendingMetrics([], None, None, 0, current_version)
    ratio = log_ratio.exp()
    staleness = current_version - tokens.versions
    stale = torch.zeros_like(staleness, dtype=torch.bool)
    if cfg.max_staleness is not None:
        stale = staleness > cfg.max_staleness
    names = ["clip_low_frac", "clip_high_frac", "is_ratio_mean", "is_ratio_max", "is_ratio_min",
             "kl_behaviour_current", "staleness_mean", "staleness_min", "stale_tokens"]
    values = [
        ((ratio < 1 - cfg.clip_low) & (adv < 0)).float().mean(),  # the clip removed this token's gradient
        ((ratio > 1 + cfg.clip_high) & (adv > 0)).float().mean(),
        ratio.mean(), ratio.max(), ratio.min(),
        # k3 estimator of KL(behaviour || current) from tokens sampled by the behaviour policy: unbiased, >= 0
        (ratio - 1 - log_ratio).mean(),
        staleness.float().mean(), staleness.min().float(), stale.sum().float(),
    ]
    if cfg.tis_cap is not None:
        names.append("tis_truncated_frac")
        values.append((ratio > cfg.tis_cap).float().mean())
    if entropy is not None:
        names.append("entropy_mean")
        values.append(entropy.detach().float().mean())
    return PendingMetrics(names, torch.stack(values), staleness, n, current_version)
