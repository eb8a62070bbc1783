"""The Environment API: tasks, their tools, per-rollout episodes and rewards.

An environment is a class; a tool is one of its methods marked with `@tool`. Everything that varies per
rollout lives on the `Episode` that `start(sample)` returns (never on the environment instance), so one
environment object serves thousands of concurrent rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentrl.env.execute import ToolCall, run_calls
from agentrl.env.tools import ToolHandle, bind_tools

__all__ = ["Environment", "Episode"]


@dataclass
class Episode:
    """Per-rollout state, created by `Environment.start(sample)`.

    `messages` starts as the prompt (its first `num_prompt_messages`, which may hold worked examples with
    assistant turns of their own); the rollout driver (or `step`) appends the assistant turns and tool
    messages. `tool_calls` holds one `ToolCall` per executed call, in order. `final_text` is the last
    assistant turn once `done`.
    """

    sample: dict
    state: dict = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)
    messages: list = field(default_factory=list)
    final_text: str | None = None
    done: bool = False
    num_prompt_messages: int | None = None  # None: all of `messages` as given at creation

    def __post_init__(self):
        if self.num_prompt_messages is None:
            self.num_prompt_messages = len(self.messages)

    @property
    def turns(self) -> int:
        """Number of assistant turns so far, not counting any in the prompt."""
        # A tool holds the episode too and may have left anything here; counting turns must still work.
        messages = self.messages if isinstance(self.messages, list) else []
        start = self.num_prompt_messages if isinstance(self.num_prompt_messages, int) else 0
        return sum(1 for m in messages[start:] if isinstance(m, dict) and m.get("role") == "assistant")


class Environment:
    """Base class of every environment; subclass it, add `@tool` methods, implement `reward`."""

    name: str = ""
    system_prompt: str = ""
    max_tool_output_chars: int = 2000
    tool_timeout_s: float = 10.0
    # Weight per reward component when `reward` returns a dict; a missing name weighs 1.0, and a weight of
    # 0.0 keeps a component in the logs without letting it move the policy.
    reward_weights: dict[str, float] = {}

    def __init__(self, **kwargs):
        # Keyword overrides of the class-level settings (e.g. `max_tool_output_chars=500`) so
        # `load_environment(name, **kwargs)` can tune any environment without a subclass.
        for key, value in kwargs.items():
            default = getattr(type(self), key, _MISSING)
            if key.startswith("_") or default is _MISSING or callable(default):
                raise TypeError(f"{type(self).__name__} got an unexpected keyword argument {key!r}")
            setattr(self, key, value)

    # ---- tools ---------------------------------------------------------------------------------------

    def tools(self) -> list[dict]:
        """The tool schemas shown to the model, in definition order (base-class tools first)."""
        return [h.schema for h in self._tool_handles().values()]

    def tool_names(self) -> list[str]:
        return list(self._tool_handles())

    def tool_handle(self, name: str) -> ToolHandle | None:
        """The bound tool called `name`, or None; used by execution, exposed for drivers and tests."""
        return self._tool_handles().get(name)

    def _tool_handles(self) -> dict[str, ToolHandle]:
        # Bound on first use, after `__init__`'s overrides (e.g. `tool_timeout_s`) have been applied.
        handles = self.__dict__.get("_handles")
        if handles is None:
            handles = self.__dict__["_handles"] = bind_tools(self, self.tool_timeout_s)
        return handles

    # ---- rollout lifecycle ---------------------------------------------------------------------------

    def start(self, sample: dict) -> Episode:
        """A fresh episode for `sample`, its messages set to `prompt(sample)`."""
        return Episode(sample=sample, messages=[dict(m) for m in self.prompt(sample)])

    def prompt(self, sample: dict) -> list[dict]:
        """The opening messages: `system_prompt` (if any) and the sample's question."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": str(sample["question"])})
        return messages

    async def execute(self, episode: Episode, calls: list[dict]) -> list[ToolCall]:
        """Run parsed tool calls in order; every failure comes back as a tool message, never an exception.

        Calls run one after another so tools that change `episode.state` see each other's effects in the
        order the model wrote them. Each is recorded once, in `episode.tool_calls`, as made in the episode's
        latest assistant turn (turn 0 if none has been recorded yet); the same records are returned.
        """
        records = await run_calls(self, episode, calls, turn=max(episode.turns - 1, 0))
        if not isinstance(episode.tool_calls, list):  # a tool replaced it: these records are kept all the same
            episode.tool_calls = []
        episode.tool_calls.extend(records)
        return records

    def is_done(self, episode: Episode, assistant_text: str, calls: list[dict]) -> bool:
        """Whether the rollout ends after this assistant turn: by default, when it made no tool call."""
        return not calls

    async def step(self, episode: Episode, assistant_text: str) -> list[ToolCall]:
        """One assistant turn, message-level: record it, run its calls, and update `done`/`final_text`.

        A convenience for drivers that work with messages; a token-level driver may instead call
        `parse_tool_calls`, `is_done` and `execute` itself.
        """
        from agentrl.chat.parse import parse_tool_calls

        calls = parse_tool_calls(assistant_text)
        episode.messages.append({"role": "assistant", "content": assistant_text})
        if self.is_done(episode, assistant_text, calls):
            episode.done, episode.final_text = True, assistant_text
            return []
        results = await self.execute(episode, calls)
        episode.messages.extend(r.message for r in results)
        return results

    # ---- reward and data -----------------------------------------------------------------------------

    def reward(self, episode: Episode) -> float | dict[str, float]:
        """The episode's reward: a float, or named components weighted by `reward_weights`."""
        raise NotImplementedError(f"{type(self).__name__} must implement reward(episode)")

    def total_reward(self, episode: Episode) -> tuple[float, dict[str, float]]:
        """(weighted total, raw components); a float reward has no components."""
        value = self.reward(episode)
        if isinstance(value, dict):
            components = {k: float(v) for k, v in value.items()}
            unknown = set(self.reward_weights) - set(components)
            if unknown:  # a weight for a component never produced is almost surely a typo
                raise KeyError(f"reward_weights names unknown components {sorted(unknown)}")
            total = sum(self.reward_weights.get(k, 1.0) * v for k, v in components.items())
            return float(total), components
        return float(value), {}

    def load_dataset(self, split: str = "train", path: str | None = None, limit: int | None = None) -> list[dict]:
        """The task's samples (dicts with at least what `prompt` and `reward` read)."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_dataset(split, path, limit)")


_MISSING = object()
