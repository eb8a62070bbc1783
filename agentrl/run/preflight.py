"""A run's inputs checked before anything heavy loads: the environment with its arguments, and its data.

`agentrl train` and `agentrl eval` call `check_inputs(cfg)` right after parsing the config and before importing
torch, so a wrong environment name, argument or data file fails in a fraction of a second with one line naming the
key, file and line, instead of a traceback after the model has loaded. Everything here imports no torch (the tests
check it in a fresh interpreter).

The environment and data are loaded the way the run loads them (`agentrl.run.build.load_env_and_data`): the same
calls with the same arguments, so what passes here loads there. Loading twice stays cheap because environments
share what is slow to build (hotpotqa_search's search index) between instances over the same data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import io
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

from agentrl.config import ConfigError, coerce

__all__ = ["Inputs", "check_inputs", "check_model", "check_environment", "check_dataset", "environment_arguments",
           "one_line", "parse_one_line", "locate_in_config"]


@dataclasses.dataclass
class Inputs:
    env: Any  # the Environment, built from cfg.env
    dataset: list[dict] | None  # the samples the run will read; None where not fetched here (env.data: hub)
    split: str


def check_inputs(cfg) -> Inputs:
    """Check `cfg`'s model name (local paths only), then load its environment (with `cfg.env.args`) and its data:
    split train for a TrainConfig, `cfg.split` (and `cfg.limit`) for an EvalConfig. Every problem is a one-line
    ConfigError; `cfg` is left as it is."""
    split = getattr(cfg, "split", "train")
    check_model(cfg.model)
    env = check_environment(cfg.env)
    dataset = check_dataset(env, cfg.env, split, getattr(cfg, "limit", None))
    note_tools_without_a_turn(cfg, env)
    return Inputs(env, dataset, split)


def note_tools_without_a_turn(cfg, env) -> None:
    """One line on stderr when rollouts get one turn while the environment offers tools: a rollout that calls one
    ends at the call, before its result comes back, and scores as one that never answered. Allowed (a recipe may
    mean it), but said, since the prompt still offers the tools."""
    rollout = getattr(cfg, "rollout", None)
    tools = [t.get("function", {}).get("name", "?") for t in env.tools()] if rollout is not None else []
    if tools and rollout.max_turns == 1:
        print(f"agentrl: rollout.max_turns=1 while the environment offers {', '.join(tools)}: a rollout that calls a "
              "tool ends at the call, before its result (raise max_turns, or stop offering the tool through its "
              "env.args)", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- model

def check_model(model_cfg) -> None:
    """A local model path that gives no model (missing, a directory without one or with several .gguf files, a file
    that is no GGUF) is a one-line ConfigError; a hub id passes here and is looked up when the model loads."""
    from agentrl.models import ModelNotFound, check_model_name

    try:
        check_model_name(model_cfg.name)
    except ModelNotFound as exc:
        raise ConfigError(f"model.name: {one_line(exc)}") from None


# ------------------------------------------------------------------------------------------- environment

# Arguments the run sets itself: load_env_and_data always passes the split, so one given here would do nothing.
_SET_BY_THE_RUN = {"split": "the run reads split train in training and --split in eval"}


def check_environment(env_cfg):
    """The environment `env_cfg` names (a built-in, an entry point, module:Class or path/file.py:Class), built
    with its arguments; unknown names and arguments, values of the wrong type and values the environment refuses
    are one-line ConfigErrors."""
    from agentrl.env import Environment
    from agentrl.env.loading import resolve_environment

    try:
        found = resolve_environment(env_cfg.name)
    except ValueError as exc:
        raise ConfigError(f"env.name: {one_line(exc)}") from None
    accepted = environment_arguments(found.module, found.factory)
    for key, value in env_cfg.args.items():
        where = f"env.args.{key}"
        if key in _SET_BY_THE_RUN:
            raise ConfigError(f"{where}: has no effect ({_SET_BY_THE_RUN[key]})")
        if accepted is None:
            continue  # the factory passes **kwargs to something this cannot see: the call below decides
        if key not in accepted:
            names = [n for n in accepted if n not in _SET_BY_THE_RUN]
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{where}: {env_cfg.name} has no argument {key!r}{hint} "
                              f"(its arguments: {', '.join(sorted(names))})")
        hint_type = accepted[key]
        if hint_type is not None and _coercible(hint_type):
            _check_type(value, hint_type, where)
    try:
        env = found.factory(**env_cfg.args)
    except (TypeError, ValueError, LookupError, AttributeError) as exc:
        raise ConfigError(f"env.args: {env_cfg.name}: {one_line(exc)}") from None
    if not isinstance(env, Environment):
        raise ConfigError(f"env.name: {env_cfg.name} gives a {type(env).__name__}, not an Environment")
    return env


def environment_arguments(module: types.ModuleType, factory: Callable) -> dict[str, Any] | None:
    """Every keyword the environment accepts, with its type hint (None where it has none). A class takes its
    constructor's parameters and, where that passes **kwargs on to `Environment.__init__`, the class-level settings
    a keyword may override. A function takes its own parameters and, where it passes **kwargs on, what the
    Environment classes of its module take; None when its module defines none (it passes them to something this
    cannot see)."""
    from agentrl.env import Environment

    if isinstance(factory, type):
        return _class_arguments(factory)
    accepted = _parameters(factory)
    if not _takes_any_keyword(factory):
        return accepted
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, Environment) and c.__module__ == module.__name__]
    if not classes:
        return None
    for cls in classes:
        for name, hint in _class_arguments(cls).items():
            accepted.setdefault(name, hint)
    return accepted


def _class_arguments(cls: type) -> dict[str, Any]:
    accepted = _parameters(cls.__init__)
    if not _takes_any_keyword(cls.__init__):
        return accepted
    hints = _hints(cls)
    for name in dir(cls):  # what Environment.__init__ accepts as a keyword: public, non-callable class attributes
        static = inspect.getattr_static(cls, name)
        if name.startswith("_") or callable(getattr(cls, name)) or isinstance(static, (property, classmethod,
                                                                                      staticmethod)):
            continue
        accepted.setdefault(name, hints.get(name))
    return accepted


def _takes_any_keyword(fn: Callable) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _parameters(fn: Callable) -> dict[str, Any]:
    hints = _hints(fn)
    return {p.name: hints.get(p.name) for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}


def _hints(obj) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # an annotation that does not resolve: check no types rather than fail the run
        return {}


def _check_type(value: Any, tp: Any, where: str) -> None:
    """`value` must already be of type `tp` (an int where a float is declared is fine): the environment receives
    it as given, so a 2.0 where an int is declared would fail in the middle of a rollout, not here."""
    checked = coerce(value, tp, where)
    if type(checked) is not type(value) and not (type(checked) is float and type(value) is int):
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp) or str(tp).replace("typing.", "")


def _coercible(tp: Any) -> bool:
    """Whether `agentrl.config.coerce` understands `tp` (anything else is left to the environment)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return all(a is type(None) or _coercible(a) for a in args)
    if origin is Literal:
        return True
    if origin is dict:
        return True
    if origin is tuple:
        return all(a is Ellipsis or _coercible(a) for a in args)
    return tp in (bool, int, float, str)


