"""Driving the engine by hand for the benchmarks: a timed pass over a set of prompts (`drive`), what each engine step
of it was and took (`step_kind`, `step_table`), and the GPU kernels of a pass's first prefill steps and of a few
pure-decode steps, by kind (`profile_decode`).
Used by benchmarks/hybrid.py; any model the engine serves works.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from benchmarks.hybrid_train import sync

@dataclass
class Pass:
    completions: list  # the finished ones, in submission order
    generated: int  # tokens generated (a stopped pass counts what it had)
    seconds: float
    prefill_s: float | None  # until every request had its first token (None: not reached)
    stopped: bool  # hit the time limit
    prefilled: int  # tokens run through prefill chunks


def drive(engine, prompts, sampling, limit_s: float, step_log: list | None = None) -> Pass:
    """Submit `prompts` and step the engine by hand until every one finishes or `limit_s` passes (then the rest are
    cancelled and drained, untimed). The prefill phase ends when every request has its first token. `step_log`, if
    given, gets one `(seconds, kind)` per step (`step_kind`)."""
    device = engine.device
    before = engine.stats
    sync(device)
    start = time.perf_counter()
    ids = [engine.submit(p, sampling) for p in prompts]
    done, prefill_s, stopped = {}, None, False
    while len(done) < len(ids):
        t, s0 = time.perf_counter(), engine.stats if step_log is not None else None
        for c in engine.step():
            done[c.request_id] = c
        if step_log is not None:
            step_log.append((time.perf_counter() - t, step_kind(s0, engine.stats)))
        if prefill_s is None and len(engine._live) + len(done) == len(ids) and all(
                s.logprobs for s in engine._live.values()):
            sync(device)
            prefill_s = time.perf_counter() - start
        if time.perf_counter() - start > limit_s:
            stopped = True
            break
    sync(device)
    seconds = time.perf_counter() - start
    after = engine.stats
    if stopped:
        for i in ids:
            if i not in done:
                engine.cancel(i)
        while engine.has_work():
            engine.step()
    return Pass([done[i] for i in ids if i in done], after.generated_tokens - before.generated_tokens, seconds,
                prefill_s, stopped, after.prefilled_tokens - before.prefilled_tokens)


def greedy(new_tokens: int):
    from agentrl.engine import SamplingParams

    return SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def step_kind(before, after) -> str:
    """What one engine step was, from the stats around it: a graph replay or an eager step, and whether it took state
    snapshots."""
    kind = "graph" if after.graph_steps > before.graph_steps else (
        "eager decode" if after.decode_steps > before.decode_steps and after.prefilled_tokens == before.prefilled_tokens
        else "prefill")
    return kind + (" + snapshots" if after.snapshots_taken > before.snapshots_taken else "")


def step_table(step_log: list) -> None:
    """Where the timed pass's wall time went, by kind of step: count, total, median and slowest."""
    print(f"\n#### Engine steps of the timed pass ({len(step_log)} steps, {sum(t for t, _ in step_log):.2f} s)\n")
    print("| kind | steps | total s | median ms | max ms |\n|---|---|---|---|---|")
    for kind in sorted({k for _, k in step_log}):
        ts = [t for t, k in step_log if k == kind]
        print(f"| {kind} | {len(ts)} | {sum(ts):.2f} | {statistics.median(ts) * 1e3:.1f} | {max(ts) * 1e3:.1f} |")
    print("first 12 steps (ms, kind): " + ", ".join(f"{t * 1e3:.0f} {k}" for t, k in step_log[:12]), flush=True)


def profile_decode(engine, prompts, new_tokens: int, steps: int = 8) -> None:
    """The GPU kernels of the first two steps of a pass (prompts being prefilled, their state snapshots taken), then
    of `steps` pure-decode steps (every prompt prefilled first), by kind and by kernel: where a prefill
    step and a decode step of the hybrid go."""
    ids = [engine.submit(p, greedy(new_tokens)) for p in prompts]
    _profiled(engine, 2, "the pass's first 2 steps (prefill, state snapshots)")
    while not (len(engine._live) == len(ids) and all(s.logprobs for s in engine._live.values())):
        engine.step()
    for _ in range(2):
        engine.step()
    _profiled(engine, steps, f"{steps} decode steps of {len(ids)} sequences")
    for i in ids:
        engine.cancel(i)
    while engine.has_work():
        engine.step()


def _profiled(engine, steps: int, what: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.kernel_profile import kernel_kinds, kernel_ms

    sync(engine.device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync(engine.device)
    wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    print(f"\n#### Profile: {what}: {wall * 1e3:.1f} ms a step of wall time (profiled), "
          f"{kernel_ms(events) / steps:.2f} ms of kernels a step\n")
    print(" | ".join(f"{kind} {ms / steps:.2f} ms" for kind, ms in kernel_kinds(events)))
    print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=70))
