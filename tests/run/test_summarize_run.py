"""benchmarks/summarize_run.py on a run whose last steps ran no sample (every group scored alike): their loss/*
metrics are absent, and the summary says so instead of failing after a whole learning run."""

import json
import sys

from benchmarks import summarize_run


def test_a_window_without_loss_metrics_shows_a_dash(tmp_path, monkeypatch, capsys):
    ran = {"rollout/reward": 0.5, "loss/entropy_mean": 0.8, "seconds": 1.0}
    skipped = {"rollout/reward": 0.0, "seconds": 0.1}  # a step that ran no sample: no loss/* metrics
    rows = [dict(ran, step=i) for i in range(1, 4)] + [dict(skipped, step=i) for i in range(4, 7)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(sys, "argv", ["summarize_run.py", str(tmp_path), "--window", "3"])
    summarize_run.main()
    out = capsys.readouterr().out
    assert "| `rollout/reward` | 0.5000 | 0.0000 |" in out
    assert "| `loss/entropy_mean` | 0.8000 | – |" in out
    assert "| `loss/kl_behaviour_current` |" not in out  # in neither window: no row
