"""`agentrl train` / `agentrl eval` on environments that are not built in: the README's subclass named by its file
(path/to/file.py:Class) and an example environment named by its module (module:Class)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from agentrl.cli import main, parse_train
from agentrl.train.checkpoint import latest_checkpoint, step_dir

ROOT = Path(__file__).resolve().parents[2]
LOOKUP = f"{ROOT / 'examples' / 'hotpotqa_with_lookup.py'}:HotpotQAWithLookup"
SMALL = ["--rollout.group_size=2", "--rollout.groups_per_step=1", "--rollout.max_new_tokens=8",
         "--rollout.max_turns=2"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_train_the_readme_subclass_from_its_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "lookup-run"
    assert main(["train", LOOKUP, "--model", "tiny-qwen3", "--max-steps", "2", *SMALL, "--run-dir", str(run)]) == 0
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollout/n"] == 2 and r["trained_tokens"] > 0 for r in records)
    assert latest_checkpoint(run) == step_dir(run, 2) and (run / "final" / "config.json").exists()
    assert yaml.safe_load((run / "config.yaml").read_text())["env"]["name"] == LOOKUP


def test_eval_the_readme_subclass_and_view_its_worked_examples(tmp_path, capsys):
    out = tmp_path / "lookup.jsonl"
    assert main(["eval", LOOKUP, "--model", "tiny-qwen3", "--limit", "2", "--max-new-tokens", "8",
                 "--max-turns", "2", "--env-arg", "few_shot=2", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["env"] == LOOKUP and summary["n"] == 2
    records = read_jsonl(out)
    assert len(records) == 2
    assert main(["view", str(out)]) == 0
    html = out.with_suffix(".html").read_text()
    # each trajectory opens with the two worked examples of few_shot=2, drawn apart from the model's own turns
    assert html.count('<details class="examples">') == 2 and html.count("2 worked examples") == 2
    for section, record in zip(html.split('<section class="traj"')[1:], records):
        own = section.split("</details>", 1)[1]
        assert len(re.findall(r'class="msg assistant"', own)) == record["num_turns"]
        assert len(re.findall(r'class="msg assistant example"', section)) == 6  # each: two searches, an answer


def test_eval_an_environment_named_by_module_and_class(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))  # `examples` as a namespace package
    out = tmp_path / "facts.jsonl"
    assert main(["eval", "examples.custom_tool_env:CountryFactsPlus", "--model", "tiny-qwen3", "--limit", "2",
                 "--max-new-tokens", "8", "--max-turns", "1", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["env"] == "examples.custom_tool_env:CountryFactsPlus" and summary["n"] == 2
    assert sorted(r["gold"] for r in read_jsonl(out)) == ["Paris", "Tokyo"]  # its own load_dataset's first two


@pytest.mark.parametrize("env, run_dir", [
    ("gsm8k_math", "runs/gsm8k_math"),
    (LOOKUP, "runs/hotpotqawithlookup"),
    ("examples.custom_tool_env:CountryFactsPlus", "runs/countryfactsplus"),
])
def test_default_run_dir_is_a_plain_directory_name(env, run_dir):
    cfg, _ = parse_train([env])
    assert cfg.checkpoint.run_dir == run_dir and cfg.env.name == env


@pytest.mark.parametrize("argv, fragments", [
    (["eval", f"{ROOT / 'examples' / 'hotpotqa_with_lookup.py'}:HotpotQA"],
     ["has no attribute 'HotpotQA'", "it defines HotpotQAWithLookup"]),
    (["train", "no_such_module_for_test:Env"], ["no module named 'no_such_module_for_test'"]),
    (["eval", LOOKUP, "--env-arg", "few_shoot=2"], ["env.args.few_shoot", "did you mean few_shot?"]),
])
def test_bad_environment_names_are_one_line(tmp_path, monkeypatch, capsys, argv, fragments):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"agentrl {argv[0]}: env.")
    assert all(f in lines[0] for f in fragments), lines[0]
    assert not (tmp_path / "runs").exists()
