"""Reading local dataset files, shared by every environment: a json/jsonl file, or a folder of split files.

Every row comes back as a `Row` that knows where it was read (`path:line`), so an environment's loader can name
the line of any row it rejects. What this module decides, for every environment:

- errors (`DataError`, one line naming the file and line): a missing file or folder, a format it cannot read, a
  line that is not JSON, a row that is not a JSON object (an array, null, a number), an empty file, a `.json`
  object without its rows under `"data"`, a required key that is missing or holds a value of another type.
  These say the file is not in the format the loader reads (or is damaged); dropping such rows would hide that.
- counted skips (`Skips`, reported once in one line): a row whose question or answer is null or blank, or that
  an environment finds unusable as a task (its own loader says which). Such a row has the right layout but
  carries no task; the rest of the file is good. A file whose every row is skipped is an error.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError

HELD_OUT_SPLITS = ("dev", "validation", "test")  # one name stands in for another when a folder has only one
ROWS_KEY = "data"  # where a `.json` object file keeps its rows: {"data": [...]}
TABULAR = (".csv", ".parquet")  # read through HF datasets


class DataError(ConfigError):
    """A data file that cannot be used as written; the message is one line naming the file and line."""


class DataFileNotFound(DataError, FileNotFoundError):
    """A data path (file, or folder holding a split's file) that does not exist."""


@dataclass(frozen=True)
class Row:
    value: Any  # the parsed JSON value: a dict in a well-formed file
    source: Path
    line: int  # the line it starts on; for tabular files the row number (a csv's header is row 1)
    unit: str = "line"

    @property
    def at(self) -> str:
        """`line 7` (or `row 7`): the row's place in its file."""
        return f"{self.unit} {self.line}"

    @property
    def where(self) -> str:
        """`path:7` for json and jsonl (the compiler convention), `path row 7` for tabular files."""
        return f"{self.source}:{self.line}" if self.unit == "line" else f"{self.source} row {self.line}"


def resolve_split_file(path: str | Path, split: str) -> Path:
    """`path` itself if it is a file, else `<path>/<split>.jsonl` (or `.json`, or a held-out alias of it)."""
    if not str(path).strip():
        raise DataError("the data path is empty")
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        names = [split] + ([s for s in HELD_OUT_SPLITS if s != split] if split in HELD_OUT_SPLITS else [])
        for name in names:
            for suffix in (".jsonl", ".json"):
                if (path / f"{name}{suffix}").is_file():
                    return path / f"{name}{suffix}"
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".jsonl", ".json"))
        there = f"; it holds {', '.join(found)}" if found else "; it holds no .jsonl or .json file"
        raise DataFileNotFound(f"{path}: no {split}.jsonl or {split}.json in this folder{there}")
    if path.exists():
        raise DataError(f"{path}: not a regular file or folder")
    raise DataFileNotFound(f"{path}: no such data file or folder")


def read_rows(path: Path) -> list[Row]:
    """Every row of a data file, in file order, each with its location. Errors as in the module docstring."""
    path = Path(path)
    try:
        if path.suffix == ".jsonl":
            rows = _jsonl_rows(path)
        elif path.suffix == ".json":
            rows = _json_rows(path)
        elif path.suffix in TABULAR:
            rows = _tabular_rows(path)
        else:
            raise DataError(f"{path}: unsupported data format {path.suffix or '(no suffix)'!r}; "
                            f"expected .jsonl, .json, {', '.join(TABULAR)}")
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not rows:
        empty = "the file is empty" if path.stat().st_size == 0 else "not one row in it"
        raise DataError(f"{path}: no rows ({empty})")
    for row in rows:
        if not isinstance(row.value, dict):
            rows_in_one_line = (path.suffix == ".jsonl" and isinstance(row.value, list) and row.value
                                and all(isinstance(v, dict) for v in row.value))
            hint = " (a JSON array of rows belongs in a .json file)" if rows_in_one_line else ""
            raise DataError(f"{row.where}: expected a JSON object (one row), got {describe(row.value)}{hint}")
    return rows


def _jsonl_rows(path: Path) -> list[Row]:
    # Plain reading keeps file order exactly and needs neither the datasets cache nor pyarrow (absent on some
    # GPU hosts) for the small local files the environments read.
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                rows.append(Row(json.loads(line), path, number))
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    return rows


