"""A finished rollout, token-exact: exactly the ids the engine saw, with what the trainer needs per token.

A `Trajectory` *is* the trainer's `TrainingSample` (ids, trainable mask, behaviour logprobs, policy versions,
advantage), built token by token as turns finish, plus the conversation and its record for logs and eval.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from agentrl.env import ToolCall
from agentrl.sample import TrainingSample


@dataclass
class Trajectory(TrainingSample):
    prompt_index: int = 0
    # The dataset sample's own id (its "id" field, when it has one): what pairs two evals' records of a question.
    sample_id: str | None = None
    epoch: int = 0
    member: int = 0  # which rollout of its group
    prompt_len: int = 0
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each generated segment
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)  # the episode's own records (Episode.tool_calls)
    reward_components: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""  # "done", "max_turns", "truncated", "length"
    prefilled_tokens: list[int] = field(default_factory=list)  # per turn: prompt tokens the engine computed
    cached_tokens: list[int] = field(default_factory=list)  # per turn: prompt tokens served from the prefix cache
    turn_seeds: list[int | None] = field(default_factory=list)  # per turn: the sampling seed (replay)
    turn_budgets: list[int] = field(default_factory=list)  # per turn: the new-token budget it was given
    answer: str | None = None
    gold: Any = None

    def __post_init__(self):
        pass  # built token by token: checked as a whole when the trainer packs it (TrainingSample.validate)

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "truncated"

    def append(self, ids: list[int], *, trainable: bool, logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        self.input_ids.extend(ids)
        self.trainable.extend([int(trainable)] * len(ids))
        self.behaviour_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend(versions if versions is not None else [-1] * len(ids))

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["logprobs"] = record.pop("behaviour_logprobs")  # the name result files have always used
        record.pop("metadata")
        record["tool_calls"] = [c.to_json() for c in self.tool_calls]
        record["num_turns"] = self.num_turns
        return record
