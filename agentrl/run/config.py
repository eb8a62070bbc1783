"""A run's config, built from the components' own sections: `TrainConfig` for `agentrl train`, `EvalConfig` for
`agentrl eval`.

Each section *is* its component's config (`TrainConfig.engine` is the `EngineConfig` the engine receives,
`rollout` the driver's `RolloutConfig`), so a knob has one name and one default everywhere: YAML keys, command-line
overrides and Python. The rules that tie sections together live in `TrainConfig.__post_init__`, in one place.
Keys renamed since the previous release still load, with a warning (`DEPRECATED`).

Imports no torch, so a bad config fails in milliseconds.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.config import ConfigError, Removed, Renamed, check_types, load, require, to_yaml
from agentrl.engine.config import EngineConfig
from agentrl.env.config import EnvConfig
from agentrl.parallel.config import ParallelConfig
from agentrl.rollout.config import RolloutConfig
from agentrl.train.config import (CheckpointConfig, LossConfig, MetricsConfig, ModelConfig, OptimConfig,
                                  TrainerConfig)

__all__ = ["ConfigError", "DEPRECATED", "EvalConfig", "TrainConfig"]

# Old key → where it went. Renamed keys keep working for one release; removed ones fail with the reason.
DEPRECATED: dict[str, Renamed | Removed] = {
    "rollout.environment": Renamed("env.name"),
    "rollout.env_args": Renamed("env.args"),
    "rollout.data": Renamed("env.data"),
    "rollout.data_limit": Renamed("env.data_limit"),
    "loss.advantage": Renamed("rollout.advantage"),
    "loss.advantage_eps": Removed("it was never read; advantages divide by the group's std + 1e-6"),
    "checkpoint.log_every": Renamed("metrics.log_every"),
    "checkpoint.report_to": Renamed("metrics.report_to"),
    "checkpoint.project": Renamed("metrics.project"),
    "row_tokens": Renamed("trainer.row_tokens"),
    "row_pad_multiple": Renamed("trainer.row_pad_multiple"),
    "logprob_chunk_size": Renamed("trainer.logprob_chunk_size"),
    "rows_per_micro_batch": Renamed("trainer.rows_per_micro_batch"),
}


# Without an accelerator the command line starts from these instead of the GPU-sized defaults, so that a first run on
# a laptop finishes a step in minutes (README: what each command costs); anything set explicitly still wins.
CPU_SIZED_TRAIN = {"rollout": {"group_size": 2, "groups_per_step": 1, "rollouts_in_flight": 4, "max_new_tokens": 64,
                               "max_turns": 2}}
CPU_SIZED_EVAL = {"rollout": {"rollouts_in_flight": 10, "max_new_tokens": 64, "max_turns": 3}}


class _Loadable:
    @classmethod
    def from_dict(cls, data: dict | None = None, overrides: typing.Sequence[str] = (), base: dict | None = None):
        return load(cls, data, overrides, deprecated=DEPRECATED, base=base)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: typing.Sequence[str] = (), base: dict | None = None):
        return load(cls, None, overrides, path=path, deprecated=DEPRECATED, base=base)

    def to_yaml(self) -> str:
        return to_yaml(self)


@dataclass
class TrainConfig(_Loadable):
    steps: int = 100
    seed: int = 0
    time_limit_s: float | None = None  # stop (and checkpoint) after the step that crosses it: cluster time limits
    # Hand the engine's KV memory to the training step and take it back after (live rollouts continue exactly);
    # generation pauses during the step.
    release_kv_during_step: bool = False
    # The engine decodes beside the trainer's forward and backward (its update always runs under `Engine.pause()`).
    # False: the engine waits through the whole step and the trainer has the GPU and the host to itself.
    generate_during_step: bool = True
    # Replayable runs: generation and training alternate (a step's rollouts all finish, then the trainer steps),
    # the engine takes requests in a fixed order and recomputes KV after each update, kernels are deterministic.
    # Two runs of the same config give bit-identical weights, and so does a run stopped and resumed. Slower: the
    # engine idles while the trainer steps.
    deterministic: bool = False
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        check_types(self, "")
        require(self.steps >= 1, "steps", "must be >= 1")
        require(self.time_limit_s is None or self.time_limit_s > 0, "time_limit_s", "must be > 0 (or none)")
        # Rules across sections, each stated once.
        require(self.rollout.group_size >= 2, "rollout.group_size",
                "must be >= 2 in training: the group-normalised advantage of a lone rollout is always 0")
        require(self.rollout.temperature > 0, "rollout.temperature",
                "must be > 0 in training (the loss needs the logprobs of a proper distribution; greedy has none)")
        require(self.trainer.row_tokens >= self.rollout.max_sample_tokens, "trainer.row_tokens",
                f"{self.trainer.row_tokens} is below rollout.max_sample_tokens ({self.rollout.max_sample_tokens}): "
                f"a sample never spans two rows")
        require(self.optim.warmup_steps <= self.steps, "optim.warmup_steps",
                f"{self.optim.warmup_steps} exceeds steps ({self.steps})")
        require(not (self.deterministic and self.release_kv_during_step), "release_kv_during_step",
                "has nothing to release in deterministic mode (no rollout is live during a step)")
        require(not (self.parallel.tp_size > 1 and self.model.compile_layers), "model.compile_layers",
                "is not supported with parallel.tp_size > 1 (the split layers run hooks around each module)")
        require(not (self.parallel.tp_size > 1 and self.trainer.cuda_graphs), "trainer.cuda_graphs",
                "is not supported with parallel.tp_size > 1 (the split layers run collectives)")
        require(not (self.deterministic and self.trainer.cuda_graphs), "trainer.cuda_graphs",
                "is not supported in deterministic mode (a bucket's first micro-batch runs eagerly, at a step that "
                "differs between a straight and a resumed run)")
        if self.engine.max_model_len is not None:
            require(self.engine.max_model_len >= self.rollout.max_sample_tokens, "engine.max_model_len",
                    f"{self.engine.max_model_len} is below rollout.max_sample_tokens "
                    f"({self.rollout.max_sample_tokens}); leave it unset to follow the rollout")


def _eval_rollout() -> RolloutConfig:
    # An evaluation is a function of the model: one greedy rollout per question.
    return RolloutConfig(group_size=1, temperature=0.0)


@dataclass
class EvalConfig(_Loadable):
    split: str = "dev"
    limit: int | None = 50  # questions; None: all of them
    out: str | None = None  # every trajectory as one JSON line
    seed: int = 0
    device: str | None = None  # None: cuda when available
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=_eval_rollout)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        check_types(self, "")
        require(self.limit is None or self.limit >= 1, "limit", "must be >= 1 (or none for every question)")
