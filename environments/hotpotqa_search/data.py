"""Loading HotpotQA-style samples: the built-in generated set, a local json/jsonl file, or the hub.

Every source comes out in one shape, `{"id", "question", "answer", "type", "context",
"supporting_facts"}` with `context = [[title, [sentence, ...]], ...]`, so the environment never needs to
know where its samples came from.
"""

from __future__ import annotations

import json
from pathlib import Path

from environments.hotpotqa_search.corpus import generate_samples

__all__ = ["load_samples", "normalize_record", "HUB_ID"]

HUB_ID = "hotpotqa/hotpot_qa"
_HELD_OUT = ("dev", "validation", "test")


def load_samples(split: str = "train", path: str | None = None, seed: int = 0) -> list[dict]:
    """All samples of a split, in file order (the caller applies any limit).

    `path=None` gives the generated set for `seed`; `path="hub"` downloads HotpotQA's distractor setting;
    any other path is a json/jsonl file, or a folder holding `<split>.jsonl` (or `.json`).
    """
    if path is None:
        return generate_samples(seed=seed, split="dev" if split in _HELD_OUT else split)
    if str(path) == "hub":
        return _load_hub(split)
    return [normalize_record(r, i) for i, r in enumerate(_read_records(_resolve(Path(path), split)))]


def normalize_record(record: dict, index: int = 0) -> dict:
    """One raw HotpotQA record (file or hub layout) in the environment's sample shape."""
    context = record.get("context") or []
    if isinstance(context, dict):  # the hub stores columns: {"title": [...], "sentences": [[...], ...]}
        context = [[t, list(s)] for t, s in zip(context["title"], context["sentences"])]
    facts = record.get("supporting_facts") or []
    if isinstance(facts, dict):
        facts = [[t, i] for t, i in zip(facts["title"], facts["sent_id"])]
    return {
        "id": str(record.get("id") or record.get("_id") or f"sample-{index}"),
        "question": record["question"],
        "answer": record.get("answer", ""),
        "type": record.get("type", ""),
        "context": [[title, list(sentences)] for title, sentences in context],
        "supporting_facts": [list(f) for f in facts],
    }


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


def _load_hub(split: str) -> list[dict]:
    import datasets

    hub_split = "validation" if split in _HELD_OUT else split
    rows = datasets.load_dataset(HUB_ID, "distractor", split=hub_split)
    return [normalize_record(r, i) for i, r in enumerate(rows)]
