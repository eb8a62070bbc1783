"""Environments by name, wherever they are defined.

`load_environment(name, **kwargs)` understands four forms of `name`:

- a built-in name, `hotpotqa_search`: the module-level `load_environment(**kwargs)` of `environments.<name>`;
- `module:Class` or `module:function` (an importable module, e.g. `my_project.envs:MyEnv`);
- `path/to/file.py:Class` (or `:function`), loaded from the file;
- the name of an entry point that an installed package registers in the group `agentrl.environments`
  (`my_env = "my_package.envs:MyEnv"` under `[project.entry-points."agentrl.environments"]`).

A class is instantiated with the keyword arguments, a function called with them; either must give an
`Environment`. Every way a name can fail to resolve is one ValueError on one line.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import pkgutil
import re
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from agentrl.env.base import Environment

__all__ = ["ENTRY_POINT_GROUP", "EnvironmentListing", "ResolvedEnvironment", "available_environments",
           "environment_listings", "error_line", "load_environment", "resolve_environment", "run_name"]

ENTRY_POINT_GROUP = "agentrl.environments"
BUILTIN_PACKAGE = "environments"
_BUILTIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_FORMS = "an environment of your own is named module:Class or path/to/file.py:Class"


@dataclass(frozen=True)
class ResolvedEnvironment:
    """What a name points at: `factory(**kwargs)` builds the environment; `module` is where it is defined (what
    reads the accepted arguments looks at its Environment classes); `origin` says where it came from."""

    name: str
    factory: Callable[..., Any]
    module: types.ModuleType
    origin: str


@dataclass(frozen=True)
class EnvironmentListing:
    name: str
    origin: str  # "built-in", or "entry point <value> (<distribution>)"


def load_environment(name: str, **kwargs: Any) -> Environment:
    """The environment `name` names (see the module docstring), built with `kwargs`."""
    found = resolve_environment(name)
    env = found.factory(**kwargs)
    if not isinstance(env, Environment):
        raise TypeError(f"environment {name!r}: {_qualname(found.factory)} returned {type(env).__name__}, "
                        f"not an Environment")
    return env


def resolve_environment(name: str) -> ResolvedEnvironment:
    """Find what `name` names without building it; a ValueError (one line) when it names nothing usable."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("environment name is empty")
    if ":" in name:
        return _resolve_target(name, name, origin=None)
    if _BUILTIN_NAME.fullmatch(name):
        found = _resolve_builtin(name)
        if found is not None:
            return found
        entry = _entry_points().get(name)
        if entry is not None:
            return _resolve_target(name, entry.value, origin=_entry_point_origin(entry))
    raise ValueError(_unknown(name))


def available_environments() -> list[str]:
    """Every name `load_environment` accepts without a `:`: built-ins and installed entry points."""
    return sorted({listing.name for listing in environment_listings()})


def environment_listings() -> list[EnvironmentListing]:
    """Built-ins first, then entry points (a built-in's name taken by an entry point resolves to the built-in)."""
    builtins = _builtin_names()
    listed = [EnvironmentListing(name, "built-in") for name in builtins]
    for name, entry in sorted(_entry_points().items()):
        if name not in builtins:
            listed.append(EnvironmentListing(name, _entry_point_origin(entry)))
    return listed


def run_name(env_name: str) -> str:
    """A directory name for runs of `env_name`: a built-in or entry point name as it is, `module:Class` and
    `path/file.py:Class` by the class (or function) name, lowercased."""
    base = env_name.rpartition(":")[2].rpartition(".")[2].lower() if ":" in env_name else env_name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", base).strip("._") or "env"


# ---------------------------------------------------------------------------------------------- built-ins


def _builtin_names() -> list[str]:
    try:
        package = importlib.import_module(BUILTIN_PACKAGE)
    except ImportError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def _resolve_builtin(name: str) -> ResolvedEnvironment | None:
    module_name = f"{BUILTIN_PACKAGE}.{name.replace('-', '_')}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name in (module_name, BUILTIN_PACKAGE):
            return None  # not a built-in: maybe an entry point
        raise ValueError(f"environment {name!r} fails to import: {error_line(exc)}") from None
    except Exception as exc:  # whatever the module raises while it runs
        raise ValueError(f"environment {name!r} fails to import: {error_line(exc)}") from None
    factory = getattr(module, "load_environment", None)
    if not callable(factory):
        raise ValueError(f"environment {name!r}: {module_name} does not define a module-level "
                         f"load_environment(**kwargs)")
    return ResolvedEnvironment(name, factory, module, "built-in")