# ------------------------------------------------------------------------------------------------ data


def check_dataset(env, env_cfg, split: str, limit: int | None) -> list[dict] | None:
    """`env.load_dataset(...)` as the run calls it, its failures as one-line ConfigErrors; then every sample must
    be a dict the environment can build a prompt from. Hub data is not fetched here (the run fetches it once)."""
    from agentrl.data import DataError, DataFileNotFound

    if env_cfg.data is not None and not str(env_cfg.data).strip():
        raise ConfigError("env.data: empty path (leave it unset for the built-in data)")
    if env_cfg.data == "hub":
        return None
    source = env_cfg.data or f"{env_cfg.name}'s built-in data"
    try:
        dataset = env.load_dataset(split=split, path=env_cfg.data, limit=env_cfg.load_limit(limit))
    except DataFileNotFound as exc:
        raise ConfigError(f"env.data: {exc}") from None
    except DataError:
        raise  # already one line naming the file and line
    except (ValueError, TypeError, LookupError, OSError) as exc:
        raise ConfigError(f"env.data: {source}, split {split!r}: {one_line(exc)}") from None
    if not isinstance(dataset, (list, tuple)) or not dataset:
        raise ConfigError(f"env.data: {source}, split {split!r}: no samples to roll out")
    dataset = env_cfg.rows(list(dataset), limit)
    if not dataset:
        raise ConfigError(f"env.data_rows: {env_cfg.data_rows!r} leaves none of the {source} split {split!r}'s rows")
    for i, sample in enumerate(dataset):
        if not isinstance(sample, dict):
            raise ConfigError(f"env.data: {source}, split {split!r}: sample {i} is not a dict")
        try:
            env.prompt(sample)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"env.data: {source}, split {split!r}: sample {i} gives no prompt "
                              f"({type(exc).__name__}: {one_line(exc)})") from None
    return list(dataset)


