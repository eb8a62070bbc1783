"""200 steps of `agentrl train` on one GPU: the trainer and the engine share the weights and the device for the whole
run, and no step may stall (none slower than 5x the median). With default options: the trainer's layers and the
engine's view both compiled, on two threads (the combination that stalled two early runs), the trainer's forward
and backward and the engine's steps replayed from CUDA graphs. Runs where CUDA is."""

import json
import statistics

import pytest
import torch

from agentrl.cli import main

# What a slow step did, from its metrics: whether it compiled, captured the trainer's graphs, or waited.
WHY = ("seconds", "wait_seconds", "train_seconds", "compiled_frames", "compile_seconds_trainer",
       "compile_seconds_engine", "flat_graphs_eager", "flat_graphs_captured", "graph_capture_wait_seconds",
       "engine_paused_share")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [[], ["--trainer.skip_zero_advantage=false"]], ids=["defaults", "every-sample"])
def test_two_hundred_steps_without_a_stall(tmp_path, options):
    """`every-sample`: the untrained model scores alike in most groups, whose samples the default trainer leaves
    out, so most of its steps run no forward; with every sample run, each step exercises the compiled trainer and
    its graphs beside the engine, as the defaults do once rewards spread."""
    run = tmp_path / "run"
    # The embedded SmolLM2 on the built-in problems: only the length of the run set.
    assert main(["train", "gsm8k_math", "--max-steps", "200", "--run-dir", str(run), *options]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 200
    steady = records[1:]  # the first step warms the engine up (graph captures, first kernels)
    median = statistics.median(r["seconds"] for r in steady)
    slow = [{"step": r["step"], **{k: round(r[k], 3) for k in WHY if k in r}} for r in steady
            if r["seconds"] > 5 * median]
    compiling = [r["step"] for r in steady if r.get("compiled_frames")]
    slowest = max(steady, key=lambda r: r["seconds"])
    # The run's figures whether it passes or not (pytest -rA prints them), for the benchmark record.
    print(f"first step {records[0]['seconds']:.2f} s, median {median:.3f} s, slowest step {slowest['step']} "
          f"{slowest['seconds']:.3f} s ({slowest['seconds'] / median:.1f}x), steps that compiled: {compiling}")
    assert not slow, f"steps slower than 5x the median {median:.3f} s: {slow}; steps that compiled: {compiling}"
