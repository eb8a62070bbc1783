"""`agentrl eval --compare`: a paired bootstrap over questions of two `agentrl eval --out` files, checked on synthetic
results whose answer is known (an exact shift, independent coin flips, identical files), against the eval summary's
own numbers, and on bad input; it needs no model and imports no torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from agentrl.cli import main
from agentrl.env import ToolCall
from agentrl.rollout import Trajectory, summarize
from agentrl.run.compare import compare, format_table


def trajectory(index: int, f1: float = 0.0, correct: float = 0.0, statuses=(), turns: int = 1, member: int = 0,
               finish: str = "done", gold="g") -> Trajectory:
    traj = Trajectory(prompt_index=index, group_id=index, member=member, turn_spans=[(i, i + 1) for i in range(turns)],
                      reward=f1, reward_components={"answer_f1": f1, "correct": correct}, finish_reason=finish,
                      gold=gold)
    traj.tool_calls = [ToolCall(turn=0, name="search", arguments={}, status=s, content="") for s in statuses]
    return traj


def write(path, trajectories) -> str:
    # The records exactly as `agentrl eval --out` writes them.
    path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in trajectories))
    return str(path)


def test_an_exact_shift_has_a_zero_width_difference_interval(tmp_path):
    f1 = np.random.default_rng(0).uniform(0, 0.9, 400)
    before = write(tmp_path / "b.jsonl", [trajectory(i, x) for i, x in enumerate(f1)])
    after = write(tmp_path / "a.jsonl", [trajectory(i, x + 0.1) for i, x in enumerate(f1)])
    row = compare(before, after)["metrics"]["answer_f1"]
    assert row["before"] == pytest.approx(f1.mean()) and row["after"] == pytest.approx(f1.mean() + 0.1)
    assert row["difference"] == pytest.approx(0.1, abs=1e-12)
    assert row["difference_ci"] == pytest.approx([0.1, 0.1], abs=1e-12)
    # Each mean alone still varies with the questions drawn: about ±1.96·sd/√n around it.
    half = 1.96 * f1.std() / math.sqrt(len(f1))
    for side, mean in (("before", f1.mean()), ("after", f1.mean() + 0.1)):
        lo, hi = row[f"{side}_ci"]
        assert lo < mean < hi and (hi - lo) / 2 == pytest.approx(half, rel=0.1)


def test_independent_coin_flips_match_the_analytic_interval(tmp_path):
    n, rng = 2000, np.random.default_rng(1)
    flips_before, flips_after = rng.random(n) < 0.3, rng.random(n) < 0.5
    before = write(tmp_path / "b.jsonl", [trajectory(i, correct=float(c)) for i, c in enumerate(flips_before)])
    after = write(tmp_path / "a.jsonl", [trajectory(i, correct=float(c)) for i, c in enumerate(flips_after)])
    result = compare(before, after)
    row = result["metrics"]["correct"]
    assert row["difference"] == pytest.approx(flips_after.mean() - flips_before.mean())
    lo, hi = row["difference_ci"]
    assert lo < 0.2 < hi and lo > 0
    assert hi - lo == pytest.approx(2 * 1.96 * math.sqrt((0.3 * 0.7 + 0.5 * 0.5) / n), rel=0.1)
    assert result["n"] == {"before": n, "after": n, "compared": n} and result["matched_by"] == "prompt_index"
    # Seeded: the same seed gives the same intervals, another seed others.
    assert compare(before, after)["metrics"]["correct"] == row
    assert compare(before, after, seed=1)["metrics"]["correct"]["difference_ci"] != row["difference_ci"]


def test_identical_files_differ_by_exactly_zero(tmp_path):
    rng = np.random.default_rng(2)
    trajs = [trajectory(i, rng.random(), float(rng.random() < 0.5), ["ok"] * (i % 3), turns=1 + i % 4)
             for i in range(300)]
    result = compare(write(tmp_path / "b.jsonl", trajs), write(tmp_path / "a.jsonl", trajs))
    for row in result["metrics"].values():
        assert row["difference"] == 0 and row["difference_ci"] == [0.0, 0.0]
        assert row["before_ci"] == row["after_ci"]


def test_point_values_are_the_eval_summarys(tmp_path):
    # Two rollouts per question, tool calls of every outcome: the means are pooled as `agentrl eval` pools them
    # (the error rate over calls, not over rollouts), and the bootstrap's unit is still the question.
    statuses = [(), ("ok",), ("ok", "tool_error"), ("parse_error",), ("timeout", "truncated", "unknown_tool")]
    trajs = [trajectory(i, (i * 7 % 10) / 10, float(i % 2), statuses[(i + m) % 5], turns=1 + (i + m) % 3, member=m,
                        finish="truncated" if i % 6 == 0 else "done") for i in range(50) for m in range(2)]
    path = write(tmp_path / "b.jsonl", trajs)
    result = compare(path, path)
    expected = summarize(trajs)
    assert set(result["metrics"]) == {"answer_f1", "correct", "reward", "tool_call_rate", "tool_calls_per_rollout",
                                      "tool_error_rate", "mean_turns", "truncated_rate"}
    for metric, row in result["metrics"].items():
        assert row["before"] == pytest.approx(expected[metric]), metric
    assert result["n"]["compared"] == 50


def test_questions_in_one_file_only_are_reported_and_excluded(tmp_path):
    before = write(tmp_path / "b.jsonl", [trajectory(i, 1.0 if i < 2 else 0.5) for i in range(10)])
    after = write(tmp_path / "a.jsonl", [trajectory(i, 0.5) for i in range(2, 12)])
    result = compare(before, after)
    assert result["only_in_before"] == [0, 1] and result["only_in_after"] == [10, 11]
    assert result["n"] == {"before": 10, "after": 10, "compared": 8}
    assert result["metrics"]["answer_f1"]["before"] == 0.5  # the two excluded 1.0s count nowhere
    table = format_table(result)
    assert f"excluded: 2 questions only in {before}: 0, 1" in table
    assert f"excluded: 2 questions only in {after}: 10, 11" in table
    assert "8 paired" in table.splitlines()[-4]


def test_records_without_an_id_are_matched_by_position_and_say_so(tmp_path):
    def strip(path, n):
        records = [{k: v for k, v in t.to_json().items() if k != "prompt_index"}
                   for t in (trajectory(i, 0.5, gold=i) for i in range(n))]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(path)

    result = compare(strip(tmp_path / "b.jsonl", 5), strip(tmp_path / "a.jsonl", 4))
    assert result["matched_by"] == "position" and result["only_in_before"] == [4] and result["gold_differs"] == 0
    assert "matched by position (the records carry no question id)" in format_table(result)


def test_other_gold_answers_are_warned_of(tmp_path):
    before = write(tmp_path / "b.jsonl", [trajectory(i, gold="a") for i in range(4)])
    after = write(tmp_path / "a.jsonl", [trajectory(i, gold="a" if i else "b") for i in range(4)])
    assert "warning: 1 paired questions have different gold answers" in format_table(compare(before, after))


def test_the_command_prints_a_table_or_json(tmp_path, capsys):
    before = write(tmp_path / "b.jsonl", [trajectory(i, 0.25) for i in range(20)])
    after = write(tmp_path / "a.jsonl", [trajectory(i, 0.75) for i in range(20)])
    assert main(["eval", "--compare", before, after]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["metric", "before", "[95%", "CI]", "after", "[95%", "CI]", "after", "-", "before",
                                "[95%", "CI]"]
    assert lines[1].split() == ["answer_f1", "0.2500", "[0.2500,", "0.2500]", "0.7500", "[0.7500,", "0.7500]",
                                "+0.5000", "[+0.5000,", "+0.5000]"]
    assert main(["eval", "--compare", before, after, "--json", "--resamples", "100"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["resamples"] == 100 and result["metrics"]["answer_f1"]["difference_ci"] == [0.5, 0.5]


@pytest.mark.parametrize("content, error", [
    (None, "no such file"),
    ("not json\n", "not JSONL"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe", "not JSONL (not UTF-8 text)"),
    ('{"step": 1, "loss": 0.5}\n', "not a record of `agentrl eval --out`"),
    ("\n", "no records"),
    (json.dumps(trajectory(99).to_json()) + "\n", "no question in common (matched by prompt_index)"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, content, error):
    good = write(tmp_path / "good.jsonl", [trajectory(i) for i in range(3)])
    bad = tmp_path / "bad.jsonl"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    elif content is not None:
        bad.write_text(content)
    assert main(["eval", "--compare", good, str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("agentrl eval: ") and error in captured.err


def test_compare_imports_no_torch_and_is_fast(tmp_path):
    rng = np.random.default_rng(3)
    trajs = [trajectory(i, rng.random(), float(rng.random() < 0.5), ["ok"] * (i % 2)) for i in range(1000)]
    before, after = write(tmp_path / "b.jsonl", trajs), write(tmp_path / "a.jsonl", trajs[::-1])
    probe = ("import json, sys, time; from agentrl.cli import main; start = time.perf_counter(); "
             f"code = main(['eval', '--compare', {before!r}, {after!r}, '--json']); "
             "print(json.dumps({'code': code, 'seconds': time.perf_counter() - start, "
             "'heavy': sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))}))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result, probe_line = (json.loads(line) for line in done.stdout.strip().splitlines())
    assert probe_line["code"] == 0 and probe_line["heavy"] == []
    assert probe_line["seconds"] < 5  # 10,000 resamples of 1,000 questions, vectorised (well under a second alone)
    assert result["n"]["compared"] == 1000
    assert all(row["difference_ci"] == [0.0, 0.0] for row in result["metrics"].values())  # matched by id, not line


def test_the_dataset_ids_pair_questions_evaluated_in_another_order(tmp_path):
    # The after file read the data in another order (another slice or limit): positions differ, the sample ids pair.
    f1 = [0.1 * i for i in range(8)]
    before = [trajectory(i, f1[i]) for i in range(8)]
    after = [trajectory(7 - i, f1[i] + 0.05) for i in range(8)]
    for t, i in zip(before + after, list(range(8)) * 2):
        t.sample_id = f"q{i}"
    result = compare(write(tmp_path / "b.jsonl", before), write(tmp_path / "a.jsonl", after))
    assert result["matched_by"] == "sample_id"
    assert result["metrics"]["answer_f1"]["difference_ci"] == pytest.approx([0.05, 0.05], abs=1e-12)

