"""Local data files row by row: where each row was read, what is an error and what a counted skip, the ids and
limits of what is kept, and the search index shared by environments over the same file."""

from __future__ import annotations

import json
import os

import pytest

import agentrl.data
from agentrl import load_environment
from agentrl.config import ConfigError
from agentrl.data import DataError, DataFileNotFound, read_rows, resolve_split_file
from environments.gsm8k_math.data import load_problems
from environments.gsm8k_math.data import normalize_record as gsm8k_record
from environments.hotpotqa_search.data import load_samples
from environments.hotpotqa_search.data import normalize_record as hotpot_record

GSM = {"question": "Ann has 2 apples and buys 3. How many now?", "answer": "#### 5"}
HOT = {"_id": "h1", "question": "Which river?", "answer": "Tessa", "context": [["Lorin", ["On the Tessa."]]]}


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch):
    monkeypatch.setattr(agentrl.data, "_REPORTED", set())


def write_jsonl(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_rows_know_their_lines_in_every_layout(tmp_path):
    rows = write_jsonl(tmp_path / "a.jsonl", GSM, "", "  ", GSM)
    assert [r.where for r in read_rows(rows)] == [f"{rows}:1", f"{rows}:4"]
    pretty = tmp_path / "b.json"
    pretty.write_text(json.dumps([GSM, {"x": [1, "]", {"y": ","}]}, GSM], indent=2))
    assert [r.line for r in read_rows(pretty)] == [2, 6, 15]
    assert [pretty.read_text().splitlines()[n - 1].strip() for n in (2, 6, 15)] == ["{", "{", "{"]
    wrapped = tmp_path / "c.json"
    wrapped.write_text('{"meta": {"data": [0]}, "note": "[x]",\n "data": [\n  {"a": 1},\n\n  {"a": "b, ]"}\n ]}')
    assert [(r.value, r.line) for r in read_rows(wrapped)] == [({"a": 1}, 3), ({"a": "b, ]"}, 5)]


def test_a_byte_order_mark_is_not_part_of_the_data(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GSM).encode() + b"\n")
    assert read_rows(path)[0].value == GSM
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([GSM]).encode())
    assert read_rows(tmp_path / "bom.json")[0].value == GSM


def test_missing_data_is_both_a_config_error_and_file_not_found(tmp_path):
    with pytest.raises(DataFileNotFound) as caught:
        resolve_split_file(tmp_path / "nope.jsonl", "train")
    assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, ConfigError)
    (tmp_path / "test.jsonl").write_text("")
    assert resolve_split_file(tmp_path, "dev") == tmp_path / "test.jsonl"  # a held-out name stands for another
    with pytest.raises(DataFileNotFound, match="it holds test.jsonl"):
        resolve_split_file(tmp_path, "train")


def test_gsm8k_skips_rows_without_a_task_counts_them_once_and_keeps_ids(tmp_path, capsys):
    path = write_jsonl(tmp_path / "train.jsonl", GSM, {**GSM, "answer": None}, {**GSM, "question": ""},
                       {**GSM, "answer": "None"}, {**GSM, "answer": 72}, {**GSM, "answer": 1e20})
    problems = load_problems("train", str(path))
    assert [p["id"] for p in problems] == ["train-0", "train-4", "train-5"]
    assert [p["answer"] for p in problems] == ["#### 5", "72", "100000000000000000000"]
    err = capsys.readouterr().err.splitlines()
    assert err == [f"agentrl: {path}: skipped 3 of 6 rows: 1 with a null or blank answer (first at line 2); "
                   f"1 with a null or blank question (first at line 3); 1 with an answer that ends in no number "
                   f"(first at line 4)"]
    env = load_environment("gsm8k_math", path=str(path))
    assert env.load_dataset(limit=2) == problems[:2]  # the limit counts kept rows
    assert capsys.readouterr().err == ""  # reported once per process


