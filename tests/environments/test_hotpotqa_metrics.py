"""HotpotQA answer metrics: official normalisation, exact F1/EM values, answer extraction."""

import json

import pytest

from environments.hotpotqa_search import answer_em, answer_f1, extract_answer, normalize_answer
from environments.hotpotqa_search.metrics import has_answer_tag


@pytest.mark.parametrize("text, expected", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  A   cat, an apple ", "cat apple"),
    ("U.S.A.", "usa"),
    ("Theatre of the Absurd", "theatre of absurd"),  # only whole-word articles go
    ("Anne and Andy", "anne and andy"),
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize("prediction, gold, f1", [
    ("Russian Empire", "the Russian Empire", 1.0),
    ("the cat sat", "cat", 2 / 3),  # precision 1/2, recall 1
    ("Barack Obama", "Obama", 2 / 3),
    ("paris paris", "paris", 2 / 3),  # repeated tokens count once per gold occurrence
    ("new york city", "york new", 0.8),  # bag of words: order is ignored; P 2/3, R 1
    ("London", "Paris", 0.0),
    ("", "Paris", 0.0),
    ("yes", "Yes.", 1.0),
    ("no", "yes", 0.0),
    ("yes it is", "yes", 0.0),  # a yes/no gold is all-or-nothing
    ("yes", "yes sir", 0.0),  # ... and so is a yes/no prediction
    ("noanswer", "no answer", 0.0),
    ("1,234 km", "1234 km", 1.0),  # punctuation inside numbers is dropped too
])
def test_answer_f1_known_values(prediction, gold, f1):
    assert answer_f1(prediction, gold) == pytest.approx(f1, abs=1e-12)


@pytest.mark.parametrize("prediction, gold, em", [
    ("The Beatles", "beatles", 1.0),
    ("Beatles.", "the  Beatles", 1.0),
    ("The Beatles band", "Beatles", 0.0),
    ("yes", "no", 0.0),
    (None, "x", 0.0),
])
def test_answer_em(prediction, gold, em):
    assert answer_em(prediction, gold) == em


def test_f1_is_symmetric_in_precision_and_recall():
    assert answer_f1("x b c d", "b") == answer_f1("b", "x b c d") == pytest.approx(0.4)
    assert answer_f1("a b c d", "b") == pytest.approx(0.5)  # "a" is an article, so only 3 tokens count


@pytest.mark.parametrize("text, expected", [
    ("I think <answer>Paris</answer>", "Paris"),
    ("<answer>first</answer> then <answer> second </answer>", "second"),  # the last one is the answer
    ("<ANSWER>\nMulti\nline\n</ANSWER>", "Multi\nline"),
    ("  Paris is the capital.  ", "Paris is the capital."),  # no tag: the whole text
    ("<answer>unclosed", "<answer>unclosed"),
    ("", ""),
    (None, ""),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_real_gold_answers_score_perfectly(shared_data):
    with (shared_data / "hotpotqa" / "dev.jsonl").open() as f:
        rows = [json.loads(line) for line in f][:200]
    assert all(answer_f1(r["answer"], r["answer"]) == 1.0 for r in rows)
    assert all(answer_em(extract_answer(f"So: <answer>{r['answer']}</answer>"), r["answer"]) == 1.0 for r in rows)


@pytest.mark.parametrize("text, expected", [
    ("<answer>x</answer>", True), ("<Answer></Answer>", True), ("<answer>x", False), ("", False), (None, False),
])
def test_has_answer_tag(text, expected):
    assert has_answer_tag(text) is expected
