"""Which thread compiled, and for how long: torch.compile's compile windows, attributed to the thread that opened them.

In training two threads run compiled code, the trainer's (the main thread) and the engine's (`agentrl-engine`), and
a compile in either makes a step slow. dynamo's frame counter cannot say whose compile it was. Its compile
callbacks can: a window opens when a compile starts while no other is running, in the thread that starts it, and
closes when the last one running ends. A compile that starts inside another thread's window is counted in that
window, so while both threads compile at once the seconds go to the thread that began first.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

_lock = threading.Lock()
_seconds: Counter = Counter()  # thread name -> seconds inside compile windows it opened
_open: list = []  # [thread name, start] of the window now open, if any


def _start(_args) -> None:
    with _lock:
        _open[:] = [threading.current_thread().name, time.perf_counter()]


def _end(_args) -> None:
    with _lock:
        if _open:
            name, started = _open
            _seconds[name] += time.perf_counter() - started
            _open.clear()


def install() -> bool:
    """Start attributing compile windows; False where this torch has no compile callbacks. Idempotent, and safe to
    call again after `torch._dynamo.reset()`, which drops every registered callback."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return False
    with _lock:
        if _start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_start)
            callback_handler.register_end_callback(_end)
    return True


def compile_seconds() -> dict[str, float]:
    """Seconds spent compiling so far, by the name of the thread that opened each window."""
    with _lock:
        return dict(_seconds)


def since(before: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """What `compile_seconds()` gained since `before` (threads that compiled nothing left out), and its value now
    (the next call's `before`)."""
    now = compile_seconds()
    return {name: s - before.get(name, 0.0) for name, s in now.items() if s - before.get(name, 0.0) > 0}, now
