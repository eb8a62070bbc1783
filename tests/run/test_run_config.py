"""Config files, command-line overrides, and the errors a bad value gets before any work starts."""

import pytest

from agentrl.config import ConfigError
from agentrl.run.build import engine_config
from agentrl.run.config import TrainConfig
from agentrl.train.config import LossConfig, OptimConfig

YAML = """
steps: 50
trainer:
  row_tokens: 4096
model:
  name: tiny-qwen3
  dtype: float32
rollout:
  group_size: 4
  max_sample_tokens: 2048
loss:
  type: dapo
  clip_eps_high: 0.28
  tis_cap: null
optim:
  lr: 1e-6          # YAML reads this one as a string
  betas: [0.9, 0.95]
"""


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    cfg = TrainConfig.from_yaml(path)
    assert cfg.steps == 50 and cfg.model.name == "tiny-qwen3" and cfg.model.dtype == "float32"
    assert cfg.loss.type == "dapo" and cfg.loss.clip_high == 0.28 and cfg.loss.clip_low == 0.2
    assert cfg.loss.tis_cap is None
    assert cfg.optim.lr == 1e-6 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.rollout.group_size == 4 and cfg.checkpoint.save_every == 100  # defaults fill the rest

    cfg = TrainConfig.from_yaml(path, [
        "--steps=7", "--optim.lr=3e-5", "--loss.tis_cap=4", "--model.gradient_checkpointing=true",
        "--loss.max_staleness=2", "--model.attn_implementation=none", "--optim.betas=0.8,0.9",
        "--checkpoint.run_dir=runs/x", "--model.compile_layers=false",
    ])
    assert cfg.model.compile_layers is False and TrainConfig().model.compile_layers is None  # None: auto
    assert TrainConfig().engine.compile is None
    # The engine decides (on for dense CUDA models) in training too; a deterministic run keeps the view eager.
    assert engine_config(TrainConfig().engine, TrainConfig().rollout, 0, (1,)).compile is None
    assert engine_config(TrainConfig().engine, TrainConfig().rollout, 0, (1,), deterministic=True).compile is False
    assert cfg.steps == 7 and cfg.optim.lr == 3e-5 and cfg.loss.tis_cap == 4.0
    assert cfg.model.gradient_checkpointing is True and cfg.loss.max_staleness == 2
    assert cfg.model.attn_implementation is None and cfg.optim.betas == (0.8, 0.9)
    assert cfg.checkpoint.run_dir == "runs/x"


def test_round_trip_through_yaml(tmp_path):
    cfg = TrainConfig.from_dict({}, ["--loss.type=dr_grpo", "--rollout.temperature=0.7"])
    path = tmp_path / "saved.yaml"
    path.write_text(cfg.to_yaml())
    assert TrainConfig.from_yaml(path) == cfg


