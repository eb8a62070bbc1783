"""Executing parsed tool calls: argument checks, timeouts, output limits, failures as messages.

A rollout must survive anything a sampled model writes and anything a tool does, so every outcome becomes a
`ToolCall` record whose `content` tells the model what happened, and nothing here raises into the driver.
The record is the one shape of an executed call: the episode keeps it, the trajectory shares the episode's
list, and metrics, rewards, the eval JSONL and the viewer all read it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from agentrl.env.schema import json_type
from agentrl.env.tools import ToolHandle

__all__ = ["DELIVERED", "STATUSES", "WELL_FORMED", "ToolCall", "ToolStats", "check_arguments", "count_statuses",
           "render_output", "run_call", "run_calls"]

STATUSES = ("ok", "truncated", "parse_error", "unknown_tool", "bad_arguments", "tool_error", "timeout")
DELIVERED = ("ok", "truncated")  # the tool ran and its output reached the model
# A well-formed call names a real tool with valid arguments; whether the tool then succeeded is another matter
# (a timeout or a raising tool is the tool's failure, not the model's formatting).
WELL_FORMED = ("ok", "truncated", "tool_error", "timeout")


@dataclass(frozen=True)
class ToolCall:
    """One executed call. `turn` is the 0-based assistant turn that wrote it (the episode's prompt, worked
    examples included, does not count); `content` is what the model reads back, in `message`."""

    turn: int
    name: str
    arguments: Any  # a dict unless the model wrote something else (then `status` is "bad_arguments")
    status: str
    content: str
    seconds: float = 0.0

    @property
    def message(self) -> dict:
        """The `tool` message that carries `content` back to the model."""
        return {"role": "tool", "name": self.name, "content": self.content}

    @property
    def delivered(self) -> bool:
        return self.status in DELIVERED

    @property
    def well_formed(self) -> bool:
        return self.status in WELL_FORMED

    def to_json(self) -> dict[str, Any]:
        return {"turn": self.turn, "name": self.name, "arguments": self.arguments, "status": self.status,
                "content": self.content, "seconds": self.seconds}


class ToolStats:
    """Counts of call outcomes by status, accumulated over `ToolCall`s."""

    def __init__(self):
        self.counts: Counter = Counter()

    def add(self, calls: Iterable[ToolCall]) -> "ToolStats":
        self.counts.update(c.status for c in calls)
        return self

    @property
    def calls(self) -> int:
        return sum(self.counts.values())

    def metrics(self, prefix: str = "tools/") -> dict[str, float]:
        """Flat metrics: the call count, each status's count, and the share of calls that failed."""
        out: dict[str, float] = {f"{prefix}calls": float(self.calls)}
        for status in STATUSES:
            out[f"{prefix}{status}"] = float(self.counts.get(status, 0))
        failed = sum(n for s, n in self.counts.items() if s not in DELIVERED)
        out[f"{prefix}error_rate"] = failed / self.calls if self.calls else 0.0
        return out


def count_statuses(calls: Iterable[ToolCall]) -> dict[str, int]:
    """{status: count} over `ToolCall`s."""
    return dict(Counter(c.status for c in calls))


# `env` is an `Environment` and `episode` its `Episode` (agentrl.env.base), left unannotated because base
# imports this module.
async def run_calls(env, episode, calls: list[dict], turn: int) -> list[ToolCall]:
    """Run parsed calls one after another (so tools that change `episode.state` see each other's effects in
    the order the model wrote them), recording each as made in `turn`."""
    return [await run_call(env, episode, call, turn) for call in calls]


async def run_call(env, episode, call: dict, turn: int) -> ToolCall:
    """Execute one entry of `parse_tool_calls`' output against `env`'s tools."""
    start = time.perf_counter()
    if not isinstance(call, dict) or "error" in call or not isinstance(call.get("name"), str):
        what = call.get("error", "not a tool call") if isinstance(call, dict) else "not a tool call"
        name, arguments, status, content = "", {}, "parse_error", (
            f"Error: could not parse the tool call ({what}). Write each call as "
            '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call> with valid JSON.')
    else:
        name, arguments = call["name"], call.get("arguments") or {}
        status, content = await _run(env, episode, name, arguments)
    return ToolCall(turn, name, arguments, status, content, seconds=time.perf_counter() - start)


async def _run(env, episode, name: str, arguments: Any) -> tuple[str, str]:
    """(status, content) of one well-parsed call."""
    handle = env.tool_handle(name)
    if handle is None:
        names = ", ".join(env.tool_names()) or "(none)"
        return "unknown_tool", f"Error: unknown tool {name!r}. Available tools: {names}."
    checked, problem = check_arguments(handle.parameters, arguments)
    if problem:
        return "bad_arguments", f"Error: bad arguments for {name!r}: {problem}."
    kwargs = dict(checked)
    if handle.wants_episode:
        kwargs["episode"] = episode
    try:
        ok, value = await asyncio.wait_for(_invoke(handle, kwargs), handle.timeout)
    except asyncio.TimeoutError:  # only wait_for's own timeout: the tool's exceptions come back as values
        return "timeout", f"Error: tool {name!r} timed out after {handle.timeout:g} s."
    if not ok:
        detail = f"{type(value).__name__}: {value}" if str(value) else type(value).__name__
        return "tool_error", f"Error: tool {name!r} failed with {detail}"
    try:
        text = render_output(value)
    except Exception as e:
        return "tool_error", f"Error: tool {name!r} returned output that cannot be shown ({type(e).__name__}: {e})"
    limit = env.max_tool_output_chars
    if limit is not None and len(text) > limit:
        return "truncated", text[:limit] + f"\n[output truncated: {len(text)} characters, showing the first {limit}]"
    return "ok", text


