"""What a person watching a run sees: rollouts finished and in flight, generated tokens/s and an ETA, refreshed from
the first seconds (a step on a CPU can take minutes), and one line per step. On a terminal a rich bar; elsewhere
(CI logs, files) a plain line every few seconds and after each step."""

from __future__ import annotations

import json
import sys
import threading
import time


class TrainProgress:
    def __init__(self, enabled: bool, total: int, done: int, run, every_s: float | None = None):
        self.total, self.done, self.run = total, done, run
        self._tty = enabled and sys.stderr.isatty()
        self._enabled = enabled
        self._every = every_s if every_s is not None else (0.5 if self._tty else 15.0)
        self._started = time.perf_counter()
        self._steps_timed: list[float] = []
        self._generated_at_start = run.engine.stats.generated_tokens
        self._last: dict = {}
        self._bar = None
        self._stop = threading.Event()
        if self._tty:
            from rich.progress import Progress

            self._bar = Progress(*Progress.get_default_columns(), "{task.fields[info]}", transient=False)
            self._task = self._bar.add_task("train", total=total, completed=done, info="starting")
            self._bar.start()
        self._thread = None
        if enabled:
            self._thread = threading.Thread(target=self._refresh, name="agentrl-progress", daemon=True)
            self._thread.start()

    def line(self) -> str:
        """Where the run stands now, in one line."""
        driver, engine = self.run.driver, self.run.engine
        stats = driver.stats
        elapsed = time.perf_counter() - self._started
        per_s = (engine.stats.generated_tokens - self._generated_at_start) / max(elapsed, 1e-9)
        wanted = self.run.cfg.rollout.samples_per_step
        ready = driver.pool.num_samples()
        parts = [f"step {self.done}/{self.total}", f"rollouts {ready}/{wanted} ready, {stats.in_flight} in flight",
                 f"{stats.rollouts_finished} finished", f"{per_s:,.0f} gen tok/s"]
        eta = self._eta(ready, wanted)
        if eta is not None:
            parts.append(f"ETA {_duration(eta)}")
        reward = self._last.get("rollout/reward")
        if reward is not None:
            parts.append(f"reward {reward:.3f}")
        return " | ".join(parts)

    def _eta(self, ready: int, wanted: int) -> float | None:
        left = self.total - self.done
        if self._steps_timed:
            return left * sum(self._steps_timed) / len(self._steps_timed)
        finished = self.run.driver.stats.rollouts_finished
        elapsed = time.perf_counter() - self._started
        if finished == 0:
            return None
        # Before the first step ends: the pace of finishing rollouts stands for the pace of steps.
        return left * wanted * elapsed / finished

    def update(self, metrics: dict) -> None:
        self.done = metrics.get("step", self.done + 1)
        self._last = metrics
        if "seconds" in metrics:
            self._steps_timed.append(metrics["seconds"])
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=self.line())
        elif self._enabled:
            summary = {k: metrics[k] for k in ("step", "loss", "seconds") if k in metrics}
            print(json.dumps(summary | {"reward": metrics.get("rollout/reward")}), file=sys.stderr, flush=True)

    def _refresh(self) -> None:
        while not self._stop.wait(self._every):
            try:
                text = self.line()
            except Exception:  # a run being torn down; the next tick or close() ends this
                continue
            if self._bar is not None:
                self._bar.update(self._task, info=text)
            else:
                print(f"agentrl: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
