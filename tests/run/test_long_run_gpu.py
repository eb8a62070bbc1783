"""200 steps of `agentrl train` with default options on one GPU: the trainer and the engine share the weights and
the device for the whole run, and no step may stall (none slower than 5x the median). Runs where CUDA is."""

import json
import statistics

import pytest
import torch

from agentrl.cli import main


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_hundred_default_steps_without_a_stall(tmp_path):
    run = tmp_path / "run"
    # The embedded SmolLM2 on the built-in problems: defaults throughout, only the length of the run set.
    assert main(["train", "gsm8k_math", "--max-steps", "200", "--run-dir", str(run)]) == 0
    seconds = [json.loads(line)["seconds"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(seconds) == 200
    steady = seconds[1:]  # the first step warms the engine up (graph captures, first kernels)
    median = statistics.median(steady)
    slow = [(i + 2, s) for i, s in enumerate(steady) if s > 5 * median]
    assert not slow, f"steps slower than 5x the median {median:.3f} s: {slow}"
