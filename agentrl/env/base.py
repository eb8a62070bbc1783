"""The Environment API: tasks, their tools, per-rollout episodes and rewards.

An environment is a class; a tool is one of its methods marked with `@tool`. Everything that varies per
rollout lives on the `Episode` that `start(sample)` returns (never on the environment instance), so one
environment object serves thousands of concurrent rollouts.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

from agentrl.chat.schema import function_schema
from agentrl.tools_exec import ToolHandle, ToolResult, ToolStats, count_statuses, run_calls

__all__ = ["Environment", "Episode", "ToolResult", "ToolStats", "count_statuses", "load_environment", "tool",
           "available_environments"]

_MARK = "__agentrl_tool__"


@dataclass(frozen=True)
class _ToolMark:
    name: str | None
    timeout: float | None
    description: str | None


def tool(fn: Callable | None = None, *, timeout: float | None = None, name: str | None = None,
         description: str | None = None):
    """Mark a method as a tool: `@tool` or `@tool(timeout=5.0, name="search")`.

    The method is returned unchanged (still directly callable, sync or async); the mark only tells
    `Environment.tools()` to describe it to the model. `timeout` overrides `Environment.tool_timeout_s`;
    `description` overrides the docstring's prose.
    """
    def mark(f: Callable) -> Callable:
        setattr(f, _MARK, _ToolMark(name, timeout, description))
        return f

    return mark(fn) if fn is not None else mark


@dataclass
class Episode:
    """Per-rollout state, created by `Environment.start(sample)`.

    `tool_calls` holds one dict per executed call: `{"name", "arguments", "status", "output", "seconds"}`
    (`status` as in `ToolResult`). `messages` starts as the prompt; the rollout driver (or `step`) appends
    the assistant turns and tool messages. `final_text` is the last assistant turn once `done`.
    """

    sample: dict
    state: dict = field(default_factory=dict)
    tool_calls: list = field(default_factory=list)
    messages: list = field(default_factory=list)
    final_text: str | None = None
    done: bool = False

    @property
    def turns(self) -> int:
        """Number of assistant turns so far."""
        return sum(1 for m in self.messages if m.get("role") == "assistant")


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
        handles = self.__dict__.get("_handles")
        if handles is None:
            handles = {}
            for attr, mark in _tool_attrs(type(self)):
                fn = getattr(type(self), attr)
                tool_name = mark.name or attr
                if tool_name in handles:
                    raise TypeError(f"{type(self).__name__}: two tools are named {tool_name!r}")
                params = inspect.signature(fn).parameters
                handles[tool_name] = ToolHandle(
                    name=tool_name,
                    fn=getattr(self, attr),
                    schema=function_schema(fn, name=tool_name, description=mark.description),
                    timeout=mark.timeout if mark.timeout is not None else self.tool_timeout_s,
                    wants_episode="episode" in params,
                    is_async=inspect.iscoroutinefunction(fn),
                )
            self.__dict__["_handles"] = handles
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

    async def execute(self, episode: Episode, calls: list[dict]) -> list[ToolResult]:
        """Run parsed tool calls in order; every failure comes back as a tool message, never an exception.

        Calls run one after another so tools that change `episode.state` see each other's effects in the
        order the model wrote them. Each call is also recorded in `episode.tool_calls`.
        """
        results = await run_calls(self, episode, calls)
        for r in results:
            episode.tool_calls.append({"name": r.name, "arguments": r.arguments, "status": r.status,
                                       "output": r.content, "seconds": r.seconds})
        return results

    def is_done(self, episode: Episode, assistant_text: str, calls: list[dict]) -> bool:
        """Whether the rollout ends after this assistant turn: by default, when it made no tool call."""
        return not calls

    async def step(self, episode: Episode, assistant_text: str) -> list[ToolResult]:
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


def _tool_attrs(cls: type) -> list[tuple[str, _ToolMark]]:
    # Walk base classes first so a subclass's added tools come after the inherited ones; an override keeps
    # its ancestor's position, and an override without @tool removes the tool.
    order: list[str] = []
    for klass in reversed(cls.__mro__):
        for attr in vars(klass):
            if attr not in order:
                order.append(attr)
    out = []
    for attr in order:
        value = inspect.getattr_static(cls, attr)
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        mark = getattr(value, _MARK, None)
        if isinstance(mark, _ToolMark):
            out.append((attr, mark))
    return out


def available_environments() -> list[str]:
    """Names `load_environment` accepts: the subpackages and modules of `environments`."""
    try:
        package = importlib.import_module("environments")
    except ImportError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def load_environment(name: str, **kwargs: Any) -> Environment:
    """Import `environments.<name>` and return its module-level `load_environment(**kwargs)`."""
    module_name = f"environments.{name.replace('-', '_')}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name not in (module_name, "environments"):
            raise  # the environment exists but one of its own imports is missing: show that, not "unknown"
        known = ", ".join(available_environments()) or "(none)"
        raise ValueError(f"unknown environment {name!r}; available: {known}") from None
    factory = getattr(module, "load_environment", None)
    if not callable(factory):
        raise ValueError(f"{module_name} does not define a module-level load_environment(**kwargs)")
    env = factory(**kwargs)
    if not isinstance(env, Environment):
        raise TypeError(f"{module_name}.load_environment returned {type(env).__name__}, not an Environment")
    return env
