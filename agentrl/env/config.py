"""The environment's knobs: the `env:` section of a run's config (which environment, its arguments, its data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrl.config import check_types, require


@dataclass
class EnvConfig:
    name: str = "gsm8k_math"  # a built-in name, module:Class, path/to/file.py:Class, or an entry point's name
    # Keyword arguments of the environment's load_environment, e.g. {few_shot: 2, format_bonus: 0.0};
    # on the command line --env.args.few_shot=2.
    args: dict[str, Any] = field(default_factory=dict)
    data: str | None = None  # a local json/jsonl path, "hub", or None for the environment's built-in data
    data_limit: int | None = None  # the first N rows; None: all

    def __post_init__(self):
        check_types(self, "env")
        require(bool(self.name), "env.name", "must not be empty")
        require(self.data_limit is None or self.data_limit >= 1, "env.data_limit", "must be >= 1 (or none for all)")
