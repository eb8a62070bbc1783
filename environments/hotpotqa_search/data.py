"""Loading HotpotQA-style samples: the built-in generated set, a local json/jsonl file, or the hub.

Every source comes out in one shape, `{"id", "question", "answer", "type", "context",
"supporting_facts"}` with `context = [[title, [sentence, ...]], ...]`, so the environment never needs to
know where its samples came from.
"""

from __future__ import annotations


from agentrl.data import HELD_OUT_SPLITS, read_records, resolve_split_file

from environments.hotpotqa_search.corpus import generate_samples

__all__ = ["load_samples", "normalize_record", "HUB_ID"]

HUB_ID = "hotpotqa/hotpot_qa"


def load_samples(split: str = "train", path: str | None = None, seed: int = 0) -> list[dict]:
    """All samples of a split, in file order (the caller applies any limit).

    `path=None` gives the generated set for `seed`; `path="hub"` downloads HotpotQA's distractor setting;
    any other path is a json/jsonl file, or a folder holding `<split>.jsonl` (or `.json`).
    """
    if path is None:
        return generate_samples(seed=seed, split="dev" if split in HELD_OUT_SPLITS else split)
    if str(path) == "hub":
        return _load_hub(split)
    return [normalize_record(r, i) for i, r in enumerate(read_records(resolve_split_file(path, split)))]


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


def _load_hub(split: str) -> list[dict]:
    import datasets

    hub_split = "validation" if split in HELD_OUT_SPLITS else split
    rows = datasets.load_dataset(HUB_ID, "distractor", split=hub_split)
    return [normalize_record(r, i) for i, r in enumerate(rows)]
