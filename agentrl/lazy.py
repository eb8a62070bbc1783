"""Lazy package exports: a name resolves to its submodule's attribute on first use, so importing a package's
torch-free config module (a run's config reads several) never pulls in the rest of the package."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package` serving `name -> submodule` from `exports`."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
