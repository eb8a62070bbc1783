"""benchmarks/vs_trl.py: TRL's GRPOConfig is built from agentrl's TrainConfig field by field."""

import pytest

from agentrl.run.config import TrainConfig
from benchmarks.vs_trl import agentrl_config, parse_args, trl_fields


def _config(**sections) -> TrainConfig:
    return TrainConfig.from_dict({"steps": 7, "seed": 3, **sections})


def test_the_benchmark_budget_reaches_agentrl_and_leaves_the_rest_default():
    cfg = agentrl_config(parse_args(["--steps", "5", "--prompts", "3", "--completions", "4", "--max-new-tokens",
                                     "16", "--data", ""]), "/tmp/run")
    default = TrainConfig()
    assert (cfg.steps, cfg.rollout.groups_per_step, cfg.rollout.group_size) == (5, 3, 4)
    assert (cfg.rollout.max_new_tokens, cfg.rollout.max_turns, cfg.env.args) == (16, 1, {"use_calculator": False})
    assert (cfg.model.name, cfg.optim.lr, cfg.env.data) == ("smollm2-135m-instruct", 1e-6, None)
    assert (cfg.loss, cfg.trainer, cfg.engine) == (default.loss, default.trainer, default.engine)


def test_defaults_map_to_trl_fields():
    cfg = _config(rollout={"group_size": 8, "groups_per_step": 8, "max_new_tokens": 128})
    kwargs, rows, unmatched = trl_fields(cfg, cuda=True)
    assert {k: kwargs[k] for k in ("num_generations", "generation_batch_size", "per_device_train_batch_size",
                                   "gradient_accumulation_steps", "max_completion_length", "temperature", "top_p",
                                   "top_k", "scale_rewards", "learning_rate", "loss_type", "epsilon",
                                   "epsilon_high", "beta", "num_iterations", "max_grad_norm", "bf16",
                                   "gradient_checkpointing", "max_steps", "seed", "optim", "lr_scheduler_type")} == {
        "num_generations": 8, "generation_batch_size": 64, "per_device_train_batch_size": 64,
        "gradient_accumulation_steps": 1, "max_completion_length": 128, "temperature": 1.0, "top_p": 1.0,
        "top_k": 0, "scale_rewards": "group", "learning_rate": 1e-6, "loss_type": "grpo", "epsilon": 0.2,
        "epsilon_high": 0.2, "beta": 0.0, "num_iterations": 1, "max_grad_norm": 1.0, "bf16": True,
        "gradient_checkpointing": False, "max_steps": 7, "seed": 3, "optim": "adamw_torch_fused",
        "lr_scheduler_type": "cosine"}
    assert kwargs["model_init_kwargs"] == {"dtype": "bfloat16"}
    assert len(rows) == len({r[2] for r in rows})  # each TRL field named once
    assert "loss.tis_cap" in [name for name, _ in unmatched]


def test_non_default_knobs_follow():
    cfg = _config(rollout={"advantage": "mean", "top_p": 0.9, "top_k": 20, "drop_truncated": True},
                  loss={"type": "dapo", "clip_eps": 0.1, "clip_eps_high": 0.28},
                  optim={"lr": 3e-6, "warmup_steps": 2, "min_lr_ratio": 0.1, "max_grad_norm": None,
                         "weight_decay": 0.01, "betas": (0.8, 0.95), "eps": 1e-6})
    kwargs, _, unmatched = trl_fields(cfg, cuda=False, micro_batch=8)
    assert {k: kwargs[k] for k in ("scale_rewards", "top_p", "top_k", "mask_truncated_completions", "loss_type",
                                   "epsilon", "epsilon_high", "learning_rate", "warmup_steps", "lr_scheduler_type",
                                   "lr_scheduler_kwargs", "max_grad_norm", "weight_decay", "adam_beta1",
                                   "adam_beta2", "adam_epsilon", "bf16", "optim", "per_device_train_batch_size",
                                   "gradient_accumulation_steps")} == {
        "scale_rewards": "none", "top_p": 0.9, "top_k": 20, "mask_truncated_completions": True, "loss_type": "dapo",
        "epsilon": 0.1, "epsilon_high": 0.28, "learning_rate": 3e-6, "warmup_steps": 2,
        "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
        "max_grad_norm": 0.0, "weight_decay": 0.01, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6,
        "bf16": False, "optim": "adamw_torch", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4}
    assert kwargs["model_init_kwargs"] == {"dtype": "float32"}
    assert "optim.warmup_steps (shape)" in [name for name, _ in unmatched]


def test_a_micro_batch_that_does_not_divide_the_step_is_refused():
    with pytest.raises(ValueError, match="does not divide"):
        trl_fields(_config(), cuda=False, micro_batch=5)


def test_trl_accepts_the_fields_and_generates_once_per_optimizer_step(tmp_path):
    trl = pytest.importorskip("trl")
    cfg = _config(rollout={"group_size": 4, "groups_per_step": 4})
    kwargs, _, _ = trl_fields(cfg, cuda=False, micro_batch=4)
    config = trl.GRPOConfig(output_dir=str(tmp_path), **kwargs)
    assert (config.generation_batch_size, config.steps_per_generation, config.gradient_accumulation_steps) == (16, 4, 4)
    assert (config.num_generations, config.epsilon_high, config.beta, config.gradient_checkpointing) == (4, 0.2, 0.0,
                                                                                                        False)
