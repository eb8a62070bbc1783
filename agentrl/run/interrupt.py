"""Ctrl-C and SIGTERM (a cluster's notice before preemption) end a run cleanly: the first signal stops it where it
stands and lets it save the last finished step; a second one exits at once.

The signal raises `Interrupted` in the main thread, except inside `critical()` sections (the optimizer update and
the version bump that must follow it, a checkpoint being written), where it is held until the section ends, so a
run never stops with half its parameters updated.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

_pending: list[int] = []  # the signal waiting for a critical section to end
# Signals raised outside a section and not yet caught by the run (`caught`). Python cannot raise into every place
# a handler may interrupt: inside a weakref callback or a finalizer the exception is printed and dropped, and the
# run would go on as if no signal had come. `raise_pending` raises such a signal again at the end of the step.
_raised: list[int] = []
_depth = [0]


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def critical(hold_past_end: bool = False):
    """Hold an interrupt until the block ends, then raise it (once: a later section does not raise it again).

    `hold_past_end`: keep holding it after the block, until `raise_pending()`. The optimizer update is such a block:
    raised at its end, the interrupt would leave its step's own bookkeeping undone (the schedule, the step count the
    checkpoint is saved under), so the run loop raises it once the step has finished."""
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1
        if _depth[0] == 0 and _pending and not hold_past_end:
            raise Interrupted(_pending.pop(0))


def raise_pending() -> None:
    """Raise an interrupt held past its section (`critical(hold_past_end=True)`), or one raised where Python
    dropped the exception (`_raised`), outside every critical section."""
    if _depth[0] == 0 and (_pending or _raised):
        raise Interrupted((_pending or _raised).pop(0))


def held() -> list[int]:
    """The signals received and not yet acted on (a rank's contribution to a run-wide stop); clear it once acted on."""
    return _pending or _raised


def caught() -> None:
    """The run caught `Interrupted`: the signal raised outside a section reached it, nothing to raise again."""
    _raised.clear()


@contextlib.contextmanager
def interrupts_stop_the_run():
    """Install the handlers for the block (main thread only; elsewhere signals keep their default)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[tuple[int, float]] = []

    def handle(signum, frame):
        # A launcher (torchrun) forwards a terminal's Ctrl-C to workers that got it already: the same signal
        # again within a second is that echo, not a second request.
        if seen and seen[0][0] == signum and time.monotonic() - seen[0][1] < 1.0:
            return
        if seen:  # the second one: no more cleaning up
            print(f"\nagentrl: {signal.Signals(signum).name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        seen.append((signum, time.monotonic()))
        print(f"\nagentrl: {signal.Signals(signum).name}: stopping after saving the last finished step "
              "(again to exit at once)", file=sys.stderr, flush=True)
        if _depth[0]:
            _pending.append(signum)
        else:
            _raised.append(signum)
            raise Interrupted(signum)

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _pending.clear()
        _raised.clear()
