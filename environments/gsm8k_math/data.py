"""Loading GSM8K-style problems: the built-in generated set, a local json/jsonl file, or the hub.

Every source comes out as `{"id", "question", "answer"}` with `answer` in GSM8K's format (worked solution
ending in `#### n`), the shape `is_correct` expects for its gold side.
"""

from __future__ import annotations

import json
from pathlib import Path

from environments.gsm8k_math.problems import generate_problems

__all__ = ["load_problems", "normalize_record", "HUB_ID"]

HUB_ID = "openai/gsm8k"
# GSM8K has no development split: every held-out name means its test split.
_HELD_OUT = ("dev", "validation", "test")


def load_problems(split: str = "train", path: str | None = None, seed: int = 0) -> list[dict]:
    """All problems of a split, in file order (the caller applies any limit).

    `path=None` gives the generated set for `seed`; `path="hub"` downloads GSM8K ("main" config); any other
    path is a json/jsonl file, or a folder holding `<split>.jsonl` (or `.json`).
    """
    if path is None:
        return generate_problems(seed=seed, split=split)
    if str(path) == "hub":
        import datasets

        rows = datasets.load_dataset(HUB_ID, "main", split="test" if split in _HELD_OUT else split)
        return [normalize_record(r, i, prefix=split) for i, r in enumerate(rows)]
    file = _resolve(Path(path), split)
    return [normalize_record(r, i, prefix=file.stem) for i, r in enumerate(_read_records(file))]


def normalize_record(record: dict, index: int = 0, prefix: str = "gsm8k") -> dict:
    """One raw record in the environment's shape; GSM8K has no ids, so the position names it."""
    return {"id": str(record.get("id") or f"{prefix}-{index}"), "question": record["question"],
            "answer": str(record["answer"])}


def _resolve(path: Path, split: str) -> Path:
    if path.is_file():
        return path
    if path.is_dir():
        names = [split] + ([s for s in _HELD_OUT if s != split] if split in _HELD_OUT else [])
        for name in names:
            for suffix in (".jsonl", ".json"):
                if (path / f"{name}{suffix}").is_file():
                    return path / f"{name}{suffix}"
        raise FileNotFoundError(f"no {split}.jsonl or {split}.json in {path}")
    raise FileNotFoundError(f"no such data file or folder: {path}")


def _read_records(path: Path) -> list[dict]:
    # Plain reading keeps file order exactly and avoids the datasets cache for small local files.
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".json":
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, list) else data.get("data", [])
    import datasets  # other formats (parquet, csv) go through HF datasets

    return list(datasets.load_dataset(path.suffix.lstrip("."), data_files=str(path), split="train"))
