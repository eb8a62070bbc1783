"""Bad configs and data files through the real command line: each fails with exit code 2 and exactly one line on
stderr naming the key, file and line, before any model loads (the run itself is replaced by a tripwire); rows
without a task are skipped with one logged line and the run goes ahead. A few cases run in a fresh interpreter to
show the failure comes in well under 2 s and without importing torch."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import agentrl.data
from agentrl.cli import main

ROOT = Path(__file__).resolve().parents[2]

GSM_ROW = {"question": "Ann has 2 apples and buys 3. How many now?", "answer": "2 + 3 = 5\n#### 5"}
HOT_ROW = {"_id": "h1", "question": "Which river?", "answer": "Tessa",
           "context": [["Lorin", ["Lorin is on the Tessa."]]]}


def jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def gsm(**fields) -> dict:
    return {**GSM_ROW, **fields}


def hot(**fields) -> dict:
    return {**HOT_ROW, **fields}


def without(row: dict, key: str) -> dict:
    return {k: v for k, v in row.items() if k != key}


# (case id, files to write under tmp_path, argv ({tmp} is tmp_path), fragments the one stderr line must contain)
CASES = [
    # ---- config files
    ("yaml_syntax", {"c.yaml": "steps: 3\noptim:\n  lr: 1\n  betas: [0.9\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml"], ["c.yaml:5:", "not valid YAML"]),
    ("yaml_tab_indent", {"c.yaml": "steps: 3\noptim:\n\tlr: 1\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml"], ["c.yaml:3:", "not valid YAML"]),
    ("yaml_top_level_list", {"c.yaml": "- steps\n- 3\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml"], ["c.yaml", "expected a mapping of sections"]),
    ("yaml_not_text", {"c.yaml": b"\xff\xfe\x00steps: 3\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml"], ["c.yaml", "not a text file"]),
    ("config_missing", {}, ["train", "gsm8k_math", "--config", "{tmp}/nope.yaml"], ["--config", "nope.yaml",
                                                                                     "no such file"]),
    ("config_is_a_directory", {"conf/a.yaml": "steps: 3\n"}, ["train", "gsm8k_math", "--config", "{tmp}/conf"],
     ["--config", "conf", "is a directory"]),
    ("yaml_key_set_twice", {"c.yaml": "steps: 3\noptim:\n  lr: 0.1\n  warmup_steps: 1\n  lr: 0.2\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml"], ["c.yaml:5:", "lr is set twice", "first on line 3"]),
    ("yaml_unknown_key", {"c.yaml": "steps: 3\noptim:\n  warmup_steps: 1\n  lrr: 0.1\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml"], ["c.yaml:4:", "optim.lrr", "did you mean optim.lr"]),
    ("yaml_bad_value", {"c.yaml": "steps: 3\noptim:\n  lr: -1\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml"], ["c.yaml:3:", "optim.lr", "must be > 0"]),
    ("yaml_wrong_type", {"c.yaml": "seed: 1\nsteps: many\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml"], ["c.yaml:2:", "steps", "expected an integer"]),
    ("yaml_section_is_a_value", {"c.yaml": "steps: 3\nrollout: 5\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml"], ["c.yaml:2:", "rollout", "expected a mapping"]),
    ("yaml_data_limit_negative", {"c.yaml": "env:\n  name: gsm8k_math\n  data_limit: -3\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml"], ["c.yaml:3:", "env.data_limit", "must be >= 1"]),
    ("yaml_unknown_env_arg", {"c.yaml": "env:\n  args:\n    few_shot: 2\n    fewshot: 2\n"},
     ["train", "hotpotqa_search", "--config", "{tmp}/c.yaml"],
     ["c.yaml:4:", "env.args.fewshot", "did you mean few_shot", "its arguments:", "format_bonus"]),
    ("override_wins_over_yaml_line", {"c.yaml": "optim:\n  lr: 0.1\n"},
     ["train", "gsm8k_math", "--config", "{tmp}/c.yaml", "--optim.lr=-2"], ["optim.lr: must be > 0"]),
    # ---- command-line values
    ("override_not_a_number", {}, ["train", "gsm8k_math", "--optim.lr=abc"], ["optim.lr", "expected a finite number"]),
    ("override_without_value", {}, ["train", "gsm8k_math", "--optim.lr"], ["--optim.lr", "--section.key=value"]),
    ("override_unknown_section", {}, ["train", "gsm8k_math", "--optimizer.lr=1"], ["unknown key 'optimizer'"]),
    ("rows_shorter_than_samples", {}, ["train", "gsm8k_math", "--trainer.row_tokens=10"],
     ["trainer.row_tokens", "rollout.max_sample_tokens"]),
    ("data_limit_zero", {}, ["train", "gsm8k_math", "--env.data_limit=0"], ["env.data_limit", "must be >= 1"]),
    ("data_rows_not_a_slice", {}, ["train", "gsm8k_math", "--env.data_rows=last500"], ["env.data_rows", "START:STOP"]),
    ("data_rows_empty", {}, ["eval", "gsm8k_math", "--env.data_rows=5:5"], ["env.data_rows", "leaves none"]),
    ("max_steps_not_a_number", {}, ["train", "gsm8k_math", "--max-steps", "x"], ["--max-steps", "invalid int"]),
    ("eval_limit_zero", {}, ["eval", "gsm8k_math", "--limit", "0"], ["limit", "must be >= 1"]),
    ("eval_limit_negative", {}, ["eval", "gsm8k_math", "--limit=-3"], ["limit", "must be >= 1"]),
    ("eval_limit_not_a_number", {}, ["eval", "gsm8k_math", "--limit", "ten"], ["limit", "expected an integer"]),
    # ---- environments and their arguments
    ("unknown_environment", {}, ["train", "gsm8k", "--max-steps", "3"],
     ["env.name", "unknown environment 'gsm8k'", "did you mean gsm8k_math", "hotpotqa_search"]),
    ("eval_unknown_environment", {}, ["eval", "hotpot_qa"], ["env.name", "'hotpot_qa'", "available: gsm8k_math"]),
    ("environment_name_is_a_path", {}, ["eval", "../etc/passwd"], ["env.name", "unknown environment"]),
    ("unknown_env_arg", {}, ["train", "hotpotqa_search", "--env.args.fewshot=2"],
     ["env.args.fewshot", "hotpotqa_search has no argument 'fewshot'", "did you mean few_shot", "top_k"]),
    ("eval_unknown_env_arg", {}, ["eval", "gsm8k_math", "--env-arg", "calculator=false"],
     ["env.args.calculator", "gsm8k_math has no argument", "use_calculator"]),
    ("env_arg_wrong_type", {}, ["eval", "hotpotqa_search", "--env-arg", "few_shot=abc"],
     ["env.args.few_shot", "expected an integer, got 'abc'"]),
    ("env_arg_not_whole", {}, ["eval", "hotpotqa_search", "--env-arg", "few_shot=2.5"],
     ["env.args.few_shot", "expected an integer, got 2.5"]),
    ("env_arg_float_for_an_int", {}, ["eval", "hotpotqa_search", "--env-arg", "top_k=3.0"],
     ["env.args.top_k", "expected an integer, got 3.0"]),
    ("env_arg_out_of_range", {}, ["eval", "hotpotqa_search", "--env-arg", "few_shot=9"],
     ["env.args", "few_shot must be between 0 and 4, got 9"]),
    ("env_arg_negative_bonus", {}, ["train", "hotpotqa_search", "--env.args.format_bonus=-1"],
     ["env.args", "format_bonus must be >= 0"]),
    ("env_arg_not_a_boolean", {}, ["eval", "gsm8k_math", "--env-arg", "use_calculator=maybe"],
     ["env.args.use_calculator", "expected true or false"]),
    ("env_arg_without_value", {}, ["eval", "gsm8k_math", "--env-arg", "use_calculator"],
     ["--env-arg", "expected KEY=VALUE"]),
    ("env_arg_split_does_nothing", {}, ["eval", "hotpotqa_search", "--env-arg", "split=dev"],
     ["env.args.split", "has no effect"]),
    ("builtin_data_unknown_split", {}, ["eval", "hotpotqa_search", "--split", "nonsense"],
     ["split 'nonsense'", "splits 'train' and 'dev'"]),
    # ---- data paths
    ("data_missing", {}, ["eval", "gsm8k_math", "--data", "{tmp}/nope.jsonl"],
     ["env.data", "nope.jsonl", "no such data file"]),
    ("data_empty_path", {}, ["eval", "gsm8k_math", "--data", ""], ["env.data", "empty path"]),
    ("data_folder_without_split", {"d/train.jsonl": jsonl(GSM_ROW)}, ["eval", "gsm8k_math", "--data", "{tmp}/d"],
     ["env.data", "no dev.jsonl or dev.json", "it holds train.jsonl"]),
    ("data_unsupported_format", {"d.txt": "Ann has 2 apples\n"}, ["eval", "gsm8k_math", "--data", "{tmp}/d.txt"],
     ["d.txt", "unsupported data format '.txt'"]),
    # ---- JSON Lines files
    ("jsonl_empty", {"d.jsonl": ""}, ["train", "gsm8k_math", "--data", "{tmp}/d.jsonl"],
     ["d.jsonl", "no rows (the file is empty)"]),
    ("jsonl_blank_lines_only", {"d.jsonl": "\n  \n\n"}, ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"],
     ["d.jsonl", "no rows"]),
    ("jsonl_malformed_line", {"d.jsonl": jsonl(GSM_ROW, GSM_ROW, '{"question": "q", "answer": }', GSM_ROW)},
     ["train", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:3:", "not valid JSON", "column"]),
    ("jsonl_truncated_last_line", {"d.jsonl": jsonl(GSM_ROW) + '{"question": "Ann has'},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:2:", "not valid JSON"]),
    ("jsonl_line_numbers_count_blank_lines", {"d.jsonl": jsonl(GSM_ROW) + "\n\n" + "{oops}\n"},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:4:", "not valid JSON"]),
    ("jsonl_row_is_an_array", {"d.jsonl": jsonl(GSM_ROW, '["q", "a"]')},
     ["train", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:2:", "expected a JSON object", "an array"]),
    ("jsonl_row_is_null", {"d.jsonl": jsonl(GSM_ROW, "null")}, ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"],
     ["d.jsonl:2:", "expected a JSON object", "null"]),
    ("jsonl_row_is_a_string", {"d.jsonl": jsonl('"What is 2 + 3?"')},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "a string"]),
    ("jsonl_holds_one_array", {"d.jsonl": json.dumps([GSM_ROW, GSM_ROW]) + "\n"},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "an array of 2 items", ".json file"]),
    ("jsonl_not_utf8", {"d.jsonl": jsonl(GSM_ROW).encode() + b'{"question": "caf\xe9", "answer": "1"}\n'},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:2:", "not UTF-8"]),
    ("row_without_question", {"d.jsonl": jsonl(GSM_ROW, {"problem": "2 + 3?", "answer": "#### 5"})},
     ["train", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:2:", "no 'question'", "'problem'"]),
    ("row_without_answer", {"d.jsonl": jsonl(GSM_ROW, GSM_ROW, without(GSM_ROW, "answer"))},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:3:", "no 'answer'"]),
    ("hotpot_row_without_answer", {"d.jsonl": jsonl(without(HOT_ROW, "answer"))},
     ["eval", "hotpotqa_search", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "no 'answer'"]),
    ("question_is_a_list", {"d.jsonl": jsonl(gsm(question=["2 + 3?"]))},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "'question' must be a string", "an array"]),
    ("question_is_a_number", {"d.jsonl": jsonl(GSM_ROW, gsm(question=17))},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:2:", "'question' must be a string", "17"]),
    ("answer_is_a_boolean", {"d.jsonl": jsonl(hot(answer=True))},
     ["eval", "hotpotqa_search", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "'answer'", "boolean true"]),
    ("answer_is_an_object", {"d.jsonl": jsonl(gsm(answer={"value": 5}))},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "'answer'", "an object"]),
    ("every_row_skipped", {"d.jsonl": jsonl(gsm(answer=None), gsm(question="  "))},
     ["train", "gsm8k_math", "--data", "{tmp}/d.jsonl"], ["d.jsonl", "skipped 2 of 2 rows", "no usable row"]),
    # ---- JSON files
    ("json_object_without_data_key", {"d.json": json.dumps({"rows": [GSM_ROW], "version": 1})},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.json"], ["d.json:1:", "under 'data'", "'rows'"]),
    ("json_data_not_a_list", {"d.json": json.dumps({"data": GSM_ROW})},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.json"], ["d.json", "'data' must be a list"]),
    ("json_malformed", {"d.json": '[\n  {"question": "q",\n   "answer": 5,}\n]\n'},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.json"], ["d.json:3:", "not valid JSON"]),
    ("json_holding_json_lines", {"d.json": jsonl(GSM_ROW, GSM_ROW)},
     ["train", "gsm8k_math", "--data", "{tmp}/d.json"], ["d.json:2:", "name the file .jsonl"]),
    ("json_scalar", {"d.json": "42\n"}, ["eval", "gsm8k_math", "--data", "{tmp}/d.json"],
     ["d.json:1:", "expected a JSON array of rows", "42"]),
    ("json_empty_array", {"d.json": "[]"}, ["eval", "gsm8k_math", "--data", "{tmp}/d.json"],
     ["d.json", "no rows (not one row in it)"]),
    ("json_null_item_names_its_line", {"d.json": "[\n" + json.dumps(GSM_ROW) + ",\n\n  null\n]\n"},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.json"], ["d.json:4:", "expected a JSON object", "null"]),
    ("json_data_key_item_names_its_line",
     {"d.json": '{"version": 2,\n "data": [\n' + json.dumps(GSM_ROW) + ",\n" + json.dumps({"q": 1}) + "]}"},
     ["eval", "gsm8k_math", "--data", "{tmp}/d.json"], ["d.json:4:", "no 'question'"]),
    # ---- HotpotQA contexts
    ("context_is_a_string", {"d.jsonl": jsonl(HOT_ROW, hot(context="Lorin is a city on the Tessa."))},
     ["eval", "hotpotqa_search", "--data", "{tmp}/d.jsonl"],
     ["d.jsonl:2:", "'context' must be a list of [title, [sentence, ...]] pairs", "a string"]),
    ("context_sentences_are_a_string", {"d.jsonl": jsonl(hot(context=[["Lorin", "Lorin is on the Tessa."]]))},
     ["train", "hotpotqa_search", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "context[0]", "'Lorin'", "a string"]),
    ("context_paragraph_not_a_pair", {"d.jsonl": jsonl(hot(context=[["Lorin", ["s"]], ["Tessa"]]))},
     ["eval", "hotpotqa_search", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "context[1]", "pair"]),
    ("context_title_not_a_string", {"d.jsonl": jsonl(hot(context=[[7, ["s"]]]))},
     ["eval", "hotpotqa_search", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "context[0]'s title", "7"]),
    ("context_sentence_not_a_string", {"d.jsonl": jsonl(hot(context=[["Lorin", ["s", None]]]))},
     ["eval", "hotpotqa_search", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "context[0] ('Lorin') sentence 1", "null"]),
    ("no_row_has_a_context", {"d.jsonl": jsonl(without(HOT_ROW, "context"), hot(_id="h2", context=None))},
     ["eval", "hotpotqa_search", "--data", "{tmp}/d.jsonl"], ["d.jsonl", "no row has a 'context'"]),
    ("supporting_facts_a_string", {"d.jsonl": jsonl(hot(supporting_facts="Lorin"))},
     ["eval", "hotpotqa_search", "--data", "{tmp}/d.jsonl"], ["d.jsonl:1:", "'supporting_facts'", "a string"]),
]


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """Run `agentrl ...` in-process in tmp_path; the run itself is a tripwire (nothing may get that far on bad
    input), or a stub that records its config where a case should go through."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(agentrl.data, "_REPORTED", set())
    reached = []

    def tripwire(cfg, *args, **kwargs):
        reached.append(cfg)
        return {"stub": True}

    # by module object: the agentrl.run package exports a function `train` that hides its submodule's name
    monkeypatch.setattr(importlib.import_module("agentrl.run.train"), "train", tripwire)
    monkeypatch.setattr(importlib.import_module("agentrl.run.eval"), "evaluate", tripwire)

    def run(argv: list[str]) -> tuple[int, list[str], list]:
        argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's errors leave through SystemExit (still one line, code 2)
            code = exc.code
        err = capsys.readouterr().err
        return code, err.splitlines(), reached

    return run


