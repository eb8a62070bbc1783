"""The background engine's own CUDA stream (`EngineConfig.separate_stream`).

In a training run the engine thread decodes beside the trainer thread on one GPU. On one stream their kernels
queue behind each other: a decode step waits for whatever forward or backward kernels the trainer queued before it,
the trainer's next kernels wait behind the step's graph, and the engine's wait for its sampled tokens waits for the
trainer's work too. On two streams the GPU may run them side by side, which matters where neither fills the GPU on
its own (small models, whose steps are bound by launching kernels).

What must stay ordered is what the two threads share: the parameters (read by both, written by the optimizer inside
`Engine.pause()`) and the engine's KV and state memory (released and restored from the trainer's thread). Every
entry from another thread into that memory goes through `joined()`: the caller's stream first waits for the engine's
queued work (no write lands while a decode step still reads), and the engine's stream then waits for the caller's
(the next decode step reads the updated parameters). Off CUDA, or when not asked for, every method is a no-op.
"""

from __future__ import annotations

import contextlib

import torch


class EngineStream:
    def __init__(self, device: torch.device, enabled: bool):
        self.device = device
        self.stream = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None

    @contextlib.contextmanager
    def running(self):
        """The engine thread's body: its kernels go to the engine's stream, after what the starting thread queued
        (the weights' initialisation, a checkpoint's load)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def joined(self):
        """Another thread's access to what the engine's queued work reads or writes (hold the engine's lock)."""
        if self.stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        caller.wait_stream(self.stream)
        try:
            yield
        finally:
            self.stream.wait_stream(caller)

    def hand_back(self) -> None:
        """After the engine thread stopped: the caller's stream waits for the engine's last work, so what the caller
        runs next (an eval on the same engine, a save) sees it finished."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
