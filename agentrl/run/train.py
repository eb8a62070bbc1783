"""`train(cfg)`: plan the run directory, build the run, step it, log each step, checkpoint, write the final model.

A run stops cleanly on Ctrl-C / SIGTERM (`agentrl.run.interrupt`): the last finished step is checkpointed and one
line says how to resume. On several processes (`agentrl.run.distributed`) rank 0 alone writes files and prints,
and the ranks stop together at the end of a step.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

from agentrl.run.build import build_run, checkpoint_extra, start, step, stop
from agentrl.run.config import TrainConfig
from agentrl.run.distributed import ParallelRun, interrupt_hold, main_process
from agentrl.run.interrupt import Interrupted, caught, critical, interrupts_stop_the_run, raise_pending
from agentrl.run.progress import TrainProgress
from agentrl.run.replay import SampleLog
from agentrl.run.run_dir import Plan, clear_run, cut_metrics, plan_run, write_atomic, write_directory_atomic
from agentrl.train.checkpoint import latest_checkpoint, save_checkpoint, step_dir
from agentrl.train.tracking import MetricsLog, Trackers


def train(cfg: TrainConfig, *, progress: bool = True, plan: Plan | None = None) -> dict:
    """Train to `cfg.steps`; returns the last step's metrics. Raises `Interrupted` (after saving) on a signal."""
    plan = plan if plan is not None else plan_run(cfg)
    if plan.message and main_process():
        print(plan.message, file=sys.stderr, flush=True)
    if plan.action == "finished":
        return {}
    with interrupts_stop_the_run():
        return _train(cfg, plan, progress)


def _train(cfg: TrainConfig, plan: Plan, progress: bool) -> dict:
    parallel = ParallelRun.setup(cfg)  # None for a single process
    main = parallel is None or parallel.is_main
    if plan.action == "fresh" and main:
        clear_run(Path(cfg.checkpoint.run_dir))
    if parallel is not None:
        parallel.barrier()  # every rank has planned before rank 0 clears, and builds after
    run = build_run(cfg, "latest" if plan.action == "resume" else None, parallel)
    metrics_path = run.run_dir / "metrics.jsonl"
    log = None
    if main:
        write_atomic(run.run_dir / "config.yaml", cfg.to_yaml())
        if run.resumed:
            cut_metrics(metrics_path, run.start_step)
        trackers = Trackers(cfg.metrics.report_to, run.run_dir, cfg.metrics.project, asdict(cfg), run.resumed)
        log = MetricsLog(metrics_path, resume=run.resumed, trackers=trackers)
        if cfg.metrics.log_samples:
            run.sample_log = SampleLog(run.run_dir, run.start_step if run.resumed else None)
    bar = TrainProgress(progress and main, cfg.steps, run.start_step, run)
    last: dict = {}
    done = run.start_step  # the last step whose update finished
    finished = False
    start(run)
    try:
        with interrupt_hold(parallel):
            for index in range(run.start_step, cfg.steps):
                last = {"step": index + 1, **step(run)}
                done = index + 1
                if log is not None and (index % cfg.metrics.log_every == 0 or done == cfg.steps):
                    log.write(last)
                bar.update(last)
                raise_pending()  # a signal held through this step's update stops the run now, the step counted
                out_of_time = cfg.time_limit_s is not None and time.perf_counter() - run.started > cfg.time_limit_s
                if parallel is not None:
                    out_of_time = parallel.stop_together(out_of_time)
                saving = cfg.checkpoint.save_every and done % cfg.checkpoint.save_every == 0
                if saving or done == cfg.steps or out_of_time:
                    _save(run, done)
                if out_of_time:
                    break
            _write_final(run)
        finished = True
    except Interrupted:
        caught()
        bar.close()
        stop(run)  # no new rollouts; the unfinished ones are dropped (their prompts were never marked consumed)
        if done > run.start_step and latest_checkpoint(run.run_dir) != step_dir(run.run_dir, done):
            _save(run, done)
        where = latest_checkpoint(run.run_dir)
        saved = f"step {done} is saved in {where}" if where is not None else "no step finished, nothing to save"
        if main:
            print(f"agentrl: stopped; {saved}; run the same command to resume", file=sys.stderr, flush=True)
        raise
    finally:
        stop(run)
        if log is not None:
            log.close()
        bar.close()
        if parallel is not None:
            parallel.close(finished)
    return last


def _save(run, done: int) -> None:
    with critical(), run.engine.pause():
        options = run.parallel.save_options(run.model) if run.parallel is not None else {}
        save_checkpoint(run.run_dir, done, run.model, run.trainer.optimizer, run.trainer.scheduler,
                        keep_last=run.cfg.checkpoint.keep_last, extra=checkpoint_extra(run), **options)


def _write_final(run) -> None:
    """A plain model directory beside the checkpoints: what `agentrl eval --model` and users load (on several
    processes: the whole model, gathered, written by rank 0)."""
    parallel = run.parallel
    with critical(), run.engine.pause():
        state = parallel.model_state(run.model) if parallel is not None else None
        if parallel is None or parallel.is_main:
            def write_final(tmp):
                run.model.save_pretrained(tmp, **({"state_dict": state} if state is not None else {}))
                run.tokenizer.save_pretrained(tmp)

            write_directory_atomic(run.run_dir / "final", write_final)
        if parallel is not None:
            parallel.barrier()
