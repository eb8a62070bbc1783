"""Executing parsed tool calls: argument checks, timeouts, output limits, failures as messages.

A rollout must survive anything a sampled model writes and anything a tool does, so every outcome becomes a
`ToolCall` record whose `content` tells the model what happened, and nothing here raises into the driver but
the driver's own cancellation. Whatever a tool raises (SystemExit, KeyboardInterrupt and its own CancelledError
included) is its failure; a tool that outlives its timeout is abandoned, even one that ignores cancellation;
every content is capped and made of text a tokenizer takes, and every record serialises to JSON.
The record is the one shape of an executed call: the episode keeps it, the trajectory shares the episode's
list, and metrics, rewards, the eval JSONL and the viewer all read it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from agentrl.chat.unicode import encodable
from agentrl.env.schema import json_type
from agentrl.env.tools import ToolHandle

__all__ = ["CANCEL_GRACE_S", "DELIVERED", "MAX_ARGUMENT_DEPTH", "MIN_MESSAGE_CHARS", "STATUSES", "WELL_FORMED",
           "ToolCall", "ToolStats", "check_arguments", "count_statuses", "render_output", "run_call", "run_calls"]

STATUSES = ("ok", "truncated", "parse_error", "unknown_tool", "bad_arguments", "tool_error", "timeout")
DELIVERED = ("ok", "truncated")  # the tool ran and its output reached the model
# A well-formed call names a real tool with valid arguments; whether the tool then succeeded is another matter
# (a timeout or a raising tool is the tool's failure, not the model's formatting).
WELL_FORMED = ("ok", "truncated", "tool_error", "timeout")

MIN_MESSAGE_CHARS = 500  # an error message is cut at max(max_tool_output_chars, this), so it stays readable
ECHO_CHARS = 60  # what an error message quotes of the call itself: a name, a key, a value
# Arguments nested deeper are refused before anything walks them: no schema built from a signature comes
# close, and every later walk (the checks, the echo, the trajectory's JSON) stays far from the recursion limit.
MAX_ARGUMENT_DEPTH = 32
CANCEL_GRACE_S = 0.1  # how long a timed-out async tool may take to wind down before it is abandoned


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
    return [await run_call(env, episode, call, turn) for call in (calls or [])]


async def run_call(env, episode, call: dict, turn: int) -> ToolCall:
    """Execute one entry of `parse_tool_calls`' output against `env`'s tools.

    Only the caller's own cancellation (a driver being stopped) propagates; anything else, a bug here
    included, becomes the record's status and content.
    """
    start = time.perf_counter()
    limit = env.max_tool_output_chars  # read before the tool runs: what it does to `env` applies from the next call
    name, arguments = "", {}
    try:
        if not isinstance(call, dict) or "error" in call or not isinstance(call.get("name"), str):
            what = call.get("error", "not a tool call") if isinstance(call, dict) else "not a tool call"
            status, content = "parse_error", (
                f"Error: could not parse the tool call ({_text(what)}). Write each call as "
                '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call> with valid JSON.')
        else:
            name = encodable(call["name"])
            handle = env.tool_handle(name)
            if handle is None:
                name = _cut(name, ECHO_CHARS)  # the record and the tool message carry it
            given = call.get("arguments", {})
            given = {} if given is None else given
            try:
                arguments = _copy(given, record=True)
                passed = _copy(given, record=False)  # the tool's own copy: changing it leaves the record alone
            except _TooDeep:
                arguments, passed = _show(given, 200), _TooDeep
            status, content = await _run(env, episode, handle, name, passed)
    except Exception as exc:  # defence in depth: an execution bug (or a broken environment) must not end a rollout
        status, content = "tool_error", f"Error: the call could not be run ({_describe(exc)})"
    status, content = _limited(status, content, limit)
    return ToolCall(turn, name, arguments, status, content, seconds=time.perf_counter() - start)


async def _run(env, episode, handle: ToolHandle | None, name: str, arguments: Any) -> tuple[str, str]:
    """(status, content) of one well-parsed call; content not yet limited."""
    if handle is None:
        names = ", ".join(env.tool_names()) or "(none)"
        return "unknown_tool", f"Error: unknown tool {name!r}. Available tools: {names}."
    if arguments is _TooDeep:
        return "bad_arguments", (f"Error: bad arguments for {name!r}: arguments nested more than "
                                 f"{MAX_ARGUMENT_DEPTH} levels deep.")
    checked, problem = check_arguments(handle.parameters, arguments)
    if problem:
        return "bad_arguments", f"Error: bad arguments for {name!r}: {problem}."
    kwargs = dict(checked)
    if handle.wants_episode:
        kwargs["episode"] = episode
    kind, text = await (_await_async(handle, kwargs) if handle.is_async else _in_thread(handle, kwargs))
    if kind == "timeout":
        return "timeout", f"Error: tool {name!r} timed out after {handle.timeout:g} s."
    if kind == "raised":
        return "tool_error", f"Error: tool {name!r} failed with {text}"
    if kind == "unshowable":
        return "tool_error", f"Error: tool {name!r} returned output that cannot be shown ({text})"
    return "ok", text


def _limited(status: str, content: str, limit: int | None) -> tuple[str, str]:
    """(status, content) with the content cut to what the model may read, as text a tokenizer takes. A tool's
    output is held to `limit` (the status becomes "truncated"); an error message to `limit` too, but never below
    MIN_MESSAGE_CHARS so it stays readable. No limit (None) cuts nothing."""
    what = "output"
    if status != "ok":
        what = "message"
        limit = None if limit is None else max(limit, MIN_MESSAGE_CHARS)
    if limit is not None and len(content) > limit:
        content = content[:limit] + f"\n[{what} truncated: {len(content)} characters, showing the first {limit}]"
        status = "truncated" if status == "ok" else status
    return status, encodable(content)


# ---- running a tool ------------------------------------------------------------------------------------
# An outcome is ("output", text) | ("raised", what) | ("unshowable", what) | ("timeout", None): exceptions
# come back as values (the tool's TimeoutError is not our timeout, its SystemExit not the driver's), and the
# output is rendered where the tool ran, so a slow or raising __str__ is the tool's, within its timeout.

_TIMEOUT = ("timeout", None)
_ABANDONED: set[asyncio.Task] = set()  # timed-out async tools that ignore cancellation, kept from the collector


async def _await_async(handle: ToolHandle, kwargs: dict) -> tuple[str, Any]:
    # The tool runs in a task of its own: a CancelledError it raises (its own, or an awaited subtask's) stays
    # in that task, while a cancellation of the caller (the driver stopping) arrives at this `wait` and
    # propagates, taking the tool's task with it.
    task = asyncio.ensure_future(_captured(handle.fn, kwargs))
    try:
        done, _ = await asyncio.wait({task}, timeout=handle.timeout)
        if not done:
            task.cancel()
            # A tool that ignores cancellation would hold the turn forever: give it a short grace, then abandon.
            await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
            if not task.done():
                _ABANDONED.add(task)
                task.add_done_callback(_ABANDONED.discard)
            return _TIMEOUT
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.cancelled():  # it cancelled its own task and returned before the cancellation arrived
        return "raised", "CancelledError"
    return task.result()


async def _captured(fn: Callable, kwargs: dict) -> tuple[str, Any]:
    try:
        value = await fn(**kwargs)
    except BaseException as exc:  # a SystemExit or KeyboardInterrupt raised in a task escapes the event loop
        return "raised", _describe(exc)
    return _rendered(value)


async def _in_thread(handle: ToolHandle, kwargs: dict) -> tuple[str, Any]:
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
    try:
        done, _ = await asyncio.wait({future}, timeout=handle.timeout)
    finally:
        if not future.done():  # timed out, or the caller was cancelled: a late result is dropped
            future.cancel()
    return future.result() if done else _TIMEOUT


def _settle(future: asyncio.Future, outcome) -> None:
    if not future.done():
        future.set_result(outcome)


def _call_sync(fn: Callable, kwargs: dict) -> tuple[str, Any]:
    try:
        value = fn(**kwargs)
    except BaseException as exc:  # one left to end the thread would leave the call to time out
        return "raised", _describe(exc)
    return _rendered(value)


def _rendered(value: Any) -> tuple[str, Any]:
    try:
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()  # never run: closing it spares the "never awaited" warning
            return "unshowable", "an awaitable; declare the tool `async def` and await it"
        return "output", render_output(value)
    except BaseException as exc:  # the value's __str__ is the tool's code too
        return "unshowable", _describe(exc)


def _describe(exc: BaseException) -> str:
    """"Type: message", or the type alone when the message is empty or cannot be had."""
    kind = type(exc).__name__
    try:
        text = str(exc)
    except BaseException:  # an exception whose __str__ fails is still a failure to report
        text = ""
    return f"{kind}: {text}" if text else kind


def render_output(value: Any) -> str:
    """Text the model sees for a tool's return value: strings as-is, JSON for containers."""
    if isinstance(value, str):
        return str.__str__(value)  # a plain str: a subclass's own __len__ or slicing must not decide the limit
    if value is None:
        return ""
    if isinstance(value, (dict, list, tuple, int, float, bool)):
        return json.dumps(value, ensure_ascii=False, default=str)
    text = str(value)
    if not isinstance(text, str):
        raise TypeError(f"__str__ returned {type(text).__name__}")
    return str.__str__(text)


