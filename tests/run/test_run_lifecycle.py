"""A run's life in its directory: Ctrl-C saves and stops, a resumed run continues the schedule it asks for and
never logs a step twice, and every file it writes is replaced whole or not at all."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.cli import main
from agentrl.run.run_dir import cut_metrics, write_directory_atomic
from agentrl.train.checkpoint import latest_checkpoint, load_checkpoint, step_dir

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model", "tiny-qwen3", "--rollout.group_size=2", "--rollout.groups_per_step=2",
         "--rollout.max_new_tokens=8", "--rollout.max_turns=2", "--rollout.rollouts_in_flight=4"]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sigint_checkpoints_the_last_finished_step_and_the_run_resumes_from_it(tmp_path):
    run = tmp_path / "runs" / "gsm8k_math"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "agentrl", "train", "gsm8k_math", *SMALL, "--max-steps", "50",
               "--checkpoint.save_every=0"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # wait for two steps, so the interrupt lands mid-run
            if (run / "metrics.jsonl").exists() and len(_records(run)) >= 2:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("the run did not finish two steps in time")
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - sent < 10, "the run took more than 10 s to stop"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    done = _records(run)[-1]["step"]
    assert latest_checkpoint(run) == step_dir(run, done)
    assert f"step {done} is saved in" in err and "run the same command to resume" in err
    from agentrl.models import load_model

    model, _ = load_model("tiny-qwen3")
    assert load_checkpoint(latest_checkpoint(run), model)["step"] == done  # loadable

    # The same command, with a nearer end, continues from that step.
    resumed = subprocess.run([*command[:-3], "--max-steps", str(done + 1), "--checkpoint.save_every=0"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {Path('runs/gsm8k_math')} from step {done}" in resumed.stderr
    assert [r["step"] for r in _records(run)] == list(range(1, done + 2))


def test_a_longer_rerun_follows_its_own_schedule_and_logs_no_step_twice(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["train", "gsm8k_math", *SMALL, "--optim.lr=1e-3", "--optim.warmup_steps=1"]
    assert main([*args, "--max-steps", "2"]) == 0
    run = tmp_path / "runs" / "gsm8k_math"
    # A crash after step 2's checkpoint would leave lines past it; the resumed run must replace them.
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 123.0}) + "\n" + '{"step": 4, "lo')
    assert main([*args, "--max-steps", "4"]) == 0
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[2]["loss"] != 123.0
    # The 4-step cosine, not the finished 2-step one (which would train steps 3 and 4 at lr 0).
    for r in records[2:]:
        k = r["step"] - 1
        assert r["lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * (k - 1) / 3))) and r["lr"] > 0


def test_cut_metrics_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    cut_metrics(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_directory_written_atomically_survives_a_failed_write(tmp_path):
    target = tmp_path / "final"

    def good(d):
        (d / "weights").write_text("v1")

    def dies(d):
        (d / "weights").write_text("half")
        raise KeyboardInterrupt

    write_directory_atomic(target, good)
    with pytest.raises(KeyboardInterrupt):
        write_directory_atomic(target, dies)
    assert (target / "weights").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no temporary left behind


def test_a_run_dir_of_another_model_is_refused_before_loading_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "gsm8k_math"
    (step_dir(run, 1)).mkdir(parents=True)
    for name in ("model.pt", "optimizer.pt", "scheduler.pt", "trainer_state.pt"):
        (step_dir(run, 1) / name).write_bytes(b"")
    (run / "config.yaml").write_text("model:\n  name: some-other-model\nenv:\n  name: gsm8k_math\n")
    assert main(["train", "gsm8k_math", "--model", "tiny-qwen3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "another model.name" in err and "'some-other-model' there, 'tiny-qwen3' asked" in err
    assert err.count("\n") == 1  # one line


def test_prompts_longer_than_a_sample_are_skipped_and_counted_or_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = ["train", "gsm8k_math", *SMALL, "--max-steps", "1", "--trainer.row_tokens=4096"]
    # Every GSM8K prompt (system turn and tool schema included) is longer than 64 tokens: a one-line refusal.
    assert main([*base, "--rollout.max_sample_tokens=64", "--rollout.max_new_tokens=8", "--run-dir", "short"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "skipped and counted" in err[-2] and "every prompt is at least rollout.max_sample_tokens (64)" in err[-1]
    # With room for most of them, the long ones are skipped and the step trains on the rest.
    from agentrl.run.build import build_run, start, step, stop
    from agentrl.run.config import TrainConfig

    cfg = TrainConfig.from_dict({}, ["--model.name=tiny-qwen3", "--rollout.group_size=2", "--rollout.groups_per_step=1",
                                     "--rollout.max_new_tokens=8", "--rollout.max_turns=1", "--deterministic=true",
                                     "--checkpoint.run_dir=long"])
    run = build_run(cfg)
    lengths = sorted(len(run.fmt.prompt_ids(run.env.start(s).messages)) for s in run.prompts.dataset)
    cfg.rollout.max_sample_tokens = lengths[len(lengths) // 2]  # half the prompts leave no room
    start(run)
    try:
        metrics = step(run)
    finally:
        stop(run)
    assert metrics["rollout/n"] == 2 and metrics["trained_tokens"] > 0
    assert run.driver.stats.prompts_too_long == metrics["prompts_too_long"]


def test_the_objects_a_start_leaves_are_frozen_after_the_first_step_and_thawed_at_the_stop(tmp_path):
    """A full collection walks every tracked object with the GIL held, stopping both threads; after the first step
    the start's objects are frozen out of the generations (`build.freeze_start_objects`), and the stop gives them
    back, so a process that goes on (tests, notebooks) collects them again."""
    import gc

    from agentrl.run.build import build_run, start, step, stop
    from agentrl.run.config import TrainConfig

    cfg = TrainConfig.from_dict({}, ["--model.name=tiny-qwen3", "--rollout.group_size=2", "--rollout.groups_per_step=1",
                                     "--rollout.max_new_tokens=8", "--rollout.max_turns=1", "--deterministic=true",
                                     f"--checkpoint.run_dir={tmp_path / 'run'}"])
    gc.unfreeze()
    run = build_run(cfg)
    start(run)
    try:
        assert gc.get_freeze_count() == 0
        step(run)
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the model, the tokenizer, the modules imported: the start's objects
        step(run)
        assert gc.get_freeze_count() <= frozen  # once per run (frozen objects freed since leave the count)
    finally:
        stop(run)
    assert gc.get_freeze_count() == 0