@pytest.mark.parametrize("overrides,message", [
    (["--optim.lr=-1e-5"], "optim.lr: must be > 0"),
    (["--optim.lr=nan"], "optim.lr: expected a finite number"),
    (["--optim.lrate=1e-5"], "unknown key 'optim.lrate'; did you mean optim.lr"),
    (["--bogus.key=1"], "unknown key 'bogus'"),
    (["--loss.type=ppo"], "loss.type: 'ppo' is not one of grpo, dapo, dr_grpo"),
    (["--steps=ten"], "steps: expected an integer"),
    (["--steps=2.5"], "steps: expected an integer"),
    (["--model.gradient_checkpointing=maybe"], "expected true or false"),
    (["--model.compile_layers=sometimes"], "model.compile_layers: expected true or false"),
    (["--model.activation_memory_budget=0"], "model.activation_memory_budget: must be in (0, 1]"),
    (["--trainer.row_tokens=1024"], "trainer.row_tokens: 1024 is below rollout.max_sample_tokens (4096)"),
    (["--loss.clip_eps_high=0.3"], "loss.clip_eps_high: is dapo's asymmetric clip; grpo clips symmetrically"),
    (["--loss.tis_cap=0.5"], "loss.tis_cap: must be >= 1"),
    (["--rollout.group_size=1"], "rollout.group_size: must be >= 2 in training"),
    (["--rollout.temperature=0"], "rollout.temperature: must be > 0 in training"),
    (["--engine.max_model_len=100"], "engine.max_model_len: 100 is below rollout.max_sample_tokens"),
    (["--loss.advantage_eps=1e-6"], "loss.advantage_eps: removed; it was never read"),
    (["--loss.advantage=mean", "--rollout.advantage=mean"], "loss.advantage and rollout.advantage are the same"),
    (["--optim.warmup_steps=500"], "optim.warmup_steps: 500 exceeds steps (100)"),
    (["--optim.betas=0.9"], "optim.betas: expected 2 values"),
    (["--engine.gpu_memory_fraction=1.5"], "engine.gpu_memory_fraction: must be in (0, 1]"),
    (["--engine.kv_on_update=drop"], "engine.kv_on_update: 'drop' is not one of keep, recompute"),
    (["steps=3"], "must look like --key=value"),
    (["--model=3"], "model: expected a mapping"),
])
def test_bad_values_fail_at_construction(overrides, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({}, overrides)
    assert message in str(err.value)


def test_direct_construction_is_checked_too():
    assert isinstance(OptimConfig(lr=1).lr, float)  # ints coerce to float ...
    with pytest.raises(ConfigError, match="clip_eps: must be in"):
        LossConfig(clip_eps=1)  # ... and are then range-checked
    with pytest.raises(ConfigError, match="loss.type"):
        LossConfig(type="reinforce")
    with pytest.raises(ConfigError, match="unknown key 'loss.typo'"):
        TrainConfig.from_dict({"loss": {"typo": 1}})


def test_environment_arguments_reach_the_environment(tmp_path):
    from agentrl import load_environment

    path = tmp_path / "run.yaml"
    path.write_text("env:\n  name: hotpotqa_search\n  args:\n    few_shot: 1\n")
    cfg = TrainConfig.from_yaml(path, ["--env.args.format_bonus=0", "--env.args.top_k=2"])
    assert cfg.env.args == {"few_shot": 1, "format_bonus": 0, "top_k": 2}  # numbers, not strings
    env = load_environment(cfg.env.name, **cfg.env.args)
    assert (env.few_shot, env.format_bonus, env.top_k) == (1, 0, 2)
    assert "search_format" not in env.reward_weights  # the bonus is off
    assert TrainConfig.from_yaml(path).env.args == {"few_shot": 1}
    with pytest.raises(ConfigError, match="env.args: expected a mapping"):
        TrainConfig.from_dict({}, ["--env.args=3"])


def test_renamed_keys_of_the_previous_release_still_load_with_a_warning(tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text("row_tokens: 4096\nrollout:\n  environment: hotpotqa_search\n  env_args: {few_shot: 1}\n"
                    "  data_limit: 5\nloss:\n  advantage: mean\ncheckpoint:\n  log_every: 3\n")
    cfg = TrainConfig.from_yaml(path, ["--rollout.max_sample_tokens=2048"])
    assert (cfg.trainer.row_tokens, cfg.env.name, cfg.env.args, cfg.env.data_limit) == (4096, "hotpotqa_search",
                                                                                         {"few_shot": 1}, 5)
    assert cfg.rollout.advantage == "mean" and cfg.metrics.log_every == 3
    err = capsys.readouterr().err
    assert "rollout.environment is now env.name" in err and "loss.advantage is now rollout.advantage" in err


def test_rollouts_in_flight_default_to_twice_a_step_and_at_least_64():
    from agentrl.rollout.config import RolloutConfig

    assert RolloutConfig().in_flight == 64  # 4 groups x 8 a step: twice that
    assert RolloutConfig(groups_per_step=8).in_flight == 128  # the vs-TRL step: 64 rollouts
    assert RolloutConfig(group_size=1).in_flight == 64  # eval's groups of one still fill a batch
    assert RolloutConfig(groups_per_step=8, rollouts_in_flight=40).in_flight == 40  # what is set wins
    with pytest.raises(ValueError, match="rollout.rollouts_in_flight"):
        RolloutConfig(rollouts_in_flight=0)
