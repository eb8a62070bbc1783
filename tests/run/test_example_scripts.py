"""examples/train_*.py run as shipped: the CPU command their docstring gives is a valid config, and the script
trains (here on the tiny random model, one step, the built-in data)."""

from __future__ import annotations

import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from agentrl.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "examples").glob("train_*.py"))


def cpu_overrides(script: Path) -> list[str]:
    """The --key=value overrides of the docstring's CPU command."""
    doc = runpy.run_path(str(script))["__doc__"]
    commands = [" ".join(block.replace("\\\n", " ").split()) for block in re.findall(
        r"^    (python examples/\S+ --steps.*?)(?:\n\n|\n\()", doc, re.S | re.M)]
    assert len(commands) == 1, doc
    return shlex.split(commands[0])[2:]


def test_there_are_example_scripts():
    assert [s.name for s in SCRIPTS] == ["train_gsm8k_math.py", "train_hotpotqa_search.py"]


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_cpu_command_of_the_docstring_is_a_valid_config(script):
    overrides = cpu_overrides(script)
    config = TrainConfig.from_yaml(script.with_suffix(".yaml"), overrides)
    assert config.steps == 3 and config.rollout.groups_per_step == 1 and config.rollout.max_new_tokens == 128
    assert config.env.name == script.stem.removeprefix("train_")


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_script_trains_as_shipped(script, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    overrides = [o for o in cpu_overrides(script) if not o.startswith(("--steps=", "--rollout.max_new_tokens="))]
    monkeypatch.setattr(sys, "argv", [str(script), *overrides, "--steps=1", "--rollout.max_new_tokens=8",
                                      "--rollout.group_size=2", "--model.name=tiny-qwen3", "--env.data=null",
                                      "--env.data_rows=null",
                                      f"--checkpoint.run_dir={run}"])
    runpy.run_path(str(script), run_name="__main__")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and records[0]["rollout/n"] == 2
    assert "'step': 1" in capsys.readouterr().out  # the script prints the last step's metrics
