"""Tests that run in child processes: Triton's interpreter (a child started with `TRITON_INTERPRET=1` runs a test
file's kernels on the CPU) and children started ahead of the tests that wait on them (`AHEAD`). Test files import
from here and from `tests.helpers`, never from each other.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # this process runs Triton kernels in the interpreter


def interpreter_child(test_file: str, *pytest_args: str) -> "Child":
    """`test_file`'s tests again in a child pytest with TRITON_INTERPRET=1, which must be set before triton is first
    imported (so not in this process); `run_child` runs it, and the test fails with the child's output unless they
    pass."""
    root = Path(test_file).resolve().parents[2]
    cmd = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, test_file)
    return Child(cmd, root, (("TRITON_INTERPRET", "1"),), timeout_s=600)


def run_in_interpreter(child: "Child") -> None:
    run = run_child(child)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]


# ------------------------------------------------------------------------------ children started ahead
#
# A few tests only wait on a child process of one thread (the Triton interpreter's runs, a minute of CPU and more
# between them) while the rest of the suite runs on one core of the 2-core CI box. Marked `@pytest.mark.child(C)`,
# such a child is started when the session's tests are collected, on a thread of this process, one child after the
# other in the tests' order: it runs on the second core while the tests before its own do, and its test then only
# reads what it left. A test whose child was not started ahead (another selection) runs it itself.


class Child(NamedTuple):
    cmd: tuple[str, ...]
    cwd: Path  # made if missing
    env: tuple[tuple[str, str], ...] = ()  # set on top of this process's environment
    timeout_s: float = 300


class _Ahead:
    def __init__(self):
        self.results: dict[Child, subprocess.CompletedProcess | BaseException] = {}
        self.started: dict[Child, threading.Event] = {}
        self.running: set[subprocess.Popen] = set()
        self.stopping = False
        self.lock = threading.Lock()

    def start(self, children: list[Child]) -> None:
        children = [c for c in dict.fromkeys(children) if c not in self.started]
        if not children:
            return
        for child in children:
            self.started[child] = threading.Event()
        # The environment as it is now: a test running beside a child may change os.environ for its own time.
        environ = dict(os.environ)
        threading.Thread(target=self._run_all, args=(children, environ), name="children-ahead", daemon=True).start()

    def _run_all(self, children: list[Child], environ: dict[str, str]) -> None:
        for child in children:
            try:
                self.results[child] = self._run(child, environ)
            except BaseException as exc:  # handed to the test that waits on it
                self.results[child] = exc
            self.started[child].set()

    def _run(self, child: Child, environ: dict[str, str]) -> subprocess.CompletedProcess:
        with self.lock:
            if self.stopping:
                raise RuntimeError("the session ended before this child ran")
            Path(child.cwd).mkdir(parents=True, exist_ok=True)
            proc = subprocess.Popen(child.cmd, cwd=child.cwd, env={**environ, **dict(child.env)},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            # Below the tests in priority: a few of them bound wall time (a tool's cancel, a fresh start) and must
            # not wait on a child for the core.
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, proc.pid, 10)
            self.running.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=child.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\n(killed after {child.timeout_s} s)"
        finally:
            with self.lock:
                self.running.discard(proc)
        return subprocess.CompletedProcess(child.cmd, proc.returncode, stdout, stderr)

    def result(self, child: Child) -> subprocess.CompletedProcess:
        if child not in self.started:
            return self._run(child, dict(os.environ))
        self.started[child].wait()
        outcome = self.results[child]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            for proc in self.running:
                if proc.poll() is None:
                    proc.kill()


AHEAD = _Ahead()


def run_child(child: Child) -> subprocess.CompletedProcess:
    """`child`'s completed run: the one started ahead of its test, or one run now."""
    return AHEAD.result(child)


def patch_triton_interpreter():
    """Two gaps of the Triton 3.6 interpreter that the GPU compiler does not have:
    - scalars are 1-element arrays, and numpy >= 2.4 refuses int() on them, which breaks `range(start, end)`
      over loaded bounds (triton-lang/triton#9171);
    - bf16 is held as raw uint16, and its dot multiplies those integers; widen bf16 operands to fp32 first.
    Both patches only change interpreted runs, and only in the child process."""
    import numpy as np
    import triton
    from triton.runtime import interpreter as interp

    original_patch = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    original_dot = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(x):
            if x.dtype == triton.language.bfloat16:
                return interp.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), triton.language.float32)
            return x

        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interp._patch_lang_tensor = patch_lang_tensor
    interp.InterpreterBuilder.create_dot = create_dot



def interpret_fla(monkeypatch) -> None:
    """flash-linear-attention's kernels in Triton's interpreter (a child with TRITON_INTERPRET=1): the interpreter's
    gaps patched (`patch_triton_interpreter`), `range` as fla's kernels expect it, and each autotuned kernel on its
    first config (the interpreter has no benchmarker to choose among configs)."""
    from triton.runtime.autotuner import Autotuner

    patch_triton_interpreter()
    _builtin_range_as_tensors(monkeypatch)
    run = Autotuner.run

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", first_config)


def _builtin_range_as_tensors(monkeypatch):
    """Triton's interpreter hands a kernel's `for i in range(n)` Python ints, on which fla's kernels call `.to()`
    (compiled, they are tensors): each interpreted kernel here sees a `range` that yields interpreter scalars."""
    import builtins
    import types

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def scalar_range(*bounds):
        ints = [int(np.asarray(b.handle.data).reshape(-1)[0]) if hasattr(b, "handle") else int(b) for b in bounds]
        for i in builtins.range(*ints):
            yield tl.tensor(interpreter.TensorHandle(np.array(i, dtype=np.int32), tl.int32), tl.int32)

    init = interpreter.GridExecutor.__init__

    def with_scalar_range(self, fn, *args, **kwargs):
        fn2 = types.FunctionType(fn.__code__, {**fn.__globals__, "range": scalar_range}, fn.__name__, fn.__defaults__,
                                 fn.__closure__)
        fn2.__annotations__, fn2.__kwdefaults__ = fn.__annotations__, fn.__kwdefaults__
        init(self, fn2, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__init__", with_scalar_range)
