"""The fused decode delta rule (`agentrl.engine.triton_delta_rule.delta_rule_step`) at a decode step's shape, over
its block configurations, against a device copy of the same bytes. One H200 line per config.

Configs: columns per program and warps, the rows' slots shuffled; then the engine's config with the slots in
order, as the engine mostly has them. (Launching columns first and a persistent grid were tried and measured no
faster: BENCHMARKS.md, 2026-12-02 13:50.)

Shape: Qwen3.5-0.8B's delta nets (16 key and 16 value heads of 128) at 256 sequences, each row's fp32 state read and
written in place (268 MB each way a layer); the engine's own choice (`delta_rule_config`) is marked. The copy row
is `torch.Tensor.copy_` of a tensor of the state's size into another: the bandwidth a kernel that reads and writes
those bytes once could reach. Bytes counted for both: read + written.

usage: python benchmarks/delta_rule_sweep.py [--rows 256] [--iters 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `agentrl`

from agentrl.engine.triton_delta_rule import delta_rule_config, delta_rule_step  # noqa: E402


def timed(fn, iters: int) -> float:
    """Median seconds of `fn()` over `iters` runs, after three warm-up runs (compiles)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    rows, heads, dk, dv = args.rows, 16, 128, 128
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    y = torch.randn(rows, 2 * heads * dk + heads * dv, generator=gen, device=dev).bfloat16()
    q = y[:, :heads * dk].unflatten(1, (heads, dk))
    k = y[:, heads * dk:2 * heads * dk].unflatten(1, (heads, dk))
    v = y[:, 2 * heads * dk:].unflatten(1, (heads, dv))
    g = -torch.rand(rows, heads, generator=gen, device=dev)
    beta = torch.rand(rows, heads, generator=gen, device=dev).bfloat16()
    state = torch.randn(rows + 1, heads, dk, dv, generator=gen, device=dev) * 0.1
    slots = torch.randperm(rows, generator=gen, device=dev)
    moved = 2 * rows * heads * dk * dv * 4  # read + written
    src, dst = torch.empty(rows * heads * dk * dv, device=dev), torch.empty(rows * heads * dk * dv, device=dev)
    copy_s = timed(lambda: dst.copy_(src), args.iters)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {rows} rows, {heads} heads, {dk}x{dv} fp32 "
          f"states, {moved / 1e6:.0f} MB read + written a call")
    print("| config | µs | TB/s | of the copy's |\n|---|---|---|---|")
    print(f"| device copy of the same bytes | {copy_s * 1e6:.1f} | {moved / copy_s / 1e12:.2f} | 100% |")
    chosen = delta_rule_config(rows, heads, dk, dv)
    configs = [{"block_v": b, "num_warps": w} for b in (8, 16, 32, 64, 128) for w in (1, 2, 4, 8, 16)
               if dk * b // (32 * w) <= 256 and dk * b // (32 * w) >= 8]
    # The engine's slots are mostly in order (slot i for its i-th sequence); these rows are shuffled. The engine's
    # config again with slots in order, last (BENCHMARKS.md, 2026-12-02 13:50: 191.6 against 252.3 µs shuffled).
    runs = [(cfg, slots, "") for cfg in [chosen] + [c for c in configs if c != chosen]]
    runs.append((chosen, torch.arange(rows, device=dev), ", slots in order"))
    for cfg, rows_slots, slot_note in runs:
        try:
            sec = timed(lambda: delta_rule_step(q, k, v, g, beta, state, rows_slots, config=cfg), args.iters)
        except Exception as exc:  # a config Triton refuses here (registers, shared memory)
            print(f"| {cfg} | failed: {type(exc).__name__} | | |")
            continue
        mark = (" (the engine's)" if cfg == chosen else "") + slot_note
        print(f"| block_v {cfg['block_v']}, {cfg['num_warps']} warps{mark} | {sec * 1e6:.1f} | "
              f"{moved / sec / 1e12:.2f} | {copy_s / sec:.0%} |", flush=True)


if __name__ == "__main__":
    main()
