"""Loading HotpotQA-style samples: the built-in generated set, a local json/jsonl file, or the hub.

Every source comes out in one shape, `{"id", "question", "answer", "type", "context",
"supporting_facts"}` with `context = [[title, [sentence, ...]], ...]`, so the environment never needs to
know where its samples came from.

What a local file may hold, row by row (the general rules are in `agentrl.data`):
- error, naming the file and line: a line that is not JSON, a row that is not an object, a missing `question` or
  `answer` key, a question that is not a string or an answer that is neither a string nor a number, a `context`
  that is not a list of `[title, [sentence, ...]]` pairs (a string there used to be split into letters, each
  letter a paragraph), `supporting_facts` that are not `[title, sentence_index]` pairs, an empty file, and a
  file none of whose rows has any context (the search tool would have nothing to search).
- counted skip, reported in one line: a null or blank question or answer (a row without a task).
- kept as is: a row without `context` (or with null): its questions search the paragraphs of the split's other
  rows, as in HotpotQA's open-domain setting.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from agentrl.data import (HELD_OUT_SPLITS, DataError, Row, Skips, describe, read_rows, resolve_split_file,
                          text_field)

from environments.hotpotqa_search.corpus import generate_samples
from environments.hotpotqa_search.search import SearchIndex, paragraphs_from_samples

__all__ = ["load_samples", "normalize_record", "split_index", "HUB_ID"]

HUB_ID = "hotpotqa/hotpot_qa"

SKIP_BLANK_QUESTION = "a null or blank question"
SKIP_BLANK_ANSWER = "a null or blank answer"


def load_samples(split: str = "train", path: str | None = None, seed: int = 0) -> list[dict]:
    """All usable samples of a split, in file order (the caller applies any limit).

    `path=None` gives the generated set for `seed`; `path="hub"` downloads HotpotQA's distractor setting;
    any other path is a json/jsonl file, or a folder holding `<split>.jsonl` (or `.json`).
    """
    if path is None:
        return generate_samples(seed=seed, split="dev" if split in HELD_OUT_SPLITS else split)
    if str(path) == "hub":
        return _load_hub(split)
    file = resolve_split_file(path, split)
    rows = read_rows(file)
    skips = Skips(str(file))
    samples = []
    for i, row in enumerate(rows):
        sample = _sample(row, i, skips)
        if sample is not None:
            samples.append(sample)
    skips.report(len(rows))
    if not any(s["context"] for s in samples):
        raise DataError(f"{file}: no row has a 'context' (a list of [title, [sentence, ...]] pairs): "
                        f"the search tool would have nothing to search")
    return samples


def normalize_record(record: dict, index: int = 0, source: str = "record") -> dict:
    """One raw HotpotQA record (file or hub layout) in the environment's sample shape. A record the file loader
    would skip is an error here: there is no file to count it in."""
    row = Row(record, source, index, "row")
    skips = Skips(source)
    sample = _sample(row, index, skips)
    if sample is None:
        raise DataError(f"{row.where}: {next(iter(skips.where))}")
    return sample


def _sample(row: Row, index: int, skips: Skips) -> dict | None:
    record = row.value
    question = text_field(row, "question")
    answer = text_field(row, "answer", number_ok=True)
    context = _context(record.get("context"), row)
    facts = _supporting_facts(record.get("supporting_facts"), row)
    kind = record.get("type")
    if kind is not None and not isinstance(kind, str):
        raise DataError(f"{row.where}: 'type' must be a string, got {describe(kind)}")
    if question is None:
        skips.add(SKIP_BLANK_QUESTION, row.at)
        return None
    if answer is None:
        skips.add(SKIP_BLANK_ANSWER, row.at)
        return None
    return {
        "id": str(record.get("id") or record.get("_id") or f"sample-{index}"),
        "question": question,
        "answer": answer,
        "type": kind or "",
        "context": context,
        "supporting_facts": facts,
    }


def _context(context, row: Row) -> list[list]:
    """`[[title, [sentence, ...]], ...]` from the file layout or the hub's columns; anything else is an error."""
    if context is None:
        return []
    if isinstance(context, dict):  # the hub stores columns: {"title": [...], "sentences": [[...], ...]}
        titles, sentences = context.get("title"), context.get("sentences")
        if not isinstance(titles, list) or not isinstance(sentences, list) or len(titles) != len(sentences):
            raise DataError(f"{row.where}: 'context' as columns needs lists 'title' and 'sentences' of one length")
        context = [[t, s] for t, s in zip(titles, sentences)]
    if not isinstance(context, list):
        raise DataError(f"{row.where}: 'context' must be a list of [title, [sentence, ...]] pairs, "
                        f"got {describe(context)}")
    paragraphs = []
    for i, paragraph in enumerate(context):
        if not isinstance(paragraph, (list, tuple)) or len(paragraph) != 2:
            raise DataError(f"{row.where}: context[{i}] must be a [title, [sentence, ...]] pair, "
                            f"got {describe(paragraph)}")
        title, sentences = paragraph
        if not isinstance(title, str):
            raise DataError(f"{row.where}: context[{i}]'s title must be a string, got {describe(title)}")
        if not isinstance(sentences, (list, tuple)):
            raise DataError(f"{row.where}: context[{i}] ({title!r}) must hold a list of sentence strings, "
                            f"got {describe(sentences)}")
        for j, sentence in enumerate(sentences):
            if not isinstance(sentence, str):
                raise DataError(f"{row.where}: context[{i}] ({title!r}) sentence {j} must be a string, "
                                f"got {describe(sentence)}")
        paragraphs.append([title, list(sentences)])
    return paragraphs


