"""Typed training configuration: one dataclass per section, YAML files, `--section.key=value` overrides.

Every value is checked where it is constructed, against its type hint and its range, so a bad value fails with
the key's name before any model is loaded or any GPU is touched. Each section checks only its own fields; the few
rules that tie sections together live in `TrainConfig.__post_init__`, in one place. There are no switches that
silently override one another: one option per decision.

Imports nothing heavy (no torch), so the command line can validate a config in milliseconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


# ---------------------------------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # hub id, local directory, or a name `agentrl.models.load_model` knows
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    # None: sdpa on CPU; on GPU agentrl_varlen (flash varlen attention over one flat row of the real tokens, see
    # agentrl.train.varlen_attention) for bf16/fp16 models, dense or hybrid with hybrid_varlen, else flex_attention.
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    # torch.compile each decoder layer. Measured on an H200, Qwen3-0.6B shape, one 8192-token row per micro-batch:
    # 0.44 s/step compiled against 0.84 s eager (benchmarks/train_step.py, the trainer alone). Off by default: the
    # two SmolLM2 runs that compiled the trainer's layers and the engine's view together (they share the layers'
    # code objects and dynamo's cache, from two threads) stalled after their first step; eager runs did not.
    compile_layers: bool = False
    # With compile_layers: the activation memory budget (0, 1] of each compiled layer's forward/backward split;
    # below 1 the partitioner recomputes the cheapest activations in the backward instead of saving them.
    activation_memory_budget: float = 1.0
    # Hybrid (linear-attention) models: pass sample boundaries to varlen kernels (flash-linear-attention) instead
    # of running each sample on its own; the loop verifies the kernels honour them before the first step.
    hybrid_varlen: bool = False

    def __post_init__(self):
        _check_types(self, "model")
        _require(bool(self.name), "model.name", "must not be empty")
        _require(0 < self.activation_memory_budget <= 1, "model.activation_memory_budget", "must be in (0, 1]")


@dataclass
class RolloutConfig:
    environment: str = "gsm8k_math"
    # Keyword arguments of the environment's load_environment, e.g. {few_shot: 2, format_bonus: 0.0};
    # on the command line --rollout.env_args.few_shot=2.
    env_args: dict[str, Any] = field(default_factory=dict)
    data: str | None = None  # a local json/jsonl path, "hub", or None for the environment's built-in data
    data_limit: int | None = None
    group_size: int = 8  # rollouts per prompt; advantages are normalised within a group
    groups_per_step: int = 4
    max_turns: int = 4
    max_new_tokens: int = 256  # per turn
    max_sample_tokens: int = 4096  # whole rollout, prompt + every turn; longer ones are cut by the rollout layer
    temperature: float = 1.0
    rollouts_in_flight: int = 64
    # Finished batches allowed to wait for the trainer before the driver stops starting groups (staleness bound).
    max_ready_batches: int = 1
    drop_truncated: bool = False  # leave out rollouts cut at max_sample_tokens instead of training on them

    def __post_init__(self):
        _check_types(self, "rollout")
        _require(self.group_size >= 2, "rollout.group_size",
                 "must be >= 2: the group-normalised advantage of a lone rollout is always 0")
        for key in ("groups_per_step", "max_turns", "max_new_tokens", "max_sample_tokens",
                    "rollouts_in_flight", "max_ready_batches"):
            _require(getattr(self, key) >= 1, f"rollout.{key}", "must be >= 1")
        _require(self.temperature > 0, "rollout.temperature",
                 "must be > 0 (training needs the logprobs of a proper distribution; greedy has none)")


@dataclass
class EngineOptions:
    """The engine section. Names match `agentrl.engine.config.EngineConfig` (which imports torch, so it is not
    embedded here); the loop passes these fields through to it."""

    page_size: int = 16
    gpu_memory_fraction: float = 0.3  # of free accelerator memory, for the paged KV pool
    max_num_seqs: int = 128
    max_tokens_per_step: int = 1024
    enable_prefix_cache: bool = True
    kv_on_update: Literal["keep", "recompute"] = "keep"
    cuda_graphs: bool = True
    mixed_step_graphs: bool = True  # with cuda_graphs: steps that prefill replay graphs too (per token bucket)
    # torch.compile the engine view's decoder layers. Off in training for the reason given at model.compile_layers
    # (the standalone engine and `agentrl eval` compile on CUDA by default).
    compile: bool = False

    def __post_init__(self):
        _check_types(self, "engine")
        for key in ("page_size", "max_num_seqs", "max_tokens_per_step"):
            _require(getattr(self, key) >= 1, f"engine.{key}", "must be >= 1")
        _require(0 < self.gpu_memory_fraction <= 1, "engine.gpu_memory_fraction", "must be in (0, 1]")


@dataclass
class LossConfig:
    type: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # dapo's asymmetric upper clip (0.28 in its paper); None = clip_eps
    tis_cap: float | None = 2.0  # truncated importance sampling cap; None = off
    max_staleness: int | None = None  # policy versions; None = no bound
    stale_weight: float = 0.0  # weight of tokens past max_staleness: 0 drops them, (0, 1) down-weights them
    dr_grpo_max_tokens: int = 4096  # dr_grpo's constant per-sample normaliser
    advantage: Literal["mean_std", "mean"] = "mean_std"
    advantage_eps: float = 1e-6

    def __post_init__(self):
        _check_types(self, "loss")
        _require(0 < self.clip_eps < 1, "loss.clip_eps", "must be in (0, 1)")
        if self.clip_eps_high is not None:
            _require(self.type == "dapo", "loss.clip_eps_high",
                     f"is dapo's asymmetric clip; {self.type} clips symmetrically (set loss.type=dapo)")
            _require(self.clip_eps_high > 0, "loss.clip_eps_high", "must be > 0")
        if self.tis_cap is not None:
            _require(self.tis_cap >= 1, "loss.tis_cap", "must be >= 1 (or none to turn it off)")
        if self.max_staleness is not None:
            _require(self.max_staleness >= 0, "loss.max_staleness", "must be >= 0 (or none for no bound)")
        _require(0 <= self.stale_weight < 1, "loss.stale_weight", "must be in [0, 1)")
        _require(self.dr_grpo_max_tokens >= 1, "loss.dr_grpo_max_tokens", "must be >= 1")
        _require(self.advantage_eps >= 0, "loss.advantage_eps", "must be >= 0")

    @property
    def clip_low(self) -> float:
        return self.clip_eps

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    max_grad_norm: float | None = 1.0  # None = no clipping (the norm is still computed for the skip check)
    max_consecutive_skips: int = 10  # non-finite steps in a row before the run stops

    def __post_init__(self):
        _check_types(self, "optim")
        _require(self.lr > 0, "optim.lr", "must be > 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _require(all(0 <= b < 1 for b in self.betas), "optim.betas", "must each be in [0, 1)")
        _require(self.eps > 0, "optim.eps", "must be > 0")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        if self.max_grad_norm is not None:
            _require(self.max_grad_norm > 0, "optim.max_grad_norm", "must be > 0 (or none for no clipping)")
        _require(self.max_consecutive_skips >= 1, "optim.max_consecutive_skips", "must be >= 1")


@dataclass
class CheckpointConfig:
    run_dir: str = "runs/default"
    save_every: int = 100  # steps; 0 = only at the end
    keep_last: int = 2
    resume: bool = True  # continue from the latest checkpoint in run_dir if there is one
    log_every: int = 1
    # Also send each step's numbers to these trackers (optional packages: pip install tensorboard / trackio).
    report_to: tuple[Literal["tensorboard", "trackio"], ...] = ()
    project: str = "agentrl"  # the trackio project

    def __post_init__(self):
        _check_types(self, "checkpoint")
        from agentrl.train.tracking import missing

        absent = missing(self.report_to)
        _require(not absent, "checkpoint.report_to", f"needs the {' and '.join(absent)} package "
                 f"(pip install {' '.join(absent)}), which is not installed")
        _require(bool(self.run_dir), "checkpoint.run_dir", "must not be empty")
        _require(self.save_every >= 0, "checkpoint.save_every", "must be >= 0")
        _require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
        _require(self.log_every >= 1, "checkpoint.log_every", "must be >= 1")


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 0
    row_tokens: int = 8192  # packing capacity of one row
    row_pad_multiple: int = 128  # row width rounded up to this: fewer distinct shapes for compiled attention kernels
    logprob_chunk_size: int = 1024  # rows of the chunked lm_head (its fp32 logits: rows x vocab x 4 bytes)
    time_limit_s: float | None = None  # stop (and checkpoint) after the step that crosses it: cluster time limits
    rows_per_micro_batch: int = 1  # packed rows per forward/backward; gradients accumulate over the batch
    # Hand the engine's KV memory to the training step and take it back after (live rollouts continue exactly);
    # generation pauses during the step.
    release_kv_during_step: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineOptions = field(default_factory=EngineOptions)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        _check_types(self, "")
        _require(self.steps >= 1, "steps", "must be >= 1")
        _require(self.logprob_chunk_size >= 1, "logprob_chunk_size", "must be >= 1")
        _require(self.rows_per_micro_batch >= 1, "rows_per_micro_batch", "must be >= 1")
        _require(self.row_pad_multiple >= 1, "row_pad_multiple", "must be >= 1")
        # Rules across sections: packing raises on a sample wider than a row, so catch it here, not mid-run.
        _require(self.row_tokens >= self.rollout.max_sample_tokens, "row_tokens",
                 f"{self.row_tokens} is below rollout.max_sample_tokens ({self.rollout.max_sample_tokens}): "
                 f"a sample never spans two rows")
        _require(self.optim.warmup_steps <= self.steps, "optim.warmup_steps",
                 f"{self.optim.warmup_steps} exceeds steps ({self.steps})")

    # ------------------------------------------------------------------------------------------- building

    @classmethod
    def from_dict(cls, data: dict | None = None, overrides: typing.Sequence[str] = ()) -> "TrainConfig":
        data = _merge({}, data or {})
        for item in overrides:
            path, value = _parse_override(item)
            _set_path(data, path, value)
        return _build(cls, data, "")

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: typing.Sequence[str] = ()) -> "TrainConfig":
        import yaml

        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
        return cls.from_dict(data, overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        data = self.to_dict()
        data["optim"]["betas"] = list(data["optim"]["betas"])  # plain YAML rather than a python tuple tag
        return yaml.safe_dump(data, sort_keys=False)


# ------------------------------------------------------------------------------------------------- machinery


def _require(ok: bool, key: str, message: str):
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _parse_override(item: str) -> tuple[list[str], str]:
    if not item.startswith("--") or "=" not in item:
        raise ConfigError(f"override {item!r} must look like --key=value or --section.key=value")
    key, value = item[2:].split("=", 1)
    if not key:
        raise ConfigError(f"override {item!r} has no key")
    return key.split("."), value


def _set_path(data: dict, path: list[str], value: Any):
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{'.'.join(path)}: {part} is a value, not a section")
    node[path[-1]] = value


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"unknown key {where!r}{hint}")
        tp = hints[key]
        kwargs[key] = _build(tp, value, f"{where}.") if dataclasses.is_dataclass(tp) else _coerce(value, tp, where)
    return cls(**kwargs)


def _check_types(obj, section: str):
    """Coerce every field to its hinted type in place (YAML and the command line hand in strings and ints)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(getattr(obj, f.name), tp):
                raise ConfigError(f"{f.name}: expected a {tp.__name__}")
            continue
        where = f"{section}.{f.name}" if section else f.name
        setattr(obj, f.name, _coerce(getattr(obj, f.name), tp, where))


def parse_value(value: Any, where: str) -> Any:
    """A free-form value (environment arguments): YAML's reading of a command-line string, so `2` is an int."""
    if isinstance(value, str):
        import yaml

        value = yaml.safe_load(value) if value.strip() else value
    if not isinstance(value, (str, int, float, bool, type(None), list)):
        raise ConfigError(f"{where}: expected a number, string, boolean or list, got {value!r}")
    return value


_TRUE, _FALSE, _NONE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}, {"none", "null", "~"}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in _NONE and type(None) in args):
            if type(None) in args:
                return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arm, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): parse_value(v, f"{where}.{k}") for k, v in value.items()}
    if origin is tuple:
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        arms = [args[0]] * len(items) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(arms) != len(items):
            raise ConfigError(f"{where}: expected {len(arms)} values, got {len(items)}")
        return tuple(_coerce(v, a, where) for v, a in zip(items, arms))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML reads 1e-6 (no dot) as a string
            except ValueError:
                pass
        if number is None or not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported type {tp}")
