"""Loading GSM8K-style problems: the built-in generated set, a local json/jsonl file, or the hub.

Every source comes out as `{"id", "question", "answer"}` with `answer` in GSM8K's format (worked solution
ending in `#### n`, or a bare number), the shape `is_correct` expects for its gold side.

What a local file may hold, row by row (the general rules are in `agentrl.data`):
- error, naming the file and line: a line that is not JSON, a row that is not an object, a missing `question` or
  `answer` key, a question that is not a string, an answer that is neither a string nor a number, an empty file.
  The file is then in another format than this loader reads; reading on would train on something else.
- counted skip, reported in one line: a null or blank question or answer (a row without a task), and an answer
  without a final number to compare against (it could never be judged correct, so every rollout on it would earn
  0 whatever the model wrote). Skipped rows keep their place in the ids (`train-7` is always line 8's row).
"""

from __future__ import annotations

from agentrl.data import HELD_OUT_SPLITS, DataError, Row, Skips, read_rows, resolve_split_file, text_field

from environments.gsm8k_math.answer import gold_number
from environments.gsm8k_math.problems import generate_problems

__all__ = ["load_problems", "normalize_record", "HUB_ID"]

HUB_ID = "openai/gsm8k"
# GSM8K has no development split: every held-out name means its test split.

SKIP_BLANK_QUESTION = "a null or blank question"
SKIP_BLANK_ANSWER = "a null or blank answer"
SKIP_NO_NUMBER = "an answer that ends in no number"


def load_problems(split: str = "train", path: str | None = None, seed: int = 0) -> list[dict]:
    """All usable problems of a split, in file order (the caller applies any limit).

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
    rows = read_rows(file)
    skips = Skips(str(file))
    problems = []
    for i, row in enumerate(rows):
        problem = _problem(row, i, file.stem, skips)
        if problem is not None:
            problems.append(problem)
    skips.report(len(rows))
    return problems


def normalize_record(record: dict, index: int = 0, prefix: str = "gsm8k") -> dict:
    """One raw record (a hub row, or a dict in the file layout) in the environment's shape; GSM8K has no ids,
    so the position names it. A record the file loader would skip is an error here: there is no file to count in."""
    row = Row(record, prefix, index, "row")
    skips = Skips(prefix)
    problem = _problem(row, index, prefix, skips)
    if problem is None:
        raise DataError(f"{row.where}: {next(iter(skips.where))}")
    return problem


def _problem(row: Row, index: int, prefix: str, skips: Skips) -> dict | None:
    question = text_field(row, "question")
    answer = text_field(row, "answer", number_ok=True)
    if question is None:
        skips.add(SKIP_BLANK_QUESTION, row.at)
    elif answer is None:
        skips.add(SKIP_BLANK_ANSWER, row.at)
    elif gold_number(answer) is None:
        skips.add(SKIP_NO_NUMBER, row.at)
    else:
        return {"id": str(row.value.get("id") or f"{prefix}-{index}"), "question": question, "answer": answer}
    return None
