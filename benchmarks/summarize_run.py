"""Markdown tables from a training run's metrics.jsonl: the first and last steps' reward and tool use side by side,
and the run's speed (s/step, trained and generated tokens/s, how much of each step generation sat idle or paused);
with `--eval`, also the summaries `agentrl eval` printed, one row each. benchmarks/smollm2_hotpotqa.sh writes
these tables to the run's summary.md, the one text file of a run that git keeps.

usage: python benchmarks/summarize_run.py RUN_DIR [--window 20] [--eval eval_before.json --eval eval_after.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from agentrl.train.plot import read_metrics

CURVES = ["rollout/reward", "rollout/tool_call_rate", "rollout/tool_error_rate", "rollout/answer_f1",
          "rollout/search_calls", "rollout/two_hop_f1", "rollout/answer_found", "rollout/mean_turns",
          "loss/entropy_mean", "loss/kl_behaviour_current", "loss/staleness_mean"]  # a row where the run logged it
SPEED = ["seconds", "wait_seconds", "train_seconds", "pack_seconds", "trained_tokens_per_s", "generated_tokens_per_s",
         "engine_idle_share", "engine_paused_share", "engine_lock_wait_seconds", "graph_capture_wait_seconds"]
EVAL = ["n", "tool_call_rate", "tool_calls_per_rollout", "tool_error_rate", "answer_f1", "answer_em", "accuracy",
        "mean_turns", "reward", "prefix_cache_hit_share", "seconds"]


def mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def eval_table(paths: list[Path]) -> list[str]:
    """One row per eval summary (the last JSON line of each file), named by the file: eval_before.json -> before."""
    rows = [(p.stem.removeprefix("eval_"), json.loads(p.read_text().strip().splitlines()[-1])) for p in paths]
    keys = [k for k in EVAL if any(k in summary for _, summary in rows)]
    lines = ["| eval | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(str(summary.get(k, "–")) for k in keys) + " |" for name, summary in rows]
    return lines


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--window", type=int, default=20, help="steps averaged at each end")
    ap.add_argument("--eval", action="append", default=[], type=Path, help="an `agentrl eval` summary (JSON)")
    args = ap.parse_args()
    if args.eval:
        print("\n".join(eval_table(args.eval)) + "\n")
    records = read_metrics(Path(args.run_dir))
    w = min(args.window, max(1, len(records) // 2))
    first, last, later = records[:w], records[-w:], records[1:] or records  # step 1 carries the compiles
    print(f"{len(records)} steps; means over the first and last {w}.\n")
    print("| metric | first | last |\n|---|---|---|")
    for key in CURVES:
        # A window may lack a key the other has: loss/* metrics come only from steps that ran a sample (a step whose
        # groups all scored alike runs none), so "–" there.
        a, b = mean(first, key), mean(last, key)
        if a is not None or b is not None:
            print(f"| `{key}` | {_cell(a)} | {_cell(b)} |")
    print(f"\n| speed, steps 2-{len(records)} (step 1: {records[0].get('seconds', 0):.1f} s) | mean |\n|---|---|")
    for key in SPEED:
        value = mean(later, key)
        if value is not None:
            print(f"| `{key}` | {value:.3f} |")


if __name__ == "__main__":
    main()
