"""The trainer's sections of a run's config: the model it trains, packing, loss, optimizer, checkpoints, metrics.

Each section checks its own fields where it is constructed (`agentrl.config`); the rules that tie sections
together live in the run's config (`agentrl.run.config`). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentrl.config import check_types, require


# ---------------------------------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    # A hub id, a local directory, a .gguf file (or a directory holding one), or a name `agentrl.models.load_model`
    # knows (the embedded default, the tiny test models).
    name: str = "smollm2-135m-instruct"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    # None: sdpa on CPU; on GPU a varlen kernel over one flat row of the real tokens (agentrl.train.varlen_attention)
    # for bf16/fp16 models, dense or hybrid with hybrid_varlen: agentrl_varlen_cudnn (cuDNN's, for dense models on
    # Hopper with nvidia-cudnn-frontend installed) or agentrl_varlen (flash attention's); else flex_attention for
    # dense models and sdpa for hybrid ones (transformers refuses flex_attention for them).
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    # torch.compile each of the trainer's decoder layers (BENCHMARKS.md: the train-step table); the engine's view
    # compiles its own copies as engine.compile decides. None (resolved by agentrl.run.build.
    # compile_layers): on for CUDA runs, where the step is bound by launching dozens of small kernels a layer (a
    # hybrid model's convolution and delta rule stay fla's kernels, as graph breaks: agentrl.train.linear_conv);
    # off on CPU (nothing launch-bound to gain, and inductor would need a C++ toolchain), for a hybrid model off
    # its varlen kernels (each sample on its own, or the delta rule's per-sequence reference: never measured
    # compiled), under tensor parallelism (the split layers run hooks around each module) and in deterministic
    # runs (compiled kernels are tuned on the first shapes seen, which differ between a straight run and a resumed
    # one).
    compile_layers: bool | None = None
    # With compile_layers: the activation memory budget (0, 1] of each compiled layer's forward/backward split;
    # below 1 the partitioner recomputes the cheapest activations in the backward instead of saving them.
    activation_memory_budget: float = 1.0
    # Hybrid (linear-attention) models: pass sample boundaries to varlen kernels (flash-linear-attention, the `gpu`
    # extra) instead of running each sample on its own; the run verifies the kernels honour them before the first
    # step. None: on GPU (where the per-sample path is slow), never on CPU (where the per-sample path is exact).
    hybrid_varlen: bool | None = None
    # How prompts spell the tool tags (`<tool_call>`, `<tool_response>` and their ends): "tokens", as the tokenizer
    # encodes them (its added tokens where it has them); "text", as ordinary text pieces. Qwen2.5-Coder-0.5B never
    # emits its `<tool_call>` token, yet copies the tag written as text (BENCHMARKS.md, 2026-12-01 13:40); the parser
    # reads the tag from decoded text either way.
    tool_tags: Literal["tokens", "text"] = "tokens"

    def __post_init__(self):
        check_types(self, "model")
        require(bool(self.name), "model.name", "must not be empty")
        require(0 < self.activation_memory_budget <= 1, "model.activation_memory_budget", "must be in (0, 1]")


@dataclass
class LossConfig:
    type: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # dapo's asymmetric upper clip (0.28 in its paper); None = clip_eps
    tis_cap: float | None = 2.0  # truncated importance sampling cap; None = off
    max_staleness: int | None = None  # policy versions; None = no bound
    stale_weight: float = 0.0  # weight of tokens past max_staleness: 0 drops them, (0, 1) down-weights them
    dr_grpo_max_tokens: int = 4096  # dr_grpo's constant per-sample normaliser

    def __post_init__(self):
        check_types(self, "loss")
        require(0 < self.clip_eps < 1, "loss.clip_eps", "must be in (0, 1)")
        if self.clip_eps_high is not None:
            require(self.type == "dapo", "loss.clip_eps_high",
                     f"is dapo's asymmetric clip; {self.type} clips symmetrically (set loss.type=dapo)")
            require(self.clip_eps_high > 0, "loss.clip_eps_high", "must be > 0")
        if self.tis_cap is not None:
            require(self.tis_cap >= 1, "loss.tis_cap", "must be >= 1 (or none to turn it off)")
        if self.max_staleness is not None:
            require(self.max_staleness >= 0, "loss.max_staleness", "must be >= 0 (or none for no bound)")
        require(0 <= self.stale_weight < 1, "loss.stale_weight", "must be in [0, 1)")
        require(self.dr_grpo_max_tokens >= 1, "loss.dr_grpo_max_tokens", "must be >= 1")

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
        check_types(self, "optim")
        require(self.lr > 0, "optim.lr", "must be > 0")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        require(all(0 <= b < 1 for b in self.betas), "optim.betas", "must each be in [0, 1)")
        require(self.eps > 0, "optim.eps", "must be > 0")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        if self.max_grad_norm is not None:
            require(self.max_grad_norm > 0, "optim.max_grad_norm", "must be > 0 (or none for no clipping)")
        require(self.max_consecutive_skips >= 1, "optim.max_consecutive_skips", "must be >= 1")


@dataclass
class CheckpointConfig:
    run_dir: str = "runs/default"
    save_every: int = 100  # steps; 0 = only at the end
    keep_last: int = 2
    resume: bool = True  # continue from the latest checkpoint in run_dir if there is one

    def __post_init__(self):
        check_types(self, "checkpoint")
        require(bool(self.run_dir), "checkpoint.run_dir", "must not be empty")
        require(self.save_every >= 0, "checkpoint.save_every", "must be >= 0")
        require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")


@dataclass
class MetricsConfig:
    log_every: int = 1  # steps between lines of metrics.jsonl (the last step is always written)
    # Also send each step's numbers to these trackers (optional packages: pip install tensorboard / trackio).
    report_to: tuple[Literal["tensorboard", "trackio"], ...] = ()
    project: str = "agentrl"  # the trackio project
    # Every trained rollout to samples.jsonl: its tokens, turn spans, per-turn seeds and budgets, sampling
    # parameters, behaviour logprobs and policy versions, what `agentrl replay` needs to regenerate it.
    log_samples: bool = False

    def __post_init__(self):
        check_types(self, "metrics")
        from agentrl.train.tracking import missing

        absent = missing(self.report_to)
        require(not absent, "metrics.report_to", f"needs the {' and '.join(absent)} package "
                f"(pip install {' '.join(absent)}), which is not installed")
        require(self.log_every >= 1, "metrics.log_every", "must be >= 1")


@dataclass
class TrainerConfig:
    """How finished samples become forward/backward passes."""

    row_tokens: int = 8192  # packing capacity of one row
    row_pad_multiple: int = 128  # row width rounded up to this: fewer distinct shapes for compiled attention kernels
    logprob_chunk_size: int = 1024  # rows of the chunked lm_head (its fp32 logits: rows x vocab x 4 bytes)
    # Packed rows per forward/backward; gradients accumulate over the batch. None: as many rows as an estimate of
    # their activations fits in 16 GiB and a quarter of the GPU (agentrl.train.micro_batch): several for small models,
    # one for large ones.
    rows_per_micro_batch: int | None = None
    # Compute each rollout group's common prefix (the prompt, and any history its members share) once instead of
    # once per member (agentrl.train.prefix_pack); exact, and applied only where the forward supports it (dense
    # full-attention models under sdpa, eager, flex_attention or the varlen kernel; hybrid models under the varlen
    # kernel, each suffix resuming its prefix's recurrent state). false: unshared packing.
    share_prefix: bool = True
    # Replay each micro-batch's decoder forward and backward from CUDA graphs, one pair per shape bucket
    # (agentrl.train.flat_graphs): two launches where a small model's step launches thousands of kernels, each of
    # which waits for the GIL beside the engine's thread. None (resolved by agentrl.run.build.trainer_graphs): on for
    # CUDA runs whose forward takes the flat layout (dense models under the varlen kernel, hybrid ones under their
    # varlen kernels too, their chunks on a fixed grid, `linear_conv.chunk_indices`, unless their delta rule fell
    # back to the per-sequence reference, which reads boundaries on the host), except under tensor
    # parallelism (collectives inside the layers), in deterministic runs (a bucket's first micro-batch runs
    # eagerly, at a step that differs between a straight and a resumed run) and with release_kv_during_step (the
    # graphs keep their activation memory, which that option means to hand over). A hybrid's prefix-shared rows
    # stay eager, and a step with groups packs every row prefix-shared: with trainer.share_prefix on, only its
    # steps without groups replay.
    cuda_graphs: bool | None = None
    # Leave out of the forward and backward the samples whose advantage is 0 (a group whose members all scored
    # alike): they add exactly nothing to the gradient (agentrl.train.loss.carries_gradient), and the update stays
    # the one over every sample. The run's first step runs them all the same, so the trainer compiles there
    # (Trainer.first_step). false: run them anyway, e.g. for loss diagnostics over every token.
    skip_zero_advantage: bool = True

    def __post_init__(self):
        check_types(self, "trainer")
        for key in ("row_tokens", "row_pad_multiple", "logprob_chunk_size"):
            require(getattr(self, key) >= 1, f"trainer.{key}", "must be >= 1")
        require(self.rows_per_micro_batch is None or self.rows_per_micro_batch >= 1, "trainer.rows_per_micro_batch",
                "must be >= 1 (or none: from the model's size)")
