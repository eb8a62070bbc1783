"""`agentrl plot RUN_DIR`: the PNG of a run's curves, and a clear error for a directory that is not a run."""

import json

import pytest

from agentrl.cli import main
from agentrl.train.plot import LOG_SCALE, PANELS, plot


def test_plot_draws_every_panel_of_a_run(tmp_path, monkeypatch, capsys):
    import matplotlib.pyplot as plt

    records = [{"step": i, "rollout/reward": i / 40, "rollout/tool_call_rate": 0.2 + i / 100, "loss": 0.1,
                "trained_tokens_per_s": 9e4 + i, "generated_tokens_per_s": 3e3, "seconds": 2.0, "wait_seconds": 1.5}
               for i in range(1, 41)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    assert main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = {ax.get_title(): ax for ax in figures[0].axes}
    assert set(axes) == {title for title, _ in PANELS}
    tokens = axes["tokens / s"]
    assert "tokens / s" in LOG_SCALE and tokens.get_yscale() == "log"  # 9e4 and 3e3 both readable
    assert [line.get_label() for line in tokens.lines][::2] == ["trained_tokens_per_s", "generated_tokens_per_s"]
    raw, smooth = axes["reward"].lines  # the step values, then their moving average in the same colour
    assert list(raw.get_ydata()) == [r["rollout/reward"] for r in records] and raw.get_color() == smooth.get_color()
    assert len(axes["answer F1 / accuracy"].lines) == 0  # no such metric in this run: an empty panel, no error


def test_plot_of_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="is .* a training run directory"):
        plot(tmp_path)
