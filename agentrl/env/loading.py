"""Environments by name: `load_environment("hotpotqa_search", **kwargs)` imports `environments.<name>`."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from agentrl.env.base import Environment

__all__ = ["available_environments", "load_environment"]


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
