"""One table from a training run's metrics.jsonl: the first and last steps' reward and tool use side by side, and
the run's speed (s/step, trained and generated tokens/s, how much of each step generation sat idle or paused).

usage: python benchmarks/summarize_run.py RUN_DIR [--window 20]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from agentrl.train.plot import read_metrics

CURVES = ["rollout/reward", "rollout/tool_call_rate", "rollout/tool_error_rate", "rollout/answer_f1",
          "rollout/mean_turns", "loss/entropy_mean", "loss/kl_behaviour_current", "loss/staleness_mean"]
SPEED = ["seconds", "wait_seconds", "train_seconds", "trained_tokens_per_s", "generated_tokens_per_s",
         "engine_idle_share", "engine_paused_share"]


def mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--window", type=int, default=20, help="steps averaged at each end")
    args = ap.parse_args()
    records = read_metrics(Path(args.run_dir))
    w = min(args.window, max(1, len(records) // 2))
    first, last, later = records[:w], records[-w:], records[1:] or records  # step 1 carries the compiles
    print(f"{len(records)} steps; means over the first and last {w}")
    print(f"{'metric':<32} {'first':>10} {'last':>10}")
    for key in CURVES:
        a, b = mean(first, key), mean(last, key)
        if a is not None:
            print(f"{key:<32} {a:>10.4f} {b:>10.4f}")
    print(f"speed, steps 2-{len(records)} (step 1: {records[0].get('seconds', 0):.1f} s)")
    for key in SPEED:
        value = mean(later, key)
        if value is not None:
            print(f"{key:<32} {value:>10.3f}")


if __name__ == "__main__":
    main()
