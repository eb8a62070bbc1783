"""Reading local dataset files, shared by every environment: a json/jsonl file, or a folder of split files."""

from __future__ import annotations

import json
from pathlib import Path

HELD_OUT_SPLITS = ("dev", "validation", "test")  # one name stands in for another when a folder has only one


def resolve_split_file(path: str | Path, split: str) -> Path:
    """`path` itself if it is a file, else `<path>/<split>.jsonl` (or `.json`, or a held-out alias of it)."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        names = [split] + ([s for s in HELD_OUT_SPLITS if s != split] if split in HELD_OUT_SPLITS else [])
        for name in names:
            for suffix in (".jsonl", ".json"):
                if (path / f"{name}{suffix}").is_file():
                    return path / f"{name}{suffix}"
        raise FileNotFoundError(f"no {split}.jsonl or {split}.json in {path}")
    raise FileNotFoundError(f"no such data file or folder: {path}")


def read_records(path: Path) -> list[dict]:
    # Plain reading keeps file order exactly and needs neither the datasets cache nor pyarrow (absent on some
    # GPU hosts) for the small local files the environments read.
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".json":
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, list) else data.get("data", [])
    import datasets  # other formats (parquet, csv) go through HF datasets

    return list(datasets.load_dataset(path.suffix.lstrip("."), data_files=str(path), split="train"))
