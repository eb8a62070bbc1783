"""benchmarks/eval_breakdown.py: an eval's F1 split by searches made and by whether the rollout's own results held
the answer, on records written the way `agentrl eval --out` writes them."""

import pytest

from benchmarks.eval_breakdown import breakdown


def _record(gold, f1, results):
    calls = [{"turn": k, "name": "search", "arguments": {"query": "q"}, "status": status, "content": text}
             for k, (status, text) in enumerate(results)]
    return {"gold": gold, "reward_components": {"answer_f1": f1}, "tool_calls": calls}


def test_rows_count_rollouts_and_average_their_f1():
    records = [
        _record("Lorin", 1.0, [("ok", "[1] Ada Korsch\nborn in Lorin.")]),  # found, one search
        _record("Lorin", 0.5, [("ok", "[1] Tessa\nA river."), ("ok", "[1] Lorin\nA city.")]),  # found at the 2nd
        _record("Lorin", 0.0, [("ok", "[1] Lorinda\nA name.")]),  # a longer word is not the answer
        _record("Lorin", 0.25, [("bad_arguments", "Lorin")]),  # an undelivered call neither counts nor finds
        _record("yes", 1.0, [("ok", "yes")]),  # yes/no apart
        _record("1885", 0.0, [("ok", "a"), ("ok", "b"), ("truncated", "founded in 1885")]),
    ]
    rows = breakdown(records)
    assert rows["all"] == (6, pytest.approx(2.75 / 6))
    assert rows["answer in its search results"] == (3, pytest.approx(0.5))
    assert rows["answer not in its search results"] == (2, pytest.approx(0.125))
    assert rows["answer yes/no"] == (1, 1.0)
    assert rows["searches: 0"] == (1, 0.25) and rows["searches: 1"] == (3, pytest.approx(2 / 3))
    assert rows["searches: 2"] == (1, 0.5) and rows["searches: 3+"] == (1, 0.0)


def test_types_split_the_rollouts_by_their_question_type():
    records = [dict(_record("Lorin", 1.0, [("ok", "Lorin")]), sample_id="a"),
               dict(_record("Tessa", 0.0, []), sample_id="b"),
               dict(_record("yes", 0.5, []), sample_id="c"),
               dict(_record("no", 0.25, []), sample_id="d")]
    rows = breakdown(records, {"a": "bridge", "b": "bridge", "c": "comparison"})
    assert rows["type: bridge"] == (2, 0.5)
    assert rows["type: comparison"] == (1, 0.5)
    assert rows["type: unknown"] == (1, 0.25)  # a record whose id the file does not hold
    assert "type: bridge" not in breakdown(records)  # no types given: no rows by type
