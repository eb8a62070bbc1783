"""Rollout metrics: the driver's running counters, and per-batch summaries of finished trajectories."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from agentrl.rollout.trajectory import Trajectory


@dataclass
class DriverStats:
    target_in_flight: int
    rollouts_started: int = 0
    rollouts_finished: int = 0
    dropped_truncated: int = 0
    prompts_too_long: int = 0  # skipped: no room to generate within max_sample_tokens
    # In-flight count seen after each refill while prompts remained: the driver's promise is that it equals the
    # target, so the engine's batch never drains while there is work to start.
    in_flight_while_refilling: list[int] = field(default_factory=list)

    def observe_in_flight(self, n: int, *, refilling: bool) -> None:
        if refilling:
            self.in_flight_while_refilling.append(n)
            if len(self.in_flight_while_refilling) > 10_000:
                del self.in_flight_while_refilling[:5_000]

    @property
    def in_flight(self) -> int:
        return self.rollouts_started - self.rollouts_finished


def summarize(trajectories: list[Trajectory]) -> dict[str, float]:
    """Tool use, errors by kind, turns, tokens, cache hits and the environment's reward components."""
    n = len(trajectories)
    if n == 0:
        return {"n": 0}
    calls = [c for t in trajectories for c in t.tool_calls]
    # Calls of a real tool with valid arguments count as tool use even when the tool then failed (its failure,
    # not the model's formatting); tool_error_rate counts every call whose output did not reach the model.
    well_formed = [c for c in calls if c.well_formed]
    delivered = [c for c in calls if c.delivered]
    statuses = Counter(c.status for c in calls)
    turns = sum(t.num_turns for t in trajectories)
    generated = sum(sum(t.trainable) for t in trajectories)
    prefilled = sum(sum(t.prefilled_tokens) for t in trajectories)
    cached = sum(sum(t.cached_tokens) for t in trajectories)
    resubmitted_cached = sum(sum(t.cached_tokens[1:]) for t in trajectories)
    resubmitted = sum(sum(t.cached_tokens[1:]) + sum(t.prefilled_tokens[1:]) for t in trajectories)
    out: dict[str, float] = {
        "n": n,
        "tool_call_rate": sum(any(c.well_formed for c in t.tool_calls) for t in trajectories) / n,
        "tool_calls_per_rollout": len(well_formed) / n,
        "tool_error_rate": (len(calls) - len(delivered)) / len(calls) if calls else 0.0,
        "mean_turns": turns / n,
        "tokens_per_turn": generated / turns if turns else 0.0,
        "reward": sum(t.reward for t in trajectories) / n,
        "truncated_rate": sum(t.truncated for t in trajectories) / n,
        "prefix_cache_hit_share": cached / (cached + prefilled) if cached + prefilled else 0.0,
        "resubmit_cache_hit_share": resubmitted_cached / resubmitted if resubmitted else 0.0,
    }
    for status, count in sorted(statuses.items()):
        out[f"tool_status/{status}"] = count / n
    components = sorted({k for t in trajectories for k in t.reward_components})
    for key in components:
        values = [t.reward_components[key] for t in trajectories if key in t.reward_components]
        out[key] = sum(values) / len(values)
    return out