# ----------------------------------------------------------------------------- module:attr and file.py:attr


def _resolve_target(name: str, target: str, origin: str | None) -> ResolvedEnvironment:
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise ValueError(f"environment {name!r}: expected module:Class or path/to/file.py:Class")
    if _is_file(where):
        module = _import_file(name, where)
        origin = origin or f"file {where}"
    else:
        module = _import_module(name, where)
        origin = origin or f"module {where}"
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"environment {name!r}: {where} has no attribute {attr!r}{_candidates(module)}")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        if not issubclass(obj, Environment):
            raise ValueError(f"environment {name!r}: {attr} is a class but not an Environment subclass"
                             f"{_candidates(module)}")
    elif isinstance(obj, Environment):
        raise ValueError(f"environment {name!r}: {attr} is an Environment instance; name its class, or a "
                         f"function that builds one")
    elif not callable(obj):
        raise ValueError(f"environment {name!r}: {attr} is a {type(obj).__name__}, not an Environment class or "
                         f"a function that returns one{_candidates(module)}")
    return ResolvedEnvironment(name, obj, module, origin)


def _is_file(where: str) -> bool:
    # Module names hold neither separators nor a .py suffix, so these can only be paths.
    return where.endswith(".py") or "/" in where or "\\" in where


def _import_module(name: str, module_name: str) -> types.ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"environment {name!r}: no module named {module_name!r} (is it installed, or on "
                             f"PYTHONPATH? a file is named path/to/file.py:Class)") from None
        raise ValueError(f"environment {name!r}: module {module_name} fails to import: {error_line(exc)}") from None
    except Exception as exc:
        raise ValueError(f"environment {name!r}: module {module_name} fails to import: {error_line(exc)}") from None


def _import_file(name: str, where: str) -> types.ModuleType:
    path = Path(where).expanduser()
    if not path.exists():
        raise ValueError(f"environment {name!r}: no such file {where}")
    if not path.is_file():
        raise ValueError(f"environment {name!r}: {where} is not a file")
    path = path.resolve()
    # One module per file, under a name derived from its absolute path: loading the same file twice gives the
    # same classes, and two files of the same name stay apart.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    module_name = f"agentrl_env_file_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    # The file's folder goes on the path (last, shadowing nothing) so that it imports its sibling modules, as
    # `python file.py` would let it.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"environment {name!r}: {where} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before running it: dataclasses and type hints look the module up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"environment {name!r}: {where} fails to import: {error_line(exc)}") from None
    return module


def _candidates(module: types.ModuleType) -> str:
    """'; it defines A, B' naming what in `module` could be meant, or ''."""
    names = [n for n, v in vars(module).items()
             if isinstance(v, type) and issubclass(v, Environment) and v.__module__ == module.__name__]
    if callable(getattr(module, "load_environment", None)):
        names.append("load_environment")
    return f"; it defines {', '.join(names)}" if names else ""


# ------------------------------------------------------------------------------------------- entry points


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, entry)  # the first distribution to register a name keeps it
    return found


def _entry_point_origin(entry: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    package = f" ({dist.name})" if dist is not None and getattr(dist, "name", None) else ""
    return f"entry point {entry.value}{package}"


# ------------------------------------------------------------------------------------------------ messages


def _unknown(name: str) -> str:
    known = available_environments()
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown environment {name!r}; available: {', '.join(known) or '(none)'}{hint}; {_FORMS}"


def error_line(exc: BaseException) -> str:
    """`Type: message (file:line)` on one line, the place being where the exception was raised."""
    message = "; ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    # The innermost frame outside the import machinery: the line of the user's module that failed.
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    if frames and not isinstance(exc, SyntaxError):  # a SyntaxError's message already names file and line
        text += f" ({frames[-1].filename}:{frames[-1].lineno})"
    return text


def _qualname(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__
