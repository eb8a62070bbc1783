"""One call at a time into each of Triton's autotuned kernels, across threads.

agentrl calls flash-linear-attention's autotuned kernels from two threads: the engine's generation thread (the
varlen prefill of hybrid models) and the trainer's. Triton's `Autotuner.run` keeps a call's arguments on the
kernel object (`self.nargs`) while it benchmarks its configs, and clears them when the call ends. A second thread's
call to the same kernel ending meanwhile leaves the first one benchmarking against `None` ("TypeError: 'NoneType'
object is not a mapping", the first step of a hybrid run on a cold kernel cache) or against the other call's
tensors. `serialize_autotuners` gives each autotuned kernel a lock around its `run`: calls to different kernels
still interleave freely, and a call waits only while another call of the same kernel launches (microseconds) or,
the first time a shape is seen, benchmarks.
"""

from __future__ import annotations

import functools
import threading

_LOCK = "_agentrl_run_lock"
_MARK = "_agentrl_serialized"
_CREATE = threading.Lock()  # creates each kernel's own lock once


def serialize_autotuners() -> bool:
    """Patch Triton's `Autotuner.run` (once per process; idempotent) so that calls into one autotuned kernel run
    one at a time. Returns False where Triton is absent."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return False
    run = Autotuner.run
    if getattr(run, _MARK, False):
        return True

    @functools.wraps(run)
    def run_alone(self, *args, **kwargs):
        lock = self.__dict__.get(_LOCK)
        if lock is None:
            with _CREATE:
                lock = self.__dict__.setdefault(_LOCK, threading.RLock())
        with lock:
            return run(self, *args, **kwargs)

    setattr(run_alone, _MARK, True)
    Autotuner.run = run_alone
    return True