def write_files(root: Path, files: dict) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def test_the_corpus_is_large_and_distinct():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("files, argv, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_code_2(cli, tmp_path, files, argv, fragments):
    write_files(tmp_path, files)
    code, lines, reached = cli(argv)
    assert code == 2 and not reached
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"agentrl {argv[0]}: ")
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert "Traceback" not in line


# Rows without a task: skipped, counted in one line, and the run goes ahead on the others.
SKIPS = [
    ("gsm8k_null_answer_and_blank_question",
     jsonl(GSM_ROW, gsm(answer=None), gsm(question="   "), GSM_ROW), "gsm8k_math",
     ["skipped 2 of 4 rows", "1 with a null or blank answer (first at line 2)",
      "1 with a null or blank question (first at line 3)"], 2),
    ("gsm8k_answer_without_a_number", jsonl(gsm(answer="None"), GSM_ROW, gsm(answer="#### five")), "gsm8k_math",
     ["skipped 2 of 3 rows", "2 with an answer that ends in no number (first at line 1)"], 1),
    ("hotpot_blank_answer", jsonl(HOT_ROW, hot(_id="h2", answer=""), hot(_id="h3", question=None)),
     "hotpotqa_search", ["skipped 2 of 3 rows", "null or blank answer (first at line 2)",
                         "null or blank question (first at line 3)"], 1),
]


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("content, env, fragments, kept", [c[1:] for c in SKIPS], ids=[c[0] for c in SKIPS])
def test_rows_without_a_task_are_skipped_and_counted(cli, tmp_path, command, content, env, fragments, kept):
    (tmp_path / "d.jsonl").write_text(content)
    code, lines, reached = cli([command, env, "--data", str(tmp_path / "d.jsonl")])
    assert code == 0 and len(reached) == 1
    skipped = [line for line in lines if "skipped" in line]
    assert len(skipped) == 1 and skipped[0].startswith(f"agentrl: {tmp_path / 'd.jsonl'}: skipped"), lines
    for fragment in fragments:
        assert fragment in skipped[0], (fragment, skipped[0])
    from agentrl.run.preflight import check_inputs

    assert len(check_inputs(reached[0]).dataset) == kept  # the same rows again: no second report
    assert reached[0].env.data == str(tmp_path / "d.jsonl")


