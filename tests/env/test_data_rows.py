"""`env.data_rows`: a slice of the split's rows, taken before `data_limit`, the same in preflight and in the run."""

import json

import pytest

from agentrl.config import ConfigError
from agentrl.env.config import EnvConfig
from agentrl.run.build import load_env_and_data
from agentrl.run.config import EvalConfig
from agentrl.run.preflight import check_inputs


@pytest.fixture
def gsm8k_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(10)))
    return str(path)


@pytest.mark.parametrize("rows, limit, want", [
    (None, None, list(range(10))),
    ("-3:", None, [7, 8, 9]),
    ("0:-3", None, list(range(7))),
    ("2:5", None, [2, 3, 4]),
    ("-3:", 2, [7, 8]),
    (":4", 10, [0, 1, 2, 3]),
])
def test_rows_are_sliced_before_the_limit_in_the_run_and_in_preflight(gsm8k_file, rows, limit, want):
    cfg = EnvConfig(name="gsm8k_math", data=gsm8k_file, data_rows=rows, data_limit=limit)
    _, dataset = load_env_and_data(cfg, "train")
    assert [s["question"] for s in dataset] == [f"What is {i} + 1?" for i in want]
    checked = check_inputs(EvalConfig(env=cfg, split="train")).dataset
    assert [s["question"] for s in checked] == [s["question"] for s in dataset]


def test_train_and_held_out_rows_never_overlap(gsm8k_file):
    train = load_env_and_data(EnvConfig(name="gsm8k_math", data=gsm8k_file, data_rows="0:-4"), "train")[1]
    held = load_env_and_data(EnvConfig(name="gsm8k_math", data=gsm8k_file, data_rows="-4:"), "train")[1]
    assert len(train) + len(held) == 10
    assert not {s["question"] for s in train} & {s["question"] for s in held}


@pytest.mark.parametrize("rows", ["5", "a:b", "1:2:3", ""])
def test_a_malformed_slice_is_refused(rows):
    with pytest.raises(ConfigError, match="env.data_rows"):
        EnvConfig(data_rows=rows)
