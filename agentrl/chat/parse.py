"""Reading tool calls out of a sampled assistant turn (Hermes/Qwen `<tool_call>` convention).

Sampled text is anything a policy can produce, so parsing never raises: each block becomes either a call or
an error entry whose message is shown back to the model. Leniency is limited to forms whose intent is
unambiguous (code fences, a trailing comma, `parameters` for `arguments`, arguments encoded as a JSON
string, a call wrapped in a one-element JSON list); anything else is reported, because a silently "fixed"
call teaches the policy nothing.
"""

from __future__ import annotations

import json
import re

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_CLOSE = "</think>"

_FENCE = re.compile(r"^```[\w-]*\s*\n?(.*?)\n?\s*```$", re.DOTALL)
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")


def parse_tool_calls(text: str) -> list[dict]:
    """One entry per `<tool_call>` block: `{"name", "arguments"}` or `{"error", "raw"}`.

    A block ends at its `</tool_call>`, at the next `<tool_call>` (an unclosed block) or at the end of the
    text (a final block cut off by the token limit or a stop sequence). Stray closing tags are ignored, and
    so is anything before the last `</think>`: calls drafted while reasoning are not calls.
    """
    if not isinstance(text, str):
        return []
    if THINK_CLOSE in text:
        text = text[text.rindex(THINK_CLOSE) + len(THINK_CLOSE):]
    out = []
    for raw in _blocks(text):
        try:
            out.append(parse_call(raw))
        except Exception as e:  # defence in depth: a parser bug must not end a rollout
            out.append({"error": f"unreadable tool call ({type(e).__name__})", "raw": raw.strip()})
    return out


def _blocks(text: str) -> list[str]:
    blocks = []
    pos = text.find(OPEN)
    while pos != -1:
        start = pos + len(OPEN)
        close = text.find(CLOSE, start)
        reopen = text.find(OPEN, start)
        if close == -1 and reopen == -1:
            blocks.append(text[start:])
            break
        if reopen != -1 and (close == -1 or reopen < close):
            blocks.append(text[start:reopen])
            pos = reopen
        else:
            blocks.append(text[start:close])
            pos = text.find(OPEN, close + len(CLOSE))
    return blocks


def parse_call(raw: str) -> dict:
    """Parse the inside of one block (see `parse_tool_calls`)."""
    body = raw.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    if not body:
        return _error("empty tool call", raw)
    value, problem = _loads(body)
    if problem:
        return _error(f"invalid JSON: {problem}", raw)
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        # SmolLM2's function-calling data writes `<tool_call>[{"name": ..., "arguments": ...}]</tool_call>`,
        # and a model prompted in that convention answers in it. A single wrapped call means the same as the
        # bare object; an empty or longer list does not map onto one block, so it is reported (and a list of
        # anything but objects is no call at all: the plain "got array" below).
        if not value:
            return _error("an empty list is not a tool call", raw)
        if len(value) > 1:
            return _error(f"a list of {len(value)} tool calls; write one <tool_call> block per call", raw)
        (value,) = value
    if not isinstance(value, dict):
        return _error(f"a tool call must be a JSON object, got {_kind(value)}", raw)
    if "name" not in value:
        return _error('missing "name"', raw)
    name = value["name"]
    if not isinstance(name, str):
        return _error(f'"name" must be a string, got {_kind(name)}', raw)
    if not name.strip():
        return _error('"name" is empty', raw)
    if "arguments" in value and "parameters" in value:
        return _error('both "arguments" and "parameters" given; use "arguments"', raw)
    args = value.get("arguments", value.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):
        # Some models (and the OpenAI wire format) encode arguments as a JSON string; decode it once.
        if not args.strip():
            args = {}
        else:
            args, problem = _loads(args)
            if problem:
                return _error(f'"arguments" is a string that is not valid JSON: {problem}', raw)
    if not isinstance(args, dict):
        return _error(f'"arguments" must be a JSON object, got {_kind(args)}', raw)
    return {"name": name.strip(), "arguments": args}


def _loads(body: str):
    try:
        return json.loads(body), None
    except json.JSONDecodeError as e:
        first = e
    except RecursionError:
        return None, "nested too deeply"
    repaired = _TRAILING_COMMA.sub(r"\1", body)
    if repaired != body:
        try:
            return json.loads(repaired), None
        except (json.JSONDecodeError, RecursionError):
            pass
    return None, f"{first.msg} (line {first.lineno}, column {first.colno})"


def _error(message: str, raw: str) -> dict:
    return {"error": message, "raw": raw.strip()}


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
