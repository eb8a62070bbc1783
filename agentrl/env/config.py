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
    # A Python slice of the split's rows, "START:STOP" (either end may be left out or negative), taken before
    # data_limit: "0:-500" trains on all but the last 500 rows and "-500:" evaluates on exactly those.
    data_rows: str | None = None
    data_limit: int | None = None  # the first N rows (of data_rows when set); None: all

    def __post_init__(self):
        check_types(self, "env")
        require(bool(self.name), "env.name", "must not be empty")
        require(self.data_limit is None or self.data_limit >= 1, "env.data_limit", "must be >= 1 (or none for all)")
        require(self.data_rows is None or _parse_rows(self.data_rows) is not None, "env.data_rows",
                f"{self.data_rows!r} is not START:STOP (integers, either may be empty, e.g. 0:-500 or -500:)")

    def rows(self, dataset: list, limit: int | None = None) -> list:
        """The rows of `dataset` this run reads: `data_rows`, then the smaller of `data_limit` and `limit`."""
        if self.data_rows is not None:
            dataset = dataset[_parse_rows(self.data_rows)]
        limits = [n for n in (self.data_limit, limit) if n is not None]
        return dataset[:min(limits)] if limits else dataset

    def load_limit(self, limit: int | None = None) -> int | None:
        """What to pass as `limit` to `Environment.load_dataset`: the whole split when rows are sliced first."""
        limits = [n for n in (self.data_limit, limit) if n is not None]
        return None if self.data_rows is not None or not limits else min(limits)


def _parse_rows(text: str) -> slice | None:
    parts = str(text).split(":")
    if len(parts) != 2:
        return None
    try:
        start, stop = (int(p) if p.strip() else None for p in parts)
    except ValueError:
        return None
    return slice(start, stop)