def test_hotpot_skips_blank_rows_and_accepts_numbers_and_rows_without_context(tmp_path, capsys):
    path = write_jsonl(tmp_path / "dev.jsonl", HOT, {**HOT, "_id": "h2", "answer": 1885, "context": None},
                       {**HOT, "_id": "h3", "answer": "  "}, {"_id": "h4", "question": "Q?", "answer": "no"})
    samples = load_samples("dev", str(path))
    assert [(s["id"], s["answer"], s["context"]) for s in samples] == [
        ("h1", "Tessa", [["Lorin", ["On the Tessa."]]]), ("h2", "1885", []), ("h4", "no", [])]
    assert "skipped 1 of 4 rows: 1 with a null or blank answer (first at line 3)" in capsys.readouterr().err
    # a question without its own context searches the split's paragraphs
    env = load_environment("hotpotqa_search", path=str(path), split="dev")
    sample = env.load_dataset()[2]
    assert "[1] Lorin" in env.index_for(sample).search("Tessa", 3)


@pytest.mark.parametrize("record, message", [
    ({"question": "Q", "answer": None}, "null or blank answer"),
    ({"question": "Q"}, "no 'answer'"),
    ({"question": "Q", "answer": "A", "context": "text"}, "'context' must be a list"),
    ({"question": "Q", "answer": "A", "context": {"title": ["T"], "sentences": []}}, "one length"),
    ({"question": "Q", "answer": "A", "supporting_facts": [["T", "0"]]}, "supporting_facts[0]"),
    ({"question": "Q", "answer": "A", "type": 3}, "'type' must be a string"),
])
def test_hotpot_records_outside_files_fail_the_same_way(record, message):
    with pytest.raises(DataError, match=message.replace("[", r"\[")):
        hotpot_record(record, 3, "hub validation")


def test_hub_layout_still_reads():
    record = {"id": "x", "question": "Q?", "answer": "A", "type": "bridge",
              "context": {"title": ["T1", "T2"], "sentences": [["a", "b"], ["c"]]},
              "supporting_facts": {"title": ["T1"], "sent_id": [1]}}
    assert hotpot_record(record) == {"id": "x", "question": "Q?", "answer": "A", "type": "bridge",
                                     "context": [["T1", ["a", "b"]], ["T2", ["c"]]], "supporting_facts": [["T1", 1]]}
    assert gsm8k_record({"question": "Q", "answer": "#### 3"}, 4, "test") == {"id": "test-4", "question": "Q",
                                                                             "answer": "#### 3"}
    with pytest.raises(DataError, match="test row 4: an answer that ends in no number"):
        gsm8k_record({"question": "Q", "answer": "three"}, 4, "test")


def test_one_search_index_per_file_version(tmp_path):
    path = write_jsonl(tmp_path / "dev.jsonl", HOT)
    first = load_environment("hotpotqa_search", path=str(path), split="dev")
    second = load_environment("hotpotqa_search", path=str(path), split="dev")
    a, b = first.load_dataset()[0], second.load_dataset()[0]
    assert first.index_for(a) is second.index_for(b)  # built once for both
    write_jsonl(path, {**HOT, "context": [["Lorin", ["On the Tessa."]], ["Tessa", ["A river."]]]})
    os.utime(path, ns=(1, 1))  # a changed file: another size and mtime
    third = load_environment("hotpotqa_search", path=str(path), split="dev")
    index = third.index_for(third.load_dataset()[0])
    assert index is not first.index_for(a) and index.titles == ["Lorin", "Tessa"]
    other = load_environment("hotpotqa_search", path=str(path), split="dev", max_paragraph_chars=20)
    assert other.index_for(other.load_dataset()[0]) is not index


def test_real_files_load_whole(shared_data, capsys):
    assert len(load_problems("train", str(shared_data / "gsm8k"))) == 7473
    assert len(load_samples("train", str(shared_data / "hotpotqa"))) == 320
    assert len(load_samples("dev", str(shared_data / "hotpotqa"))) == 738
    assert capsys.readouterr().err == ""  # nothing skipped
