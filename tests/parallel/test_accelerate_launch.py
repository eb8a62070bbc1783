"""`accelerate launch` starts a run the way `torchrun` does: tp=2 x replicas=2 on four processes (gloo on CPU, tiny
Qwen3), as the README's command reads, trains its steps, checkpoints every rank's optimizer shard and writes one
whole `final/` model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import accelerate_launch

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

ROOT = Path(__file__).resolve().parents[2]


def test_accelerate_launch_runs_tp2_by_two_replicas(tmp_path):
    run = tmp_path / "run"
    log = accelerate_launch(4, ["-m", "agentrl", "train", "gsm8k_math", "--model", "tiny-qwen3",
                                "--parallel.tp_size=2", "--max-steps", "2", "--rollout.group_size=2",
                                "--rollout.groups_per_step=2", "--rollout.max_new_tokens=8", "--rollout.max_turns=2",
                                "--run-dir", str(run)], 240, cwd=ROOT)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2], log[-3000:]
    assert all(r["rollout/n"] == 4 and r["parallel/imbalance"] >= 1.0 for r in rows)  # both replicas' groups
    assert len(list((run / "step_00000002").glob("optimizer-*"))) == 4
    assert (run / "final" / "config.json").exists()
