"""`train(cfg)`: build a run, step it, log each step, checkpoint, and write the final model."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

from agentrl.run.build import build_run, checkpoint_extra, start, step, stop
from agentrl.run.config import TrainConfig
from agentrl.train.checkpoint import save_checkpoint
from agentrl.train.tracking import MetricsLog, Trackers


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    run = build_run(cfg)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "config.yaml").write_text(cfg.to_yaml())
    trackers = Trackers(cfg.metrics.report_to, run.run_dir, cfg.metrics.project, asdict(cfg), run.resumed)
    log = MetricsLog(run.run_dir / "metrics.jsonl", resume=run.resumed, trackers=trackers)
    bar = _Progress(progress, cfg.steps, run.start_step)
    last: dict = {}
    start(run)
    try:
        for index in range(run.start_step, cfg.steps):
            last = {"step": index + 1, **step(run)}
            if index % cfg.metrics.log_every == 0 or index + 1 == cfg.steps:
                log.write(last)
            bar.update(last)
            out_of_time = cfg.time_limit_s is not None and time.perf_counter() - run.started > cfg.time_limit_s
            saving = cfg.checkpoint.save_every and (index + 1) % cfg.checkpoint.save_every == 0
            if saving or index + 1 == cfg.steps or out_of_time:
                with run.engine.pause():
                    save_checkpoint(run.run_dir, index + 1, run.model, run.trainer.optimizer, run.trainer.scheduler,
                                    keep_last=cfg.checkpoint.keep_last, extra=checkpoint_extra(run))
            if out_of_time:
                break
        with run.engine.pause():
            # A plain model directory beside the checkpoints: what `agentrl eval --model` and users load.
            run.model.save_pretrained(run.run_dir / "final")
            run.tokenizer.save_pretrained(run.run_dir / "final")
    finally:
        stop(run)
        log.close()
        bar.close()
    return last


class _Progress:
    def __init__(self, enabled: bool, total: int, done: int):
        self._bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import Progress

            self._bar = Progress(*Progress.get_default_columns(), "{task.fields[info]}", transient=False)
            self._task = self._bar.add_task("train", total=total, completed=done, info="")
            self._bar.start()

    def update(self, m: dict) -> None:
        if self._bar is not None:
            info = f"reward {m.get('rollout/reward', 0):.3f} tools {m.get('rollout/tool_call_rate', 0):.2f}"
            self._bar.update(self._task, advance=1, info=info)
        else:
            print(json.dumps({k: m[k] for k in ("step", "loss", "seconds") if k in m}
                             | {"reward": m.get("rollout/reward")}), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
