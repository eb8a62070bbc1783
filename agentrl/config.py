"""Config machinery shared by every component: typed dataclass sections, YAML, `--section.key=value` overrides.

Each component owns its config dataclass (`EnvConfig`, `RolloutConfig`, `EngineConfig`, `LossConfig`, ...) and
checks its own fields in `__post_init__` with `check_types` and `require`; a run's config is a dataclass whose
fields *are* those sections (`agentrl.run.config`). Every value is coerced to its type hint and range-checked
where it is constructed, so a bad value fails with the key's name before any model loads.

Imports nothing heavy (no torch): `agentrl train --config bad.yaml` fails in milliseconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def check_types(obj, section: str) -> None:
    """Coerce every field of `obj` to its hinted type in place (YAML and the command line hand in strings)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        tp = hints[f.name]
        where = f"{section}.{f.name}" if section else f.name
        if dataclasses.is_dataclass(tp):
            if not isinstance(getattr(obj, f.name), tp):
                raise ConfigError(f"{where}: expected a {tp.__name__}")
            continue
        setattr(obj, f.name, coerce(getattr(obj, f.name), tp, where))


# ------------------------------------------------------------------------------------------------- building


@dataclasses.dataclass(frozen=True)
class Renamed:
    """An old key that still works for one release: its value moves to `new` with a warning."""

    new: str


@dataclasses.dataclass(frozen=True)
class Removed:
    """An old key that no longer does anything: naming it is an error that says why."""

    reason: str


def load(cls, data: dict | None = None, overrides: typing.Sequence[str] = (), *, path: str | Path | None = None,
         deprecated: dict[str, Renamed | Removed] | None = None, base: dict | None = None):
    """Build `cls` from `base` (defaults of a situation), a YAML file (`path`), a mapping (`data`) and `--key=value`
    overrides, each over the one before."""
    merged: dict = _merge({}, base or {})
    if path is not None:
        merged = _merge(merged, read_yaml(path))
    merged = _merge(merged, data or {})
    for item in overrides:
        keys, value = parse_override(item)
        _set_path(merged, keys, value)
    for old, change in (deprecated or {}).items():
        _apply_deprecation(merged, old, change)
    return build(cls, merged, "")


def read_yaml(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--config {path}: no such file")
    if path.is_dir():
        raise ConfigError(f"--config {path}: is a directory, not a YAML file")

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            # YAML keeps the last of two equal keys without a word; in a config that hides which value is used.
            first: dict[str, int] = {}
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    line = key_node.start_mark.line + 1
                    if key_node.value in first:
                        raise ConfigError(f"{path}:{line}: {key_node.value} is set twice in one section (first on "
                                          f"line {first[key_node.value]})")
                    first[key_node.value] = line
            return super().construct_mapping(node, deep)

    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot be read ({exc.strerror or exc})") from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return data


def build(cls, data: Any, prefix: str):
    """`cls(**data)`, recursing into dataclass-typed fields; an unknown key fails with its full name."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"unknown key {where!r}{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            # A section given in part keeps its owner's other defaults: the run's, where it sets its own
            # (eval's rollout is greedy, one per question), else the section class's.
            default = _field_default(cls, key)
            if isinstance(value, dict) and dataclasses.is_dataclass(default):
                value = _merge(_init_fields(default), value)
            kwargs[key] = build(tp, value, f"{where}.")
        else:
            kwargs[key] = coerce(value, tp, where)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field left out
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {exc}") from None


def _field_default(cls, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _init_fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


def to_yaml(config) -> str:
    import yaml

    return yaml.safe_dump(_plain(dataclasses.asdict(config)), sort_keys=False)


def parse_override(item: str) -> tuple[list[str], str]:
    if not item.startswith("--") or "=" not in item:
        raise ConfigError(f"override {item!r} must look like --key=value or --section.key=value")
    key, value = item[2:].split("=", 1)
    if not key:
        raise ConfigError(f"override {item!r} has no key")
    return key.split("."), value


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]  # plain YAML lists rather than python tuple tags
    return value


def _apply_deprecation(data: dict, old: str, change: Renamed | Removed) -> None:
    *parents, leaf = old.split(".")
    node = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return
    if leaf not in node:
        return
    if isinstance(change, Removed):
        raise ConfigError(f"{old}: removed; {change.reason}")
    value = node.pop(leaf)
    print(f"agentrl: config key {old} is now {change.new}; the old name works until the next release",
          file=sys.stderr)
    _set_path(data, change.new.split("."), value, replace=False, old=old)


def _set_path(data: dict, path: list[str], value: Any, replace: bool = True, old: str | None = None):
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{'.'.join(path)}: {part} is a value, not a section")
    if not replace and path[-1] in node:
        raise ConfigError(f"{old} and {'.'.join(path)} are the same setting; keep only {'.'.join(path)}")
    node[path[-1]] = value


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out.get(k, {}) if isinstance(out.get(k), dict) else {}, v) if isinstance(v, dict) else v
    return out


# ------------------------------------------------------------------------------------------------- values


def parse_value(value: Any, where: str) -> Any:
    """A free-form value (environment arguments): YAML's reading of a command-line string, so `2` is an int."""
    if isinstance(value, str):
        import yaml

        try:
            value = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:
            pass  # not YAML: keep the string as written
    if not isinstance(value, (str, int, float, bool, type(None), list)):
        raise ConfigError(f"{where}: expected a number, string, boolean or list, got {value!r}")
    return value


_TRUE, _FALSE, _NONE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}, {"none", "null", "~"}


def coerce(value: Any, tp: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in _NONE)):
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arm, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): parse_value(v, f"{where}.{k}") for k, v in value.items()}
    if origin is tuple:
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        arms = [args[0]] * len(items) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(arms) != len(items):
            raise ConfigError(f"{where}: expected {len(arms)} values, got {len(items)}")
        return tuple(coerce(v, a, where) for v, a in zip(items, arms))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML reads 1e-6 (no dot) as a string
            except ValueError:
                pass
        if number is None or not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported type {tp}")
