"""How this project records a CUDA graph: the engine's step graphs and the trainer's forward/backward graphs alike.

`torch.cuda.graph` does two things around every capture that cost a training run more than they give it:
- `empty_cache()` hands every cached free block back to the driver. In a run the engine and the trainer share
  the device, and the next allocations of both (the trainer's eager lm_head chunks, a micro-batch of a new shape,
  the engine's eager steps) go back to `cudaMalloc`, which waits for the device.
- It leaves Python's garbage collector on. A collection during a capture that finalizes a compiled kernel
  unloads its module, and the capture in progress is invalidated (vLLM holds the collector off while capturing
  for this reason).

`record_graph` captures without the first and with the collector held off. Inside a capture, compiled code that
would compile again (a guard that fails on something the eager run before the capture did not show) runs eagerly
instead (`torch.compiler.set_stance("eager_on_recompile")`, process-wide while the capture lasts): a compile inside
a capture benchmarks inductor's kernel configs, whose synchronization invalidates the capture. Captures are in
thread-local mode: another thread's CUDA calls (a tool, the rollout driver) cannot invalidate them. Only one
capture may be under way in a process at a time: the engine's captures and the trainer's exclude each other
(`Engine.pause`, `StepLock.exclusive`).
"""

from __future__ import annotations

import gc
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

_STREAMS: dict[int, torch.cuda.Stream] = {}  # one side stream per device, as torch.cuda.graph keeps one


def record_graph(fn: Callable[[], T], pool, warmup: bool = False) -> tuple[torch.cuda.CUDAGraph, T]:
    """Record `fn`'s kernels into a graph whose memory comes from `pool`; returns the graph and what `fn` returned
    (tensors the graph's replays rewrite in place). `warmup`: run `fn` once first on the same side stream, outside
    the capture (Triton compiles its kernels and cuBLAS sets up its workspaces then, which must not happen inside
    one)."""
    device = torch.cuda.current_device()
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    if warmup:
        with torch.cuda.stream(stream):
            fn()
    torch.cuda.synchronize()  # nothing queued before the capture is still running while it records
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream), torch.compiler.set_stance("eager_on_recompile"):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
    finally:
        if collecting:
            gc.enable()
    return graph, out