def _supporting_facts(facts, row: Row) -> list[list]:
    if facts is None:
        return []
    if isinstance(facts, dict):  # hub columns: {"title": [...], "sent_id": [...]}
        titles, ids = facts.get("title"), facts.get("sent_id")
        if not isinstance(titles, list) or not isinstance(ids, list) or len(titles) != len(ids):
            raise DataError(f"{row.where}: 'supporting_facts' as columns needs lists 'title' and 'sent_id' "
                            f"of one length")
        facts = [[t, i] for t, i in zip(titles, ids)]
    if not isinstance(facts, list):
        raise DataError(f"{row.where}: 'supporting_facts' must be a list of [title, sentence_index] pairs, "
                        f"got {describe(facts)}")
    for i, fact in enumerate(facts):
        if (not isinstance(fact, (list, tuple)) or len(fact) != 2 or not isinstance(fact[0], str)
                or not isinstance(fact[1], int) or isinstance(fact[1], bool)):
            raise DataError(f"{row.where}: supporting_facts[{i}] must be a [title, sentence_index] pair, "
                            f"got {describe(fact)}")
    return [list(f) for f in facts]


def _load_hub(split: str) -> list[dict]:
    import datasets

    hub_split = "validation" if split in HELD_OUT_SPLITS else split
    rows = datasets.load_dataset(HUB_ID, "distractor", split=hub_split)
    return [normalize_record(r, i, f"{HUB_ID} {hub_split}") for i, r in enumerate(rows)]


# ------------------------------------------------------------------------------------------------ indexes

# The search index of a split, shared by every environment in the process that loads the same data: the command
# line checks its inputs with an environment of its own before the run builds the one it trains with, and a large
# split's index takes long to build.
_INDEXES: OrderedDict[tuple, SearchIndex] = OrderedDict()
_KEEP_INDEXES = 4


def split_index(samples: list[dict], split: str, path: str | None, seed: int,
                max_paragraph_chars: int) -> SearchIndex:
    """The index over `samples` (all of a split, as `load_samples` gave them), built once per data version."""
    key = (_data_version(split, path), seed, max_paragraph_chars)
    index = _INDEXES.get(key)
    if index is None:
        index = SearchIndex(paragraphs_from_samples(samples), max_paragraph_chars)
        _INDEXES[key] = index
        while len(_INDEXES) > _KEEP_INDEXES:
            _INDEXES.popitem(last=False)
    _INDEXES.move_to_end(key)
    return index


def _data_version(split: str, path: str | None) -> tuple:
    """What a split's content depends on: the generated set's split, or the file with its size and mtime."""
    if path is None:
        return ("generated", "dev" if split in HELD_OUT_SPLITS else split)
    if str(path) == "hub":
        return ("hub", split)
    file = Path(resolve_split_file(path, split)).resolve()
    stat = file.stat()
    return ("file", str(file), stat.st_size, stat.st_mtime_ns)
