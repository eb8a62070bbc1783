"""Tool schemas from Python signatures and Google-style docstrings.

The schema is the only description of a tool the model ever sees, so it is built from what the author already
wrote (type hints, docstring) rather than a second hand-maintained copy that could drift from the code.
Unsupported hints raise at schema time: a tool the model cannot call correctly should fail when the
environment is defined, not mid-rollout.
"""

from __future__ import annotations

import collections.abc as _abc
import inspect
import re
import types
import typing
from typing import Annotated, Any, Literal, Union

_PRIMITIVES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object",
               list: "array", tuple: "array", set: "array", frozenset: "array", type(None): "null"}
# typing.List[int] and list[int] both report `list`; Sequence[int] reports collections.abc.Sequence
_ARRAY_ORIGINS = (list, tuple, set, frozenset, _abc.Sequence, _abc.Iterable, _abc.Set)

_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Returns?|Yields?|Raises|Examples?|"
    r"Notes?|Attributes|See Also|Warnings?|Todo|References)\s*:\s*$"
)
_ARG_SECTIONS = {"Args", "Arguments", "Parameters", "Params", "Keyword Args", "Keyword Arguments"}
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def function_schema(fn, *, name: str | None = None, description: str | None = None,
                    skip: tuple[str, ...] = ("self", "cls", "episode")) -> dict:
    """The OpenAI-style `{"type": "function", "function": {...}}` schema of `fn`.

    Parameters named in `skip` are hidden: they are supplied by the framework (the bound instance, the
    per-rollout episode), never by the model. A parameter is required exactly when it has no default.
    """
    sig = inspect.signature(fn)
    try:
        hints = _type_hints(fn, skip)
    except Exception as e:  # an unresolvable forward reference is a definition bug worth naming
        raise TypeError(f"tool {name or fn.__name__!r}: cannot resolve type hints: {e}") from e
    summary, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, dict] = {}
    required: list[str] = []
    for pname, param in sig.parameters.items():
        if pname in skip:
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name or fn.__name__!r}: *args/**kwargs cannot be described to a model")
        hint = hints.get(pname, Any)
        try:
            prop, note = _hint_schema(hint)
        except TypeError as e:
            raise TypeError(f"tool {name or fn.__name__!r}, parameter {pname!r}: {e}") from None
        text = arg_docs.get(pname) or note
        if text:
            prop = {**prop, "description": text}
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        elif _is_json_scalar(param.default):
            prop = {**prop, "default": param.default}
        properties[pname] = prop
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": description if description is not None else summary,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _type_hints(fn, skip: tuple[str, ...]) -> dict:
    # Resolve only what the model sees: the return type and framework-supplied parameters (e.g. an
    # `episode: Episode` imported under TYPE_CHECKING) may be names that do not exist at runtime.
    shown = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if k not in skip and k != "return"}
    globalns = getattr(inspect.unwrap(fn), "__globals__", {})
    return typing.get_type_hints(types.SimpleNamespace(__annotations__=shown), globalns=globalns, include_extras=True)


def type_schema(hint) -> dict:
    """JSON schema of one type hint (no description)."""
    return _hint_schema(hint)[0]


def _hint_schema(hint) -> tuple[dict, str | None]:
    # Returns (schema, description from Annotated metadata) so `Annotated[str, "what it is"]` documents itself.
    if typing.get_origin(hint) is Annotated:
        base, *meta = typing.get_args(hint)
        note = next((m for m in meta if isinstance(m, str)), None)
        return _hint_schema(base)[0], note
    if hint is Any or hint is inspect.Parameter.empty:
        return {}, None
    if hint in _PRIMITIVES:
        return {"type": _PRIMITIVES[hint]}, None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        kinds = []
        for v in args:
            kind = json_type(v)
            if kind not in _SCALARS:
                raise TypeError(f"Literal value {v!r} is not a JSON scalar")
            if kind not in kinds:
                kinds.append(kind)
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}, None
    if origin is Union or origin is types.UnionType:
        members = [_hint_schema(a)[0] for a in args]
        simple = [m for m in members if set(m) == {"type"} and isinstance(m["type"], str)]
        if len(simple) == len(members):  # Optional[int] → {"type": ["integer", "null"]}, the compact form
            return {"type": [m["type"] for m in members]}, None
        null = {"type": "null"}
        if null in members and len(members) == 2:  # Optional[Literal[...]] / Optional[list[...]]
            (inner,) = [m for m in members if m != null]
            return _nullable(inner), None
        return {"anyOf": members}, None
    if origin in _ARRAY_ORIGINS:
        items = [a for a in args if a is not Ellipsis]
        if origin is tuple and len(items) > 1 and len(set(map(repr, items))) > 1:
            raise TypeError("heterogeneous tuples are not supported; use list[...]")
        return ({"type": "array", "items": _hint_schema(items[0])[0]} if items else {"type": "array"}), None
    if origin is dict or origin is _abc.Mapping:
        if len(args) == 2 and args[1] is not Any:
            return {"type": "object", "additionalProperties": _hint_schema(args[1])[0]}, None
        return {"type": "object"}, None
    raise TypeError(f"unsupported type hint {hint!r} (use str, int, float, bool, list, dict, Optional, Literal)")


def _nullable(schema: dict) -> dict:
    out = dict(schema)
    kind = out.get("type")
    if isinstance(kind, str):
        out["type"] = [kind, "null"]
    elif isinstance(kind, list) and "null" not in kind:
        out["type"] = kind + ["null"]
    elif kind is None:
        return {"anyOf": [schema, {"type": "null"}]}
    if "enum" in out and None not in out["enum"]:
        out["enum"] = out["enum"] + [None]
    return out


def json_type(value) -> str | None:
    """The JSON type name of a decoded JSON value (bool before int: True is an int in Python); None otherwise."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return None


_SCALARS = ("null", "boolean", "integer", "number", "string")


def _is_json_scalar(value) -> bool:
    return value is not None and json_type(value) in _SCALARS


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring.

    The description is the prose before the first section; each paragraph is folded onto one line because
    hard wraps in source code are noise to the model.
    """
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    prose: list[str] = []
    args: dict[str, list[str]] = {}
    section = None
    arg_indent = None
    current = None
    for line in lines:
        header = _SECTION.match(line)
        if header and not line.startswith((" ", "\t")):
            section, arg_indent, current = header.group(1), None, None
            continue
        if section is None:
            prose.append(line.strip())
            continue
        if section not in _ARG_SECTIONS or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if arg_indent is None:
            arg_indent = indent
        entry = _ARG_LINE.match(line.strip()) if indent <= arg_indent else None
        if entry:
            current = entry.group(1)
            args[current] = [entry.group(2).strip()] if entry.group(2).strip() else []
        elif current is not None:
            args[current].append(line.strip())
    paragraphs = [" ".join(p.split()) for p in "\n".join(prose).split("\n\n")]
    description = "\n\n".join(p for p in paragraphs if p)
    return description, {k: " ".join(v) for k, v in args.items()}
