"""`agentrl train` end to end on CPU: the zero-sync loop (engine thread + rollout driver + packed GRPO step)."""

import json

from agentrl.cli import main
from agentrl.train.checkpoint import latest_checkpoint, step_dir
from tests.helpers import install_fake_trackers


def test_train_gsm8k_tiny_qwen3_three_steps_then_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    trackers = install_fake_trackers(monkeypatch)
    # Short turns keep a random model's rollouts (which rarely end by themselves) quick on a CPU.
    # A random model scores 0 on every rollout: every advantage is 0, and by default the trainer would leave every
    # sample out of its forward, with them the loss diagnostics read below.
    small = ["--rollout.max_new_tokens=16", "--rollout.group_size=4", "--rollout.groups_per_step=2",
             "--trainer.skip_zero_advantage=false"]
    assert main(["train", "gsm8k_math", "--model", "tiny-qwen3", "--max-steps", "3", *small,
                 "--metrics.report_to=trackio,tensorboard"]) == 0
    run = tmp_path / "runs" / "gsm8k_math"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["rollout/n"] == 8 and r["trained_tokens"] > 0 and not r["skipped"]  # 2 groups of 4
        assert r["loss/is_ratio_max"] < 1.01  # same weights in engine and trainer: behaviour logprobs agree
        assert sum(r["loss/staleness_hist"].values()) == r["tokens"]  # every trained token, by its policy lag
        assert r["compiled_frames"] == 0  # nothing is compiled on the CPU by default
        assert r["compile_seconds_trainer"] == r["compile_seconds_engine"] == 0.0  # by either thread
    assert latest_checkpoint(run) == step_dir(run, 3)
    assert (run / "final" / "config.json").exists()  # the plain model directory `agentrl eval --model` loads
    # the trackers saw the same steps as the JSONL
    assert [step for step, _ in trackers["log"]] == [1, 2, 3] and trackers["finish"] == 1
    assert trackers["log"][0][1]["loss"] == records[0]["loss"]
    assert trackers["init"][0]["name"] == "gsm8k_math" and trackers["init"][0]["resume"] == "never"
    assert {step for key, _, step in trackers["scalars"] if key == "rollout/reward"} == {1, 2, 3}
    # A finished run says so and trains nothing; a changed config is refused, naming what changed ...
    assert main(["train", "gsm8k_math", "--model", "tiny-qwen3", "--max-steps", "3", *small]) == 0
    assert "already finished 3 steps" in capsys.readouterr().err
    assert main(["train", "gsm8k_math", "--model", "tiny-qwen3", "--max-steps", "4", *small,
                 "--rollout.group_size=2"]) == 2
    assert "rollout.group_size (4 -> 2)" in capsys.readouterr().err
    # ... unless --resume says to continue with the new values: from the checkpoint, not from scratch (smaller
    # rollouts: the point here is the resume, not the rollout size).
    assert main(["train", "gsm8k_math", "--model", "tiny-qwen3", "--max-steps", "4", "--rollout.group_size=2",
                 "--rollout.groups_per_step=1", "--rollout.max_new_tokens=16", "--resume"]) == 0
    assert "resuming runs/gsm8k_math from step 3 of 4" in capsys.readouterr().err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert latest_checkpoint(run) == step_dir(run, 4)


def test_bad_config_fails_before_loading_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "gsm8k_math", "--model", "tiny-qwen3", "--optim.lr=-1"]) == 2
    assert "optim.lr" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_compiled_frames_counts_what_either_thread_compiles():
    """The per-step `compiled_frames` metric: dynamo's frames compiled in this process, from any thread."""
    import threading

    import torch

    from agentrl.run.build import compiled_frames

    def f(x):
        return x * 2 + 1

    compiled = torch.compile(f, backend="eager", dynamic=False)
    before = compiled_frames()
    compiled(torch.ones(3))
    compiled(torch.ones(3))  # the cache serves it
    worker = threading.Thread(target=compiled, args=(torch.ones(5, 2),))  # a new shape, in another thread
    worker.start()
    worker.join()
    assert compiled_frames() - before == 2
