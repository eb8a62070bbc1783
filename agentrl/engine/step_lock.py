"""The engine's step lock, fair to the threads that wait on it between steps.

The background engine thread holds the lock for a whole step, including the wait for the step's sampled tokens
(most of its time on a GPU), and takes it again a few microseconds after letting go. A plain lock has no queue:
another thread blocked in `acquire()` (the trainer entering `Engine.pause()` for its optimizer step, or reading
`Engine.stats`) is woken when the lock is released, but by the time the OS schedules it and it gets the GIL back,
the engine thread has usually taken the lock again. Such a waiter can lose for many steps in a row.

Here a thread from outside first says it is waiting (`outside()`), and the engine thread, before each step it
starts on its own (`yield_to_outside()`), lets every such thread through first. The engine's own re-entry and the
foreground drive mode (its owner calling `step()`) take the lock as before.

The lock also keeps CUDA-graph captures apart from other threads' GPU work. While the engine thread captures a
graph, a kernel, allocation or synchronisation from the trainer's thread can invalidate the capture (and fail
itself: "operation not permitted when stream is capturing"), which takes the run down. A thread that works on the
GPU beside the engine's steps says so (`beside()`); a capture (`exclusive()`) waits until no such thread works and
keeps new ones out until it ends. A thread beside leaves that state while it waits for or holds the lock
(`outside()`): the engine steps no more then, and waiting in both would deadlock against a capture that waits for it.
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
        self._gpu = threading.Condition(threading.Lock())
        self._beside = 0  # beside() depth summed over the threads working on the GPU beside the engine
        self._capturing = 0  # the engine thread's nested exclusive() depth
        self._mine = threading.local()  # this thread's beside() depth
        self.capture_wait_seconds = 0.0  # summed time captures waited for work beside to end

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def outside(self):
        """Hold the lock from a thread other than the engine's: queued ahead of the engine's next step."""
        with self._not_beside():
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

    # -- work beside the engine's steps, and graph captures -----------------------------------------------
    @contextlib.contextmanager
    def beside(self):
        """GPU work from a thread other than the engine's while the engine keeps stepping (the trainer's forward
        and backward): no graph capture runs meanwhile."""
        self._enter_beside()
        try:
            yield
        finally:
            self._leave_beside()

    @contextlib.contextmanager
    def exclusive(self):
        """The engine thread, around a graph capture: once no other thread works beside, and none starts."""
        mine = getattr(self._mine, "depth", 0)  # a foreground owner's own work beside is not another thread's
        t = time.perf_counter()
        with self._gpu:
            self._capturing += 1
            self._gpu.wait_for(lambda: self._beside == mine)
        self.capture_wait_seconds += time.perf_counter() - t
        try:
            yield
        finally:
            with self._gpu:
                self._capturing -= 1
                self._gpu.notify_all()

    def _enter_beside(self, depth: int = 1) -> None:
        mine = getattr(self._mine, "depth", 0)
        with self._gpu:
            if not mine:  # a nested entry must not wait on a capture that waits for this thread
                self._gpu.wait_for(lambda: not self._capturing)
            self._beside += depth
        self._mine.depth = mine + depth

    def _leave_beside(self, depth: int = 1) -> None:
        self._mine.depth -= depth
        with self._gpu:
            self._beside -= depth
            self._gpu.notify_all()

    @contextlib.contextmanager
    def _not_beside(self):
        """This thread out of its beside() state for the block, however deeply nested it was."""
        depth = getattr(self._mine, "depth", 0)
        if not depth:
            yield
            return
        self._leave_beside(depth)
        try:
            yield
        finally:
            self._enter_beside(depth)
