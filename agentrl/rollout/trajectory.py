"""A finished rollout, token-exact: exactly the ids the engine saw, with what the trainer needs per token."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Trajectory:
    prompt_index: int
    epoch: int
    group_id: int
    input_ids: list[int] = field(default_factory=list)
    trainable: list[int] = field(default_factory=list)  # 1 only on model-generated tokens
    logprobs: list[float] = field(default_factory=list)  # behaviour logprob per token, 0.0 where not trainable
    versions: list[int] = field(default_factory=list)  # policy version per token, -1 where not trainable
    prompt_len: int = 0
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each generated segment
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # name, arguments, status, turn
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    finish_reason: str = ""  # "done", "max_turns", "truncated", "length"
    prefilled_tokens: list[int] = field(default_factory=list)  # per turn: prompt tokens the engine computed
    cached_tokens: list[int] = field(default_factory=list)  # per turn: prompt tokens served from the prefix cache
    answer: str | None = None
    gold: Any = None

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
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend(versions if versions is not None else [-1] * len(ids))

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["num_turns"] = self.num_turns
        return record