def _json_rows(path: Path) -> list[Row]:
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = " (one object per line is JSON Lines: name the file .jsonl)" if exc.msg == "Extra data" else ""
        raise DataError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno}){hint}") from None
    if isinstance(data, list):
        return [Row(v, path, line) for v, line in zip(data, _array_item_lines(text, text.index("[")))]
    if isinstance(data, dict):
        if ROWS_KEY not in data:
            keys = ", ".join(repr(k) for k in list(data)[:8]) or "none"
            raise DataError(f"{path}:1: a JSON object file keeps its rows in a list under {ROWS_KEY!r}; "
                            f"its keys are {keys}")
        rows = data[ROWS_KEY]
        if not isinstance(rows, list):
            raise DataError(f"{path}: {ROWS_KEY!r} must be a list of rows, got {describe(rows)}")
        return [Row(v, path, line) for v, line in zip(rows, _array_item_lines(text, _value_start(text)))]
    raise DataError(f"{path}:1: expected a JSON array of rows (or an object with {ROWS_KEY!r}), "
                    f"got {describe(data)}")


def _array_item_lines(text: str, start: int) -> list[int]:
    """Line numbers of the items of the JSON array opening at `text[start]` (text already known valid)."""
    decoder, lines, i = json.JSONDecoder(), [], start + 1
    while True:
        i = _skip_space(text, i)
        if text[i] == "]":
            return lines
        lines.append(text.count("\n", 0, i) + 1)
        _, i = decoder.raw_decode(text, i)
        i = _skip_space(text, i)
        if text[i] == ",":
            i += 1


def _value_start(text: str) -> int:
    """Where the value of the top-level object's ROWS_KEY starts (text already known valid)."""
    decoder, i = json.JSONDecoder(), _skip_space(text, 0) + 1
    while True:
        key, i = decoder.raw_decode(text, _skip_space(text, i))
        i = _skip_space(text, _skip_space(text, i) + 1)  # past the colon
        if key == ROWS_KEY:
            return i
        _, i = decoder.raw_decode(text, i)
        i = _skip_space(text, i) + 1  # past the comma


def _skip_space(text: str, i: int) -> int:
    while text[i] in " \t\r\n":
        i += 1
    return i


def _tabular_rows(path: Path) -> list[Row]:
    import datasets  # parquet and csv go through HF datasets

    first = 2 if path.suffix == ".csv" else 1  # a csv's first line is its header
    table = datasets.load_dataset(path.suffix.lstrip("."), data_files=str(path), split="train")
    return [Row(dict(r), path, i + first, "row") for i, r in enumerate(table)]


# ------------------------------------------------------------------------------------------------- fields


def text_field(row: Row, key: str, *, number_ok: bool = False) -> str | None:
    """`row.value[key]` as a string, or None when it is null or blank (a row without a task: skip it).

    A missing key is an error; so is a value of another type, except a number where `number_ok` (a JSON answer
    of 72 is the text "72", written exactly: 1e20 reads "100000000000000000000", never "1e+20").
    """
    record = row.value
    if key not in record:
        keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        raise DataError(f"{row.where}: the row has no {key!r} (its keys: {keys})")
    value = record[key]
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        return value
    if number_ok and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return str(value) if isinstance(value, int) else format(Decimal(repr(value)), "f")
    raise DataError(f"{row.where}: {key!r} must be a string{' or a number' if number_ok else ''}, "
                    f"got {describe(value)}")


def describe(value: Any) -> str:
    """A JSON value's kind, with a short excerpt: `a string 'abc'`, `an array of 3 items`, `null`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {json.dumps(value)}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"a string {value[:40]!r}{'...' if len(value) > 40 else ''}"
    if isinstance(value, (list, tuple)):
        return f"an array of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return f"an object with keys {', '.join(repr(k) for k in list(value)[:5])}" if value else "an empty object"
    return type(value).__name__


# ------------------------------------------------------------------------------------------------- skips

_REPORTED: set[str] = set()  # skip reports already printed in this process: the run reloads what preflight read


class Skips:
    """Rows of one source left out, by reason; `report` prints one line, once per process and source."""

    def __init__(self, source: str):
        self.source = source
        self.where: dict[str, list[str]] = {}  # reason ("a blank answer") -> places ("line 7"), in file order

    def add(self, reason: str, at: str) -> None:
        self.where.setdefault(reason, []).append(at)

    def __len__(self) -> int:
        return sum(len(w) for w in self.where.values())

    def summary(self, total: int) -> str:
        parts = [f"{len(w)} with {reason} (first at {w[0]})" for reason, w in self.where.items()]
        return f"{self.source}: skipped {len(self)} of {total} rows: {'; '.join(parts)}"

    def report(self, total: int) -> None:
        """Print the summary (stderr) if anything was skipped; an error if nothing is left."""
        if not self.where:
            return
        text = self.summary(total)
        if len(self) == total:
            raise DataError(f"{text}; no usable row is left")
        if text not in _REPORTED:
            _REPORTED.add(text)
            print(f"agentrl: {text}", file=sys.stderr, flush=True)
