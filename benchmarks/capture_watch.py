"""What a failing CUDA-graph capture did first, for a benchmark that asks (`watch_captures()`).

A capture that meets a call CUDA forbids while a stream records (a host sync, an event query) is invalidated, and
the error usually surfaces later, at an innocent call ("operation failed due to a previous error during capture"),
or never, where the forbidden call's own error is caught (an autotuner benchmarking a kernel for the first time).
Inside `watch_captures()`:
- every synchronizing call made through torch's Python API while the current stream captures prints its stack;
- dynamo logs each recompile with the guard that failed (a recompile inside a capture runs new kernels there);
- the trainer's failed capture logs its whole traceback (`agentrl.train.flat_graphs`, at debug level).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback

import torch


def _watched(owner, name: str):
    original = getattr(owner, name)

    def call(*args, **kwargs):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            print(f"--- capture_watch: {owner.__name__}.{name} while a stream captures, from:", file=sys.stderr)
            traceback.print_stack(limit=25, file=sys.stderr)
        return original(*args, **kwargs)

    return original, call


@contextlib.contextmanager
def watch_captures():
    targets = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Event, "query"),
               (torch.cuda.Event, "elapsed_time"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Stream, "query")]
    saved = []
    for owner, name in targets:
        original, call = _watched(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, call)
    logger = logging.getLogger("agentrl.train.flat_graphs")
    handler = logging.StreamHandler(sys.stderr)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    torch._logging.set_logs(recompiles=True)
    try:
        yield
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)
        logger.setLevel(level)
        for owner, name, original in saved:
            setattr(owner, name, original)
