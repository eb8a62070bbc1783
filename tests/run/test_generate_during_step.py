"""`generate_during_step=false`: the background engine takes no step while the trainer steps (forward, backward and
update), and generation goes on between steps."""

import threading

from agentrl.cli import main
from agentrl.engine.engine import Engine
from agentrl.train.trainer import Trainer

SMALL = ["--model", "tiny-qwen3", "--rollout.group_size=2", "--rollout.groups_per_step=2",
         "--rollout.max_new_tokens=8", "--rollout.max_turns=2", "--rollout.rollouts_in_flight=4"]


def test_the_engine_waits_through_the_whole_trainer_step(tmp_path, monkeypatch):
    training = threading.Event()
    engine_steps_while_training: list[bool] = []
    trainer_step, launch = Trainer.step, Engine._launch

    def step(self, *args, **kwargs):
        training.set()
        try:
            return trainer_step(self, *args, **kwargs)
        finally:
            training.clear()

    def counted(self, *args, **kwargs):  # inside the engine's step lock: a step that runs, not one that waits
        engine_steps_while_training.append(training.is_set())
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(Engine, "_launch", counted)
    assert main(["train", "gsm8k_math", *SMALL, "--max-steps", "3", "--generate_during_step=false",
                 "--run-dir", str(tmp_path / "run")]) == 0
    assert len(engine_steps_while_training) > 10  # generation ran (between the steps)
    assert not any(engine_steps_while_training)


def test_by_default_the_trainer_step_runs_beside_the_engine_after_the_first(tmp_path, monkeypatch):
    """With generation during the step (the default), the trainer's step is work beside the engine, so the engine
    captures no CUDA graph inside it (tests/engine/test_capture_exclusion.py). The process's first step, where the
    trainer's layers compile, runs with the engine paused: a compile's tracing patches `Module.__call__` for every
    thread, and an engine step calling compiled layers meanwhile fails."""
    engines, beside = [], []
    training = threading.Event()
    engine_steps_while_training: list[bool] = []
    init, trainer_step, launch = Engine.__init__, Trainer.step, Engine._launch

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self)

    def step(self, *args, **kwargs):
        beside.append(engines[0]._lock._beside)
        training.set()
        try:
            return trainer_step(self, *args, **kwargs)
        finally:
            training.clear()

    def counted(self, *args, **kwargs):
        if beside:
            engine_steps_while_training.append((len(beside), training.is_set()))
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", tracked)
    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(Engine, "_launch", counted)
    assert main(["train", "gsm8k_math", *SMALL, "--max-steps", "3", "--run-dir", str(tmp_path / "run")]) == 0
    assert len(engines) == 1 and beside == [0, 1, 1]
    assert not any(busy for step, busy in engine_steps_while_training if step == 1)
