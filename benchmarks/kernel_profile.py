"""A step's GPU kernels under torch's profiler: busy time against wall time, and where the time goes by kind of kernel
(attention, GEMMs, inductor's fused kernels, the optimizer, copies), and where the host waits on the device. Used by
`train_step.py --profile` and `--sync-debug`."""

from __future__ import annotations

import time

import torch


def print_profile(name: str, step, model, trace: str | None = None) -> None:
    """Run `step()` once under the profiler and print its GPU kernel time against its wall time, that time by kind
    of kernel, and the top kernels by device and by host time. `trace`: also write the step's Chrome trace there,
    gzipped, with Python stacks (where the device sat idle, and what the host did meanwhile: `trace_gaps.py`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, with_stack=trace is not None) as prof:
        t = time.perf_counter()
        step()
        model.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    busy = kernel_ms(events)
    # Kernel time well below the wall time means the device waited on the host (launches, syncs, compiles).
    print(f"--- {name}: GPU kernel time {busy:.1f} ms in a {wall * 1e3:.1f} ms step (profiled)")
    print(" | ".join(f"{kind} {ms:.1f} ms ({ms / max(busy, 1e-9):.0%})" for kind, ms in kernel_kinds(events)))
    print(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=110))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    if trace:
        import gzip
        import os
        import shutil

        raw = trace.removesuffix(".gz")
        os.makedirs(os.path.dirname(raw) or ".", exist_ok=True)
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
        from benchmarks.trace_gaps import load, summary

        print(f"trace: {raw}.gz\n{summary(load(raw + '.gz'))}")


def kernel_events(events) -> list:
    """The device kernels among the profiler's events. An aten op's event also carries the device time of the kernels
    it launched, so a sum over every event counts an eagerly launched kernel twice (a graph's replayed kernels,
    launched by no op, once); torch's own table totals the device events alone, as here."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
            and e.self_device_time_total > 0]


def kernel_ms(events) -> float:
    """Milliseconds of device kernel time in `events` (`kernel_events`)."""
    return sum(e.self_device_time_total for e in kernel_events(events)) / 1e3


# Kernel name fragments by kind, first match wins: where a step's GPU time goes.
KERNEL_KINDS = (
    ("delta rule (fla, agentrl)", ("delta", "chunk_gated", "chunk_fwd", "chunk_bwd", "chunk_scaled", "chunk_local",
                                   "recompute_w_u", "solve_tril", "l2norm")),
    # Attention before conv, and conv by whole names: flash's `flash_bwd_convert_dq_kernel` and inductor's
    # `..._convert_element_type` kernels hold "conv" too.
    ("attention", ("flash", "fmha", "attention", "_decode_kernel", "_prefill_kernel", "_combine_splits")),
    ("conv", ("conv1d", "conv_depthwise", "_conv_kernel", "conv_fwd", "conv_bwd")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("optimizer", ("adam", "multi_tensor")),
    ("fused (inductor)", ("triton_",)),
    ("copy / index / fill", ("copy", "memcpy", "memset", "fill", "cat", "index", "gather", "scatter")),
)


def kernel_kinds(events) -> list[tuple[str, float]]:
    """Milliseconds of kernel time by kind (`KERNEL_KINDS`, the rest as "other"), largest first."""
    totals: dict[str, float] = {}
    for e in kernel_events(events):
        ms = e.self_device_time_total / 1e3
        name = e.key.lower()
        kind = next((k for k, frags in KERNEL_KINDS if any(f in name for f in frags)), "other")
        totals[kind] = totals.get(kind, 0.0) + ms
    return sorted(totals.items(), key=lambda kv: -kv[1])


def print_host_syncs(name, step) -> None:
    """Run `step()` once with CUDA's sync debug mode warning, and print each distinct place in agentrl or the
    benchmark where the host waited on the device (an `.item()`, a device `nonzero`, a copy to pageable memory),
    with how often: each one lets the device run dry while the host catches up."""
    import collections
    import os
    import traceback
    import warnings

    if not torch.cuda.is_available():
        print(f"--- {name}: no CUDA, no sync debug")
        return
    places = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "agentrl" in f.filename or "benchmarks" in f.filename]
        places[(str(message)[:80], " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[-4:][::-1]))] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = shown
    print(f"--- {name}: {sum(places.values())} host syncs in one step")
    for (message, where), count in places.most_common():
        print(f"{count:>4} x {where}  ({message})")