def test_environment_arguments_of_the_declared_types_reach_the_run(cli):
    code, lines, reached = cli(["eval", "hotpotqa_search", "--env-arg", "few_shot=2", "--env-arg", "format_bonus=1"])
    assert code == 0 and not [line for line in lines if line.startswith("agentrl eval: env")]
    assert reached[0].env.args == {"few_shot": 2, "format_bonus": 1}  # an int where a float is declared is fine


def test_tools_offered_with_one_turn_are_noted_once_and_the_run_goes_on(cli, capsys):
    code, lines, reached = cli(["train", "gsm8k_math", "--rollout.max_turns=1"])
    noted = [line for line in lines if "max_turns=1" in line]
    assert code == 0 and len(reached) == 1
    assert noted == ["agentrl: rollout.max_turns=1 while the environment offers calculate: a rollout that calls a tool "
                     "ends at the call, before its result (raise max_turns, or stop offering the tool through its "
                     "env.args)"]
    for argv in (["train", "gsm8k_math", "--rollout.max_turns=2"],
                 ["train", "gsm8k_math", "--rollout.max_turns=1", "--env-arg", "use_calculator=false"]):
        _, lines, _ = cli(argv)
        assert not [line for line in lines if "max_turns" in line], argv


# ---- in a fresh interpreter: the time to fail, and no torch

