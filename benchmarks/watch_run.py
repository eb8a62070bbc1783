"""Run an `agentrl` command in this process under a stall watchdog, then summarise its step times.

While the run goes, a watcher thread follows the run dir's metrics.jsonl; when no step has finished for
`--stall-seconds`, it prints every thread's Python stack (with the threads' names) and torch.compile's counters,
and prints them again every `--stall-seconds` for as long as the stall lasts. That is what tells a stall in the
engine thread from one in the trainer, in a compile, a graph capture or a kernel wait. At the end: steps,
median and max seconds, the steps slower than 5x the median, and dynamo's frame and recompile counts.

usage: python benchmarks/watch_run.py [--stall-seconds 60] -- train gsm8k_math --max-steps 50 --run-dir runs/x
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path


def run_dir_of(argv: list[str]) -> Path:
    for i, arg in enumerate(argv):
        if arg == "--run-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--run-dir="):
            return Path(arg.split("=", 1)[1])
    raise SystemExit("watch_run: pass --run-dir to the command so its metrics can be followed")


def step_seconds(metrics: Path) -> list[float]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            out.append(float(json.loads(line)["seconds"]))
        except (ValueError, KeyError):
            pass
    return out


def dynamo_counts() -> dict:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {group: dict(values) for group, values in counters.items() if group in ("stats", "recompiles", "frames")}


def dump_threads(reason: str) -> None:
    names = {t.ident: t.name for t in threading.enumerate()}
    print(f"\n===== watch_run: {reason} =====", file=sys.stderr)
    for ident, frame in sys._current_frames().items():
        print(f"--- thread {names.get(ident, ident)}", file=sys.stderr)
        print("".join(traceback.format_stack(frame)), file=sys.stderr)
    print(f"dynamo: {dynamo_counts()}", file=sys.stderr, flush=True)


def watch(metrics: Path, stall_seconds: float, done: threading.Event) -> None:
    seen, last_change = -1, time.monotonic()
    while not done.wait(1.0):
        n = len(step_seconds(metrics))
        if n != seen:
            seen, last_change = n, time.monotonic()
        elif time.monotonic() - last_change > stall_seconds:
            dump_threads(f"no step finished for {time.monotonic() - last_change:.0f} s (after step {n})")
            last_change = time.monotonic()


def summarise(seconds: list[float], wall: float) -> str:
    if not seconds:
        return f"no steps finished in {wall:.0f} s"
    steady = seconds[1:] or seconds
    median = statistics.median(steady)
    slow = [(i + 2, round(s, 3)) for i, s in enumerate(steady) if s > 5 * median]
    return (f"steps {len(seconds)} | first {seconds[0]:.2f} s | median after the first {median:.3f} s | "
            f"max after the first {max(steady):.3f} s | steps > 5x median: {slow or 'none'} | wall {wall:.0f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stall-seconds", type=float, default=60.0)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the agentrl command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    metrics = run_dir_of(command) / "metrics.jsonl"
    done = threading.Event()
    watcher = threading.Thread(target=watch, args=(metrics, args.stall_seconds, done), name="watch_run", daemon=True)
    from agentrl.cli import main as agentrl_main

    start = time.monotonic()
    watcher.start()
    try:
        rc = agentrl_main(command)
    finally:
        done.set()
    print(f"watch_run: agentrl {' '.join(command)}\n  rc {rc} | {summarise(step_seconds(metrics), time.monotonic() - start)}"
          f"\n  dynamo: {dynamo_counts()}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