async def _invoke(handle: ToolHandle, kwargs: dict) -> tuple[bool, Any]:
    # Exceptions are returned, not raised, so a tool raising TimeoutError is not mistaken for our timeout.
    if handle.is_async:
        try:
            return True, await handle.fn(**kwargs)
        except Exception as e:
            return False, e
    return await _in_thread(handle, kwargs)


async def _in_thread(handle: ToolHandle, kwargs: dict) -> tuple[bool, Any]:
    # A timed-out sync tool cannot be killed, only abandoned. Executor threads are joined at interpreter
    # exit (so one hung tool would keep a finished training run alive forever) and a bounded pool would let
    # a few hung tools starve every other rollout; a daemon thread per call has neither problem.
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def work():
        outcome = _call_sync(handle.fn, kwargs)
        try:
            loop.call_soon_threadsafe(_settle, future, outcome)
        except RuntimeError:  # the loop is closed: nobody is waiting for this result any more
            pass

    threading.Thread(target=work, name=f"agentrl-tool-{handle.name}", daemon=True).start()
    return await future


def _settle(future: asyncio.Future, outcome) -> None:
    if not future.done():  # a timeout may have cancelled it already
        future.set_result(outcome)


def _call_sync(fn: Callable, kwargs: dict) -> tuple[bool, Any]:
    try:
        return True, fn(**kwargs)
    except Exception as e:
        return False, e


def render_output(value: Any) -> str:
    """Text the model sees for a tool's return value: strings as-is, JSON for containers."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, (dict, list, tuple, int, float, bool)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


# ---- argument checks ----------------------------------------------------------------------------------

def check_arguments(parameters: dict, arguments: Any) -> tuple[dict, str | None]:
    """(arguments ready to pass, None) or ({}, what is wrong), against a tool's parameter schema.

    Strict on purpose: a wrong type is reported to the model rather than coerced, so it learns the schema.
    The one conversion is an integral float for an integer (`3.0` → `3`), which JSON cannot tell apart.
    """
    if not isinstance(arguments, dict):
        return {}, f"arguments must be a JSON object, got {_kind(arguments)}"
    props = parameters.get("properties", {})
    unexpected = [k for k in arguments if k not in props]
    if unexpected:
        expected = ", ".join(props) or "none"
        return {}, f"unexpected argument {unexpected[0]!r} (expected: {expected})"
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return {}, f"missing required argument {missing[0]!r}"
    out = {}
    for key, value in arguments.items():
        converted, problem = check_value(value, props[key], key)
        if problem:
            return {}, problem
        out[key] = converted
    return out, None


def check_value(value: Any, schema: dict, path: str) -> tuple[Any, str | None]:
    """(value, None) if `value` fits `schema` (possibly converted), else (None, message)."""
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            converted, problem = check_value(value, option, path)
            if problem is None:
                return converted, None
        return None, f"argument {path!r} does not match any allowed form, got {_got(value)}"
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        for kind in kinds:
            ok, converted = _fits(value, kind)
            if ok:
                value = converted
                break
        else:
            wanted = " or ".join(_KIND_WORDS.get(k, k) for k in kinds)
            return None, f"argument {path!r} must be {wanted}, got {_got(value)}"
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        allowed = ", ".join(json.dumps(e) for e in schema["enum"])
        return None, f"argument {path!r} must be one of {allowed}, got {_show(value)}"
    if isinstance(value, list) and "items" in schema:
        items = []
        for i, item in enumerate(value):
            converted, problem = check_value(item, schema["items"], f"{path}[{i}]")
            if problem:
                return None, problem
            items.append(converted)
        value = items
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        inner = {}
        for k, v in value.items():
            converted, problem = check_value(v, schema["additionalProperties"], f"{path}.{k}")
            if problem:
                return None, problem
            inner[k] = converted
        value = inner
    return value, None


_KIND_WORDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
               "array": "an array", "object": "an object", "null": "null"}


def _fits(value: Any, kind: str) -> tuple[bool, Any]:
    # bool is an int subclass in Python but never a number in JSON: `true` for an integer is a type error.
    if kind == "string":
        return isinstance(value, str), value
    if kind == "integer":
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, value
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    if kind == "boolean":
        return isinstance(value, bool), value
    if kind == "null":
        return value is None, value
    if kind == "array":
        return isinstance(value, list), value
    if kind == "object":
        return isinstance(value, dict), value
    return True, value


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _kind(value: Any) -> str:
    return json_type(value) or type(value).__name__


def _got(value: Any) -> str:
    return "null" if value is None else f"{_kind(value)} {_show(value)}"


def _show(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