# ---- what is recorded and echoed -----------------------------------------------------------------------


class _TooDeep(Exception):
    """Arguments nested beyond MAX_ARGUMENT_DEPTH (or circular)."""


def _copy(value: Any, *, record: bool, depth: int = 1) -> Any:
    """A copy of decoded arguments with text a tokenizer and a UTF-8 file take, keys as strings. For the record
    (`record`), anything JSON cannot hold becomes a short description, so the trajectory always serialises;
    for the tool, such values stay as they are and the schema check reports them."""
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, (dict, list, tuple)):
        if depth > MAX_ARGUMENT_DEPTH:
            raise _TooDeep
        if isinstance(value, dict):
            return {_key(k): _copy(v, record=record, depth=depth + 1) for k, v in value.items()}
        return [_copy(v, record=record, depth=depth + 1) for v in value]
    if value is None or isinstance(value, (bool, int, float)) or not record:
        return value
    return _show(value, 200)


def _key(key: Any) -> str:
    return encodable(key) if isinstance(key, str) else _show(key)


def _text(value: Any) -> str:
    return encodable(value) if isinstance(value, str) else _show(value, 200)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        return {}, f"unexpected argument {_cut(str(unexpected[0]), ECHO_CHARS)!r} (expected: {expected})"
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
            converted, problem = check_value(v, schema["additionalProperties"], f"{path}.{_cut(str(k), ECHO_CHARS)}")
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