RUN_AND_CHECK = ("import sys; from agentrl.cli import main; code = main(sys.argv[1:]); "
                 "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)")
SUBPROCESS_CASES = ["jsonl_malformed_line", "unknown_env_arg", "yaml_bad_value", "context_is_a_string",
                    "eval_limit_zero", "data_missing"]


def run_fresh(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    return done, time.perf_counter() - start


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_fails_in_a_fresh_interpreter_fast_and_without_torch(tmp_path, case):
    _, files, argv, fragments = next(c for c in CASES if c[0] == case)
    write_files(tmp_path, files)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    done, seconds = run_fresh(["-c", RUN_AND_CHECK, *argv], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), lines
    assert seconds < 2.0


def test_python_dash_m_agentrl_imports_no_torch_on_bad_data(tmp_path):
    (tmp_path / "d.jsonl").write_text(jsonl(GSM_ROW, "[1, 2]"))
    done, seconds = run_fresh(["-X", "importtime", "-m", "agentrl", "train", "gsm8k_math", "--data",
                               str(tmp_path / "d.jsonl")], tmp_path)
    imports = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    others = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and len(imports) > 50  # -X importtime did report
    assert not [line for line in imports if line.rsplit("|", 1)[-1].strip().split(".")[0] == "torch"]
    assert others == [f"agentrl train: {tmp_path / 'd.jsonl'}:2: expected a JSON object (one row), got an array of "
                      f"2 items"]
    assert seconds < 3.0  # importtime's own reporting slows the start a little


@pytest.mark.parametrize("env, data", [("hotpotqa_search", None), ("gsm8k_math", None),
                                       ("hotpotqa_search", "hotpotqa/dev.jsonl"), ("gsm8k_math", "gsm8k")])
def test_good_inputs_pass_the_check_without_torch(env, data, tmp_path):
    shared = ROOT.parent / "shared" / "data"
    if data is not None and not shared.exists():
        pytest.skip("../shared/data is absent")
    argv = [env, "--limit", "none"] + (["--data", str(shared / data), "--split", "train" if env == "gsm8k_math"
                                        else "dev"] if data else [])
    code = ("import sys; from agentrl.cli import parse_eval; from agentrl.run.preflight import check_inputs; "
            "inputs = check_inputs(parse_eval(sys.argv[1:])); assert 'torch' not in sys.modules; "
            "print(len(inputs.dataset))")
    done, seconds = run_fresh(["-c", code, *argv], tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert int(done.stdout) > 0