# ------------------------------------------------------------------------------------- the command line


def one_line(exc: BaseException | str) -> str:
    """An error message on one line (a message may carry newlines from a library)."""
    text = exc if isinstance(exc, str) else (str(exc) or type(exc).__name__)
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def parse_one_line(parse: Callable, argv: list[str], prog: str):
    """`parse(argv)` with argparse's errors as one line on stderr (argparse prints its usage first); the exit code
    stays argparse's 2. Anything else the parse prints to stderr (a renamed key's warning) is passed through."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            lines = [line for line in captured.getvalue().splitlines() if line.strip()]
            message = lines[-1].split(": error: ", 1)[-1] if lines else "bad arguments"
            captured = io.StringIO()
            print(f"{prog}: {message} (--help lists the options)", file=sys.stderr)
        raise
    finally:
        sys.stderr.write(captured.getvalue())


def locate_in_config(message: str, argv: list[str], flags: dict[str, str]) -> str:
    """`message` prefixed with `file:line` of the key it names in the `--config` YAML, where the value came from
    there (a key set on the command line is left as is: its value did not come from the file)."""
    from agentrl.run.config import DEPRECATED

    config = _flag_value(argv, "--config")
    key = _named_key(message)
    if config is None or key is None or not Path(config).is_file():
        return message
    given = {f"--{key}"} | {f"--{flag.replace('_', '-')}" for flag, k in flags.items() if k == key}
    if any(item.split("=", 1)[0] in given for item in argv):
        return message
    candidates = [key]
    for old, change in DEPRECATED.items():  # the YAML may still use the key's old name
        new = getattr(change, "new", None)
        if new and (key == new or key.startswith(new + ".")):
            candidates.append(old + key[len(new):])
    for candidate in candidates:
        line = _yaml_line(Path(config), candidate.split("."))
        if line is not None:
            return f"{config}:{line}: {message}"
    return message


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, item in enumerate(argv):
        if item == flag and i + 1 < len(argv):
            return argv[i + 1]
        if item.startswith(flag + "="):
            return item.split("=", 1)[1]
    return None


_KEY = re.compile(r"^(?:unknown key '([^']+)'|([A-Za-z_][\w]*(?:\.[\w-]+)*): )")


def _named_key(message: str) -> str | None:
    match = _KEY.match(message)
    return (match.group(1) or match.group(2)) if match else None


def _yaml_line(path: Path, keys: list[str]) -> int | None:
    """The 1-based line of the dotted key `keys` in a YAML file, or None."""
    import yaml

    try:
        node = yaml.compose(path.read_text())
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            return None
        for key_node, value_node in node.value:
            if getattr(key_node, "value", None) == key:
                line, node = key_node.start_mark.line + 1, value_node
                break
        else:
            return None
    return line
