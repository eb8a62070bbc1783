"""Triton's autotuner called from two threads at once (the engine's and the trainer's, both into
flash-linear-attention's kernels): each call benchmarks and launches with its own arguments."""

import threading

import pytest

triton = pytest.importorskip("triton")

from triton.runtime.autotuner import Autotuner  # noqa: E402

from agentrl.autotune_lock import serialize_autotuners  # noqa: E402


class _Kernel:
    """Stands in for a compiled kernel: records the arguments of each launch."""

    def __init__(self):
        self.fn = lambda x, n, BLOCK: None  # the autotuner looks for the Python function behind a kernel
        self.launches = []

    def run(self, *args, **kwargs):
        self.launches.append((args, kwargs))
        return args[0]


def _race(run) -> tuple[list, list, _Kernel]:
    """Call A benchmarks its first config and waits (up to 1 s) for call B, of another shape, to end; then both
    finish. Returns what each thread returned or raised, in order of finishing, and the kernel."""
    a_benchmarking, b_done, finished, errors = threading.Event(), threading.Event(), [], []

    def bench(kernel_call, quantiles=None):
        kernel_call()
        if threading.current_thread().name == "A" and not a_benchmarking.is_set():
            a_benchmarking.set()
            b_done.wait(1.0)
        return [1.0, 1.0, 1.0]

    kernel = _Kernel()
    tuner = Autotuner(kernel, ["x", "n"], [triton.Config({"BLOCK": 1}), triton.Config({"BLOCK": 2})], ["n"],
                      None, None, do_bench=bench)

    def call(name, x, n):
        try:
            finished.append((name, run(tuner, x, n)))
        except Exception as exc:  # what the thread's call raised is the test's subject
            errors.append((name, f"{type(exc).__name__}: {exc}"))
        if name == "B":
            b_done.set()

    a = threading.Thread(target=call, args=("A", "a", 1), name="A")
    a.start()
    assert a_benchmarking.wait(5.0)
    b = threading.Thread(target=call, args=("B", "b", 2), name="B")
    b.start()
    a.join(10.0)
    b.join(10.0)
    return finished, errors, kernel


def test_triton_alone_loses_the_first_calls_arguments_to_the_second():
    """The failure this guards against, reproduced on Triton's own autotuner: B's call ends while A benchmarks
    and takes A's arguments with it."""
    _, errors, _ = _race(getattr(Autotuner.run, "__wrapped__", Autotuner.run))
    assert errors and errors[0][0] == "A" and "NoneType" in errors[0][1], errors


def test_serialized_calls_each_benchmark_and_launch_with_their_own_arguments():
    assert serialize_autotuners() and serialize_autotuners()  # idempotent
    finished, errors, kernel = _race(Autotuner.run)
    assert not errors, errors
    assert finished == [("A", "a"), ("B", "b")]  # B waited for A's call to end
    # Each call launched both configs while benchmarking and its best once, always with its own tensor.
    assert [args[0] for args, _ in kernel.launches] == ["a"] * 3 + ["b"] * 3
    assert {kw["BLOCK"] for args, kw in kernel.launches if args[0] == "a"} == {1, 2}