def _show(value: Any, limit: int = ECHO_CHARS) -> str:
    """A JSON-like preview of `value`, at most `limit` characters, built without serialising or walking more
    of it than that needs (a 1 MB string, a million-item list or a 10,000-deep nesting cost the same)."""
    parts: list[str] = []
    room = limit + 1  # one past the limit is enough to know it must be cut

    def put(text: str) -> None:
        nonlocal room
        parts.append(text[:room])
        room -= len(text)

    def walk(v: Any, depth: int) -> None:
        if isinstance(v, (dict, list, tuple)):
            opening, closing = ("{", "}") if isinstance(v, dict) else ("[", "]")
            if depth >= 8:
                put(opening + "..." + closing)
                return
            put(opening)
            items = v.items() if isinstance(v, dict) else ((None, x) for x in v)
            for i, (k, x) in enumerate(items):
                if room <= 0:
                    return
                put(", " if i else "")
                if isinstance(v, dict):
                    put(_scalar(k, room) + ": ")
                walk(x, depth + 1)
            put(closing)
        else:
            put(_scalar(v, room))

    try:
        walk(value, 0)
    except Exception:  # a foreign container whose iteration fails: what was shown so far is enough
        pass
    return _cut("".join(parts), limit)


def _scalar(value: Any, room: int) -> str:
    if isinstance(value, str):
        return json.dumps(value[: max(room, 0) + 1], ensure_ascii=False)
    try:
        if value is None or isinstance(value, (bool, int, float)):
            return json.dumps(value)
        return repr(value)[: max(room, 0) + 1]
    except BaseException:  # a huge integer JSON refuses, a foreign object's failing __repr__
        return f"<{type(value).__name__}>"
