"""The engine's background drive mode: a daemon thread that steps the engine while it has work (`Engine.start()`).

Its completions reach their callbacks, or `results()` for requests submitted without one; an exception in the thread
is kept and raised by `check()` and `get_completion()` in whoever waits, since a dead thread calls no callback again.
Between steps the thread lets in any thread waiting on the step lock (`step_lock.py`), and it sleeps on `_wake` while
there is nothing to run or the KV pool is released.
"""

from __future__ import annotations

import queue
import threading
import time

from agentrl.engine.types import Completion


class BackgroundMode:
    """Mixed into `Engine`: uses its `_step()`, `has_work()`, `_lock`, `_stream`, `_released`, `_stats` and `tp`."""

    def _init_background(self) -> None:
        self._results: queue.Queue = queue.Queue()
        self._wake = threading.Event()  # set by submit, cancel, restore_kv and stop
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None

    @property
    def running_in_background(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.tp is not None:
            raise RuntimeError("a tensor-parallel engine is stepped by its owner (`step()`), never beside the "
                               "training step: NCCL needs every rank's collectives in one host order")
        if self.running_in_background:
            return
        self._stopping = False
        self._error = None
        # A daemon thread: a non-daemon one is joined before atexit hooks run, so a script that forgot
        # stop() would never exit.
        self._thread = threading.Thread(target=self._loop, name="agentrl-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread after its current step; unfinished requests stay queued."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._stream.hand_back()

    def _loop(self) -> None:
        with self._stream.running():
            self._run_loop()

    def _run_loop(self) -> None:
        try:
            while not self._stopping:
                if self._released or not self.has_work():
                    t = time.perf_counter()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    self._stats.idle_seconds += time.perf_counter() - t
                    continue
                self._lock.yield_to_outside()
                for completion, has_callback in self._step():
                    if not has_callback:
                        self._results.put(completion)
        except BaseException as exc:  # surfaced to whoever waits on results
            self._error = exc
            self._results.put(exc)

    def check(self) -> None:
        """Raise if the background thread failed (with its exception as the cause). Whoever waits on requests
        submitted with a callback must call this now and then: a dead thread calls no callback again."""
        if self._error is not None:
            raise RuntimeError("the engine thread failed") from self._error

    def results(self) -> queue.Queue:
        """Completions of requests submitted without a callback (background mode, or left over by generate)."""
        return self._results

    def get_completion(self, timeout: float | None = None) -> Completion:
        item = self._results.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise RuntimeError("the engine thread failed") from item
        return item
