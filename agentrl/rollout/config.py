"""The rollout driver's knobs: the `rollout:` section of a run's config, used as it is by training and eval."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentrl.config import check_types, require


@dataclass
class RolloutConfig:
    group_size: int = 8  # rollouts per prompt; advantages are normalised within a group (eval: 1)
    groups_per_step: int = 4  # groups the trainer takes a step
    max_turns: int = 4
    max_new_tokens: int = 256  # per turn
    max_sample_tokens: int = 4096  # whole rollout, prompt + every turn; longer ones are cut
    temperature: float = 1.0  # 0: greedy (eval's default; training needs > 0)
    top_p: float = 1.0
    top_k: int = 0
    # Rollouts decoding at once. None: twice a step's rollouts, at least 64 (`in_flight`), so the engine keeps a
    # full batch while the trainer takes one step's worth; at one step's worth the engine decodes only what is left
    # of it (BENCHMARKS.md, TRL side by side: a 64-rollout step with 64 in flight was bound by that concurrency).
    rollouts_in_flight: int | None = None
    # Backpressure: finished batches allowed to wait for the trainer before the driver stops starting groups.
    # Unbounded, a fast engine outruns the trainer and the trained tokens grow stale.
    max_ready_batches: int = 1
    drop_truncated: bool = False  # leave out rollouts cut at max_sample_tokens instead of training on them
    advantage: Literal["mean_std", "mean"] = "mean_std"  # group-normalised (GRPO) or centred only (Dr. GRPO)
    tool_workers: int = 16  # threads for sync tools
    # Off by default: several calls per turn are allowed, and a model ends its turn with its end-of-turn token.
    stop_after_tool_call: bool = False

    def __post_init__(self):
        check_types(self, "rollout")
        for key in ("group_size", "groups_per_step", "max_turns", "max_new_tokens", "max_sample_tokens",
                    "max_ready_batches", "tool_workers"):
            require(getattr(self, key) >= 1, f"rollout.{key}", "must be >= 1")
        if self.rollouts_in_flight is not None:
            require(self.rollouts_in_flight >= 1, "rollout.rollouts_in_flight", "must be >= 1 (or none: twice a step)")
        require(self.temperature >= 0, "rollout.temperature", "must be >= 0 (0: greedy)")
        require(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        require(self.top_k >= 0, "rollout.top_k", "must be >= 0 (0: off)")

    @property
    def in_flight(self) -> int:
        """`rollouts_in_flight`, or by default twice a step's rollouts and at least 64."""
        if self.rollouts_in_flight is not None:
            return self.rollouts_in_flight
        return max(64, 2 * self.samples_per_step)

    @property
    def samples_per_step(self) -> int:
        return self.groups_per_step * self.group_size

    @property
    def max_ready_samples(self) -> int:
        return self.max_ready_batches * self.samples_per_step
