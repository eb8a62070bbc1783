"""The engine's step lock, fair to the threads that wait on it between steps.

The background engine thread holds the lock for a whole step, including the wait for the step's sampled tokens
(most of its time on a GPU), and takes it again a few microseconds after letting go. A plain lock has no queue:
another thread blocked in `acquire()` (the trainer entering `Engine.pause()` for its optimizer step, or reading
`Engine.stats`) is woken when the lock is released, but by the time the OS schedules it and it gets the GIL back,
the engine thread has usually taken the lock again. Such a waiter can lose for many steps in a row.

Here a thread from outside first says it is waiting (`outside()`), and the engine thread, before each step it
starts on its own (`yield_to_outside()`), lets every such thread through first. The engine's own re-entry and the
foreground drive mode (its owner calling `step()`) take the lock as before.
"""

from __future__ import annotations

import contextlib
import threading
import time


class StepLock:
    def __init__(self):
        self._lock = threading.RLock()
        self._waiters = threading.Condition(threading.Lock())
        self._waiting = 0
        self.wait_seconds = 0.0  # summed time outside threads waited for a step to end

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def outside(self):
        """Hold the lock from a thread other than the engine's: queued ahead of the engine's next step."""
        t = time.perf_counter()
        with self._waiters:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._waiters:
                self._waiting -= 1
                self._waiters.notify_all()
        try:
            self.wait_seconds += time.perf_counter() - t
            yield
        finally:
            self._lock.release()

    def yield_to_outside(self, timeout: float = 1.0) -> None:
        """The engine thread, between steps: wait until every thread already waiting in `outside()` holds the lock
        (it then waits on the lock itself, as before). `timeout` bounds one wait so a stop request is seen."""
        if not self._waiting:  # the common case, read without the condition's lock (an int read is atomic)
            return
        with self._waiters:
            self._waiters.wait_for(lambda: not self._waiting, timeout)
