"""Where the device sat idle in a profiled step, and what the host was doing meanwhile.

Reads a Chrome trace written by `train_step.py --profile --trace DIR` (torch's profiler, Python stacks on): the
device's busy intervals are its kernels, copies and fills; every gap between them longer than `--min-us` is charged
to the deepest agentrl (or benchmark) Python frame that was running on the host at the gap's middle, and to the one
that launched the work ending the gap. The sums say which host code a faster step has to move off the critical path.

    python benchmarks/trace_gaps.py trace.json.gz [--min-us 20] [--top 15]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from dataclasses import dataclass

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
OURS = ("agentrl/", "benchmarks/")


@dataclass
class Gap:
    start: float
    end: float
    during: str  # the deepest of our frames running on the host at the gap's middle
    launched_by: str  # the deepest of our frames around the launch of the work that ended the gap

    @property
    def us(self) -> float:
        return self.end - self.start


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_intervals(events: list[dict]) -> list[tuple[float, float, dict]]:
    """The device's work, sorted by start, overlapping ones merged (streams run side by side)."""
    work = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e) for e in events
                  if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS)
    merged: list[tuple[float, float, dict]] = []
    for start, end, e in work:
        if merged and start <= merged[-1][1]:
            s, t, first = merged[-1]
            merged[-1] = (s, max(t, end), first)
        else:
            merged.append((start, end, e))
    return merged


class Frames:
    """Our Python frames on the host, for 'what ran at time t' (the deepest one holding t)."""

    def __init__(self, events: list[dict]):
        self.frames = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in events
                             if e.get("ph") == "X" and e.get("cat") == "python_function"
                             and any(o in e.get("name", "") for o in OURS))
        self.starts = [f[0] for f in self.frames]

    def at(self, t: float) -> str:
        best = None
        for start, end, name in self.frames[:bisect.bisect_right(self.starts, t)]:
            if end >= t and (best is None or end - start < best[1] - best[0]):
                best = (start, end, name)
        return best[2] if best else "(none of ours)"


def gaps(events: list[dict], min_us: float = 20.0) -> list[Gap]:
    busy = busy_intervals(events)
    frames = Frames(events)
    launches = {}  # correlation id -> host time of the runtime call that launched it
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = float(e["ts"])
    out = []
    for (_, prev_end, _), (start, _, e) in zip(busy, busy[1:]):
        if start - prev_end < min_us:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        out.append(Gap(prev_end, start, frames.at((prev_end + start) / 2),
                       frames.at(launch) if launch is not None else "(unknown launch)"))
    return out


def summary(events: list[dict], min_us: float = 20.0, top: int = 15) -> str:
    busy = busy_intervals(events)
    if not busy:
        return "no device work in the trace"
    span = busy[-1][1] - busy[0][0]
    work = sum(end - start for start, end, _ in busy)
    found = gaps(events, min_us)
    lines = [f"device busy {work / 1e3:.1f} ms of a {span / 1e3:.1f} ms span (first to last kernel); "
             f"{len(found)} gaps over {min_us:g} us: {sum(g.us for g in found) / 1e3:.1f} ms"]
    for label, key in (("host was in", "during"), ("ended by a launch from", "launched_by")):
        by: dict[str, list[float]] = defaultdict(list)
        for g in found:
            by[getattr(g, key)].append(g.us)
        lines.append(f"gaps by where the {label}:")
        for name, us in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]:
            lines.append(f"  {sum(us) / 1e3:8.2f} ms  {len(us):4d} gaps  {name}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    print(summary(load(args.trace), args.min_us, args.top))


if __name__ == "__main__":
    main()
