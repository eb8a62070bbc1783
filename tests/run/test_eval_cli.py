"""`agentrl eval` and `agentrl view` end to end through `agentrl.cli.main`, on the tiny random Qwen3 (whatever it
writes) and on the scripted tool-calling policy (tests/scripted_policy.py), whose summary is known exactly."""

from __future__ import annotations

import json

import pytest

from agentrl.cli import main
from tests.helpers import ScriptedPolicy

SUMMARY_KEYS = {"env", "model", "n", "tool_call_rate", "tool_calls_per_rollout", "tool_error_rate", "mean_turns",
                "reward", "prefix_cache_hit_share", "seconds"}
HEADLINE = {"hotpotqa_search": {"answer_f1", "answer_em", "accuracy"}, "gsm8k_math": {"accuracy"}}
RECORD_KEYS = {"prompt_index", "epoch", "input_ids", "trainable", "logprobs", "versions", "turn_spans", "messages",
               "tool_calls", "reward", "reward_components", "finish_reason", "num_turns", "answer", "gold"}



def run_eval(capsys, *args: str) -> dict:
    assert main(["eval", *args]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1])  # one JSON line


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_record(record: dict) -> None:
    assert RECORD_KEYS <= set(record)
    n = len(record["input_ids"])
    assert len(record["trainable"]) == len(record["logprobs"]) == len(record["versions"]) == n
    assert record["num_turns"] == len(record["turn_spans"]) >= 1
    generated = {i for a, b in record["turn_spans"] for i in range(a, b)}
    assert {i for i, m in enumerate(record["trainable"]) if m} == generated
    roles = [m["role"] for m in record["messages"]]
    # The rollout's own turns follow the question, the last user message (an environment may open with worked
    # examples, whose assistant and tool turns are part of the prompt).
    own = roles[len(roles) - roles[::-1].index("user"):]
    assert roles[0] == "system" and own.count("assistant") == record["num_turns"]
    assert own.count("tool") == len(record["tool_calls"]) and "user" not in own
    assert all({"turn", "name", "arguments", "status", "content"} <= set(c) for c in record["tool_calls"])
    assert isinstance(record["reward"], float)


@pytest.mark.parametrize("env", ["hotpotqa_search", "gsm8k_math"])
def test_eval_then_view_on_tiny_qwen3(env, tmp_path, capsys):
    out = tmp_path / "tmp.jsonl"
    summary = run_eval(capsys, env, "--model", "tiny-qwen3", "--limit", "4", "--max-new-tokens", "16",
                       "--out", str(out))
    assert set(summary) == SUMMARY_KEYS | HEADLINE[env]
    assert summary["n"] == 4 and summary["env"] == env and summary["model"] == "tiny-qwen3"
    assert 0 <= summary["tool_call_rate"] <= 1 and 0 <= summary["tool_error_rate"] <= 1
    assert summary["tool_calls_per_rollout"] >= 0 and 1 <= summary["mean_turns"] <= 4
    records = read_jsonl(out)
    assert len(records) == 4 and sorted(r["prompt_index"] for r in records) == [0, 1, 2, 3]
    for record in records:
        check_record(record)
        assert all(b - a <= 16 for a, b in record["turn_spans"])  # --max-new-tokens
    assert summary["mean_turns"] == pytest.approx(sum(r["num_turns"] for r in records) / 4, abs=1e-4)
    assert summary["reward"] == pytest.approx(sum(r["reward"] for r in records) / 4, abs=1e-4)

    assert main(["view", str(out)]) == 0
    page = tmp_path / "tmp.html"
    assert capsys.readouterr().out.strip() == str(page)
    html = page.read_text()
    assert html.count('<section class="traj"') == 4 and "4 trajectories" in html


def test_environment_arguments_shape_the_prompt(tmp_path, capsys):
    out = tmp_path / "plain.jsonl"
    run_eval(capsys, "hotpotqa_search", "--model", "tiny-qwen3", "--limit", "2", "--max-new-tokens", "4",
             "--max-turns", "1", "--env-arg", "few_shot=0", "--out", str(out))
    for record in read_jsonl(out):  # no worked examples: the system turn, then the question, then the answer
        assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]
    with pytest.raises(SystemExit):
        main(["eval", "hotpotqa_search", "--env-arg", "few_shot"])


def test_eval_summary_of_a_scripted_tool_user_is_exact(tmp_path, capsys, monkeypatch):
    from agentrl import load_environment
    from agentrl.models import load_model

    samples = load_environment("hotpotqa_search").load_dataset(split="dev", limit=4)
    gold = {s["question"]: s["answer"] for s in samples}

    def script(question: str, turn: int) -> str:
        if turn < 2:
            query = question.split()[-1 - turn].strip("?")
            return '<tool_call>{"name": "search", "arguments": {"query": %s}}</tool_call>' % json.dumps(query)
        return f"<answer>{gold[question]}</answer>"

    def scripted_model(name, **kwargs):
        model, tokenizer = load_model("tiny-qwen3")
        return ScriptedPolicy(model, script), tokenizer

    monkeypatch.setattr("agentrl.models.load_model", scripted_model)
    # The script is keyed on the first user turn and counts assistant headers: no worked examples before it.
    monkeypatch.setattr("environments.hotpotqa_search.HotpotQASearchEnv.few_shot", 0)
    out = tmp_path / "scripted.jsonl"
    summary = run_eval(capsys, "hotpotqa_search", "--model", "tiny-qwen3", "--limit", "4", "--max-new-tokens",
                       "96", "--out", str(out))
    assert {k: summary[k] for k in ("n", "tool_call_rate", "tool_calls_per_rollout", "tool_error_rate", "answer_f1",
                                    "answer_em", "accuracy", "mean_turns", "reward")} == {
        "n": 4, "tool_call_rate": 1.0, "tool_calls_per_rollout": 2.0, "tool_error_rate": 0.0, "answer_f1": 1.0,
        "answer_em": 1.0, "accuracy": 1.0, "mean_turns": 3.0, "reward": 1.1}  # F1 + the 0.1 search bonus
    assert summary["prefix_cache_hit_share"] > 0.5  # resubmitted turns and the shared system prompt
    records = read_jsonl(out)
    assert len(records) == 4
    # Each record names its dataset sample, which is what `agentrl eval --compare` pairs questions by.
    from environments.hotpotqa_search import load_environment

    ids = [s["id"] for s in load_environment().load_dataset(split="dev", limit=4)]
    assert sorted(r["sample_id"] for r in records) == sorted(ids)
    for record in records:
        check_record(record)
        assert [c["status"] for c in record["tool_calls"]] == ["ok", "ok"]
        assert [c["name"] for c in record["tool_calls"]] == ["search", "search"]
        assert record["answer"] == f"<answer>{record['gold']}</answer>" and record["finish_reason"] == "done"
        assert record["reward_components"] == {"answer_f1": 1.0, "answer_em": 1.0, "search_calls": 2.0,
                                               "searched_f1": 1.0}
