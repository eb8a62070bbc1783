"""Loading GSM8K-style problems: the built-in generated set, a local json/jsonl file, or the hub.

Every source comes out as `{"id", "question", "answer"}` with `answer` in GSM8K's format (worked solution
ending in `#### n`), the shape `is_correct` expects for its gold side.
"""

from __future__ import annotations


from agentrl.data import HELD_OUT_SPLITS, read_records, resolve_split_file

from environments.gsm8k_math.problems import generate_problems

__all__ = ["load_problems", "normalize_record", "HUB_ID"]

HUB_ID = "openai/gsm8k"
# GSM8K has no development split: every held-out name means its test split.


def load_problems(split: str = "train", path: str | None = None, seed: int = 0) -> list[dict]:
    """All problems of a split, in file order (the caller applies any limit).

    `path=None` gives the generated set for `seed`; `path="hub"` downloads GSM8K ("main" config); any other
    path is a json/jsonl file, or a folder holding `<split>.jsonl` (or `.json`).
    """
    if path is None:
        return generate_problems(seed=seed, split=split)
    if str(path) == "hub":
        import datasets

        rows = datasets.load_dataset(HUB_ID, "main", split="test" if split in HELD_OUT_SPLITS else split)
        return [normalize_record(r, i, prefix=split) for i, r in enumerate(rows)]
    file = resolve_split_file(path, split)
    return [normalize_record(r, i, prefix=file.stem) for i, r in enumerate(read_records(file))]


def normalize_record(record: dict, index: int = 0, prefix: str = "gsm8k") -> dict:
    """One raw record in the environment's shape; GSM8K has no ids, so the position names it."""
    return {"id": str(record.get("id") or f"{prefix}-{index}"), "question": record["question"],
            "answer": str(record["answer"])}


