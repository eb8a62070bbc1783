"""Groups of rollouts per prompt, their advantages, and the ready pool the trainer draws from (oldest first)."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from agentrl.rollout.prompts import Prompt
from agentrl.rollout.trajectory import Trajectory


def group_advantages(rewards: list[float], mode: str = "mean_std", eps: float = 1e-6) -> list[float]:
    """Centre rewards on the group mean; `mean_std` also divides by the group's standard deviation."""
    if mode not in ("mean_std", "mean"):
        raise ValueError(f"advantage mode must be 'mean_std' or 'mean', got {mode!r}")
    if all(r == rewards[0] for r in rewards):
        # Exactly 0: the mean of equal floats can round off their value (0.1 three times: a mean 1.4e-17 away), and
        # divided by a zero spread that rounding became an advantage of ±1e-11, a push in one direction that no
        # score asked for, and a sample the trainer would run for nothing (`loss.carries_gradient`).
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if mode == "mean":
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]


@dataclass
class Group:
    group_id: int
    prompt: Prompt
    size: int
    trajectories: list[Trajectory] = field(default_factory=list)
    finished_at: float = 0.0

    @property
    def complete(self) -> bool:
        return len(self.trajectories) == self.size


class ReadyPool:
    """Finished, scored groups in order of completion. The trainer takes the oldest first, so no group waits
    behind newer ones and staleness stays bounded by the pool's depth."""

    def __init__(self):
        self._groups: deque[Group] = deque()
        self._cond = threading.Condition()

    def put(self, group: Group) -> None:
        group.finished_at = time.monotonic()
        with self._cond:
            self._groups.append(group)
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def num_samples(self) -> int:
        with self._cond:
            return sum(len(g.trajectories) for g in self._groups)

    def oldest_age(self) -> float:
        with self._cond:
            return time.monotonic() - self._groups[0].finished_at if self._groups else 0.0

    def take(self, min_samples: int, timeout: float | None = None) -> list[Group]:
        """Block until at least `min_samples` samples are ready, then take whole groups, oldest first, until
        that many are taken. Returns nothing (and takes nothing) if that many are not ready by the timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while sum(len(g.trajectories) for g in self._groups) < min_samples:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self._cond.wait(left)
            taken, count = [], 0
            while self._groups and count < min_samples:
                group = self._groups.popleft()
                taken.append(group)
                count += len(group.trajectories)
            return taken
