"""`agentrl plot RUN_DIR`: PNG curves of a run's metrics.jsonl (reward, tool use, F1, throughput, loss)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = [
    ("reward", ["rollout/reward"]),
    ("tool-call rate", ["rollout/tool_call_rate"]),
    ("answer F1 / accuracy", ["rollout/answer_f1", "rollout/correct"]),
    ("tokens / s", ["trained_tokens_per_s", "generated_tokens_per_s"]),
    ("loss", ["loss"]),
    ("seconds / step", ["seconds", "wait_seconds"]),
]


# Trained and generated tokens/s differ by an order of magnitude or more: on a linear axis one of them is flat.
LOG_SCALE = {"tokens / s"}


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a training run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on training hosts
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                steps, values = zip(*points)
                line, = ax.plot(steps, values, label=key, linewidth=1, alpha=0.6)
                if len(values) >= 10:  # a moving average: single steps are noisy at small batch sizes
                    k = max(len(values) // 20, 3)
                    smooth = [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1])
                              for i in range(len(values))]
                    ax.plot(steps, smooth, linewidth=2, color=line.get_color())
        if title in LOG_SCALE and ax.lines and all(min(l.get_ydata()) > 0 for l in ax.lines):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        if any(isinstance(r.get(k), (int, float)) for r in records for k in keys):
            ax.legend(fontsize=7)
    fig.tight_layout()
    target = Path(out) if out else run_dir / "curves.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="agentrl plot", description="PNG curves of a training run.")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    print(plot(a.run_dir, a.out))
    return 0
