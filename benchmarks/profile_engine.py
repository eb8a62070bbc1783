"""Where a decode step of the engine spends its time: host phases, GPU kernels, and the gap between them.

Runs the throughput benchmark's workload (Qwen3-0.6B shape, random bf16 weights, 512 prompts of 256 tokens),
steps the engine by hand until every sequence decodes, then
- times 20 pure-decode steps: wall time per step, and the host time of each phase (scheduling, the graph
  replay call, sampling + the one sync, bookkeeping after it), by wrapping the engine's own methods;
- profiles 5 more steps with torch.profiler and prints the kernels by total GPU time.
GPU busy time per step well below wall time means the GPU waits on the host; the opposite points at kernels.

With `--turn2` it profiles instead the multi-turn case of benchmarks/engine.py (256 x 1024 -> 64, then + 64 tool
tokens): the prefill phase of turn 2 (prefix cache on) beside the same new tokens submitted alone, step by step
with host phase times and the kernels of each.

usage: python benchmarks/profile_engine.py [--seqs 512] [--prompt 256] [--trace out.json] [--turn2]
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `benchmarks` and `agentrl`
from benchmarks.kernel_profile import kernel_ms  # noqa: E402


def wrap_timer(obj, name, totals):
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t

    setattr(obj, name, timed)


def prefill_phase(engine, prompts, sampling, label):
    """Submit `prompts` and step until each has its first token: wall ms and host phase ms of every step, then
    the kernels of the whole phase. Finishes the requests afterwards (unprofiled)."""
    from torch.profiler import ProfilerActivity, profile

    totals = collections.Counter()
    originals = {}
    for obj, name in ((engine.scheduler, "schedule"), (engine.scheduler, "register"), (engine, "_launch"),
                      (engine, "_complete_in_flight"), (engine, "_drain_inbox")):
        originals[(obj, name)] = getattr(obj, name)
        wrap_timer(obj, name, totals)
    torch.cuda.synchronize()
    ids = [engine.submit(p, sampling) for p in prompts]
    steps, t = [], time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        while len(engine._live) < len(ids) or not all(s.logprobs for s in engine._live.values()):
            s0 = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - s0) * 1e3)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    for (obj, name), fn in originals.items():
        setattr(obj, name, fn)
    events = prof.key_averages()
    busy = kernel_ms(events)
    print(f"--- {label}: prefill phase {wall * 1e3:.0f} ms (profiled), {len(steps)} steps, GPU kernel time "
          f"{busy:.0f} ms; ms per step: " + " ".join(f"{x:.0f}" for x in steps))
    print("  host: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in totals.most_common()))
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    while engine.has_work():
        engine.step()


def turn2(args):
    from benchmarks.engine import qwen3_shaped, random_prompts

    from agentrl.engine import Engine, EngineConfig, SamplingParams

    model = qwen3_shaped()
    n, plen, gen, tool = args.turn2_seqs, 1024, 64, 64
    sampling = SamplingParams(max_new_tokens=gen, temperature=0.0, ignore_eos=True)
    vocab = model.config.vocab_size
    engine = Engine(model, EngineConfig(max_num_seqs=n, max_model_len=plen + 2 * gen + tool + 64,
                                        max_tokens_per_step=8192, gpu_memory_fraction=0.45))
    engine.generate(random_prompts(n, plen, vocab, seed=3), SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                          ignore_eos=True))
    prompts, tools = random_prompts(n, plen, vocab, seed=1), random_prompts(n, tool, vocab, seed=2)
    first = engine.generate(prompts, sampling)
    alone = [c.token_ids + t for c, t in zip(first, tools)]
    engine.generate(random_prompts(n, gen + tool, vocab, seed=4), sampling)  # the short shapes, compiled
    prefill_phase(engine, [p + c.token_ids + t for p, c, t in zip(prompts, first, tools)], sampling,
                  "turn 2, prefix cache")
    prefill_phase(engine, alone, sampling, "new tokens alone")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trace", default=None, help="write a chrome trace of the profiled steps")
    ap.add_argument("--turn2", action="store_true", help="profile the multi-turn case's turn-2 prefill instead")
    ap.add_argument("--turn2-seqs", type=int, default=256)
    args = ap.parse_args()
    if args.turn2:
        return turn2(args)

    from benchmarks.engine import qwen3_shaped, random_prompts

    from agentrl.engine import Engine, EngineConfig, SamplingParams

    model = qwen3_shaped()
    engine = Engine(model, EngineConfig(max_num_seqs=args.seqs, max_model_len=args.prompt + 256 + 64,
                                        max_tokens_per_step=8192))
    prompts = random_prompts(args.seqs, args.prompt, model.config.vocab_size)
    engine.generate(prompts[:8], SamplingParams(max_new_tokens=4, temperature=0.0))  # captures the graphs
    sampling = SamplingParams(max_new_tokens=256, temperature=0.0, ignore_eos=True)
    # A first pass over other prompts of the same shapes: compiles (Triton variants, torch.compile's dynamic
    # shapes) happen there, and the timed pass below meets none.
    t = time.perf_counter()
    engine.generate(random_prompts(args.seqs, args.prompt, model.config.vocab_size, seed=7),
                    SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    print(f"warm-up pass: {time.perf_counter() - t:.1f} s")
    from torch.profiler import ProfilerActivity, profile

    for p in prompts:
        engine.submit(p, sampling)
    # The first two steps of the pass, each 8192 prompt tokens (plus the decodes of those already admitted).
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(f"prefill steps: GPU kernel time {kernel_ms(events) / 2:.2f} ms a step")
    print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))
    t = time.perf_counter()
    admit_steps = 0
    step_ms = []
    while admit_steps == 0 or engine.scheduler.waiting or any(s.pending > 1 for s in engine.scheduler.running):
        s0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - s0) * 1e3)
        admit_steps += 1
    print(f"admission + prefill: {admit_steps} steps, {time.perf_counter() - t:.3f} s; ms per step: "
          + " ".join(f"{x:.0f}" for x in step_ms))

    totals = collections.Counter()
    wrap_timer(engine.scheduler, "schedule", totals)
    wrap_timer(engine.scheduler, "register", totals)
    wrap_timer(engine, "sampler", totals)
    if engine.graphs is not None:
        wrap_timer(engine.graphs, "run", totals)
    wrap_timer(engine, "_forward", totals)
    wrap_timer(engine, "_launch", totals)
    wrap_timer(engine, "_complete_in_flight", totals)  # waits for the step in flight: the one sync
    before = engine.stats
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / args.steps
    after = engine.stats
    print(f"decode: {args.steps} steps, {wall * 1e3:.2f} ms a step, {args.seqs / wall:,.0f} tok/s; "
          f"graph steps {after.graph_steps - before.graph_steps}, captures {after.graph_captures}")
    # The step's own roofline: every weight read once and every live sequence's KV, at the measured copy bandwidth.
    from benchmarks.engine import copy_bandwidth, kv_bytes_per_token, weight_bytes

    context = sum(s.num_computed for s in engine.scheduler.running)
    step_bytes = weight_bytes(model) + context * kv_bytes_per_token(model.config)
    floor = step_bytes / copy_bandwidth()
    print(f"decode step roofline: {step_bytes / 1e9:.2f} GB read ({weight_bytes(model) / 1e9:.2f} weights, "
          f"{context:,} tokens of KV) = {floor * 1e3:.2f} ms; the step is at {floor / wall:.1%} of it")
    for name, seconds in totals.most_common():
        print(f"  host {name:<10} {seconds / args.steps * 1e3:8.2f} ms a step")

    steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_total = kernel_ms(events) / steps
    print(f"GPU kernel time {gpu_total:.2f} ms a step (sum of kernels), wall {wall * 1e3:.2f} ms a step")
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
