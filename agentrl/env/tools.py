"""The `@tool` mark, and how an environment's marked methods become bound, described tools.

A tool is an ordinary method with a mark on it: calling it directly still works, and nothing about it is
registered anywhere global. The environment finds its marked methods when first asked for its tools and
binds each to the instance together with its schema and timeout (`ToolHandle`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from agentrl.env.schema import function_schema

__all__ = ["ToolHandle", "bind_tools", "tool"]

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


@dataclass(frozen=True)
class ToolHandle:
    """A tool bound to its environment instance, with what execution needs to know about it."""

    name: str
    fn: Callable
    schema: dict
    timeout: float
    wants_episode: bool
    is_async: bool

    @property
    def parameters(self) -> dict:
        return self.schema["function"]["parameters"]


def bind_tools(env, default_timeout: float) -> dict[str, ToolHandle]:
    """{tool name: handle} for every `@tool` method of `env`, in definition order (base-class tools first)."""
    cls = type(env)
    handles: dict[str, ToolHandle] = {}
    for attr, mark in _tool_attrs(cls):
        fn = getattr(cls, attr)
        tool_name = mark.name or attr
        if tool_name in handles:
            raise TypeError(f"{cls.__name__}: two tools are named {tool_name!r}")
        handles[tool_name] = ToolHandle(
            name=tool_name,
            fn=getattr(env, attr),
            schema=function_schema(fn, name=tool_name, description=mark.description),
            timeout=mark.timeout if mark.timeout is not None else default_timeout,
            wants_episode="episode" in inspect.signature(fn).parameters,
            is_async=inspect.iscoroutinefunction(fn),
        )
    return handles


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
