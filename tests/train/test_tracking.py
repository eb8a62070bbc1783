"""Trackers beside metrics.jsonl: what they receive, and a missing package failing the config up front."""

from pathlib import Path

import pytest

from agentrl.train import tracking
from agentrl.config import ConfigError
from agentrl.run.config import TrainConfig
from tests.helpers import install_fake_trackers


def test_trackers_get_each_steps_numbers(monkeypatch, tmp_path):
    calls = install_fake_trackers(monkeypatch)
    trackers = tracking.Trackers(("tensorboard", "trackio"), tmp_path / "run7", "proj", {"lr": 1e-5}, resume=True)
    trackers.log({"step": 3, "loss": 0.5, "skipped": False, "rollout/reward": 1, "note": "text"})
    trackers.close()
    assert calls["init"] == [{"project": "proj", "name": "run7", "config": {"lr": 1e-5}, "resume": "allow"}]
    assert calls["log"] == [(3, {"loss": 0.5, "rollout/reward": 1.0})]  # numbers only, the step apart
    assert calls["writers"] == [str(Path(tmp_path / "run7" / "tensorboard"))]
    assert sorted(calls["scalars"]) == [("loss", 0.5, 3), ("rollout/reward", 1.0, 3)]
    assert calls["finish"] == 1 and calls["closed"] == 1


def test_a_tracker_without_its_package_is_a_config_error(monkeypatch):
    monkeypatch.setattr(tracking, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"metrics.report_to.*pip install trackio"):
        TrainConfig.from_dict({"metrics": {"report_to": "trackio"}})
    with pytest.raises(ConfigError, match="not one of"):
        TrainConfig.from_dict({"metrics": {"report_to": ["wandb"]}})
    assert TrainConfig.from_dict({}).metrics.report_to == ()
