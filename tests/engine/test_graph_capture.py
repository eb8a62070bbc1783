"""`record_graph` (how the engine and the trainer record CUDA graphs), with torch.cuda's graph and stream calls
stood in by recorders: the capture brackets `fn` in thread-local mode on a side stream, Python's collector is off
exactly while it records and back on after (also when `fn` raises), and the allocator's cache is left alone.
The real captures run in the GPU tests (tests/train/test_flat_graphs_gpu.py, tests/engine/test_engine_gpu.py)."""

import contextlib
import gc

import pytest
import torch

from agentrl import graph_capture


class FakeGraph:
    def __init__(self, log):
        self.log = log

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.log.append(("begin", pool, capture_error_mode, gc.isenabled()))

    def capture_end(self):
        self.log.append(("end", gc.isenabled()))


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))


@pytest.fixture
def cuda(monkeypatch):
    log = []
    main = FakeStream(log, "main")
    current = [main]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(graph_capture, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: FakeStream(log, "side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append(("synchronize",)))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeGraph(log))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append(("empty_cache",)))
    return log, current


def test_the_capture_brackets_fn_on_a_side_stream_with_the_collector_off(cuda):
    log, current = cuda
    assert gc.isenabled()
    seen = []

    def fn():
        seen.append((current[-1].name, gc.isenabled()))
        return "out"

    graph, out = graph_capture.record_graph(fn, pool="pool")
    assert out == "out" and isinstance(graph, FakeGraph)
    assert seen == [("side", False)]  # recorded on the side stream, no collection can run inside
    assert log == [("wait", "side", "main"), ("synchronize",), ("begin", "pool", "thread_local", False),
                   ("end", False), ("wait", "main", "side")]  # and no empty_cache
    assert gc.isenabled()
    log.clear()
    graph_capture.record_graph(fn, pool=None, warmup=True)  # the warm-up run: same side stream, before the capture
    assert seen[1:] == [("side", True), ("side", False)] and log.index(("synchronize",)) < log.index(
        ("begin", None, "thread_local", False))
    assert len(graph_capture._STREAMS) == 1  # one side stream per device, reused


def test_a_failing_capture_ends_and_gives_the_collector_back(cuda):
    log, _ = cuda

    def fn():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="capturing"):
        graph_capture.record_graph(fn, pool=None)
    assert log[-1] == ("end", False) and gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(cuda):
    gc.disable()
    try:
        graph_capture.record_graph(lambda: None, pool=None)
        assert not gc.isenabled()
    finally:
        gc.enable()
