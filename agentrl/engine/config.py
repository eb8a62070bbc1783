"""The engine's knobs (the `engine:` section of a run's config), and how the KV pool's size follows from them.

Imports no torch, so a run's config is checked before anything heavy loads; the one device query the pool size
needs is passed in (`free_device_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentrl.config import check_types, require


@dataclass
class EngineConfig:
    """How the engine batches, caches and samples.

    Pool size: `num_pages` if set, else `kv_memory_bytes // bytes_per_page`, else on an accelerator
    `gpu_memory_fraction` of the memory free at construction, else (CPU) `cpu_kv_memory_bytes`.
    `max_model_len` defaults to the model's `max_position_embeddings`, capped by what the pool can hold.

    `kv_on_update` says what a `bump_version()` does to KV already computed:
    - "keep": live sequences and the prefix cache go on with KV computed by the older weights, as the
      zero-sync design intends (the version tags and behaviour logprobs record what was sampled);
    - "recompute": live sequences are re-prefilled under the new weights and the prefix cache is emptied,
      so every token after the bump is exactly on-policy, at the cost of one prefill of all live context.
    `prefix_cache_max_age` bounds "keep" for the prefix cache: a cached page registered more than this many
    versions ago is not reused but computed again (`kv_pool`). None: reused for ever, so a prompt every rollout
    shares keeps the KV of the weights that first computed it for the whole run. 8: above the staleness of every
    token a measured run trained on (BENCHMARKS.md, learning), so the history a resubmitted turn extends is still
    served; a shared prompt is then computed about once in 8 steps.

    `attention_backend`: "auto" takes the Triton kernels on CUDA (when triton imports and `page_size` is a
    power of two) and the torch reference elsewhere; "torch" / "triton" force one.
    `cuda_graphs`: replay pure-decode steps from CUDA graphs captured per batch-size bucket (CUDA with the
    Triton backend only, and not on a tensor-parallel model; see `agentrl.engine.cuda_graphs`); hybrid models'
    decode steps too. The graphs read the parameters by address, so
    they stay valid across optimizer steps that update parameters in place, which is what the engine
    requires anyway (the view shares the training tensors); a re-assigned parameter is noticed and the
    graphs are captured again. With `mixed_step_graphs`, steps that prefill replay graphs too, one per token
    bucket (powers of two up to `max_tokens_per_step`), all captured at the first step that prefills (not for
    hybrid models, whose prefill chunks run per sequence).
    `overlap`: queue step n+1 on the device before waiting for step n's sampled tokens (they reach step n+1 on
    the device), so host bookkeeping and scheduling run while the device computes. Off: each step is waited for
    before the next is scheduled. Outputs are identical either way.
    `compile`: torch.compile the view's decoder layers (None: on CUDA, a hybrid's around its delta-net state
    updates; never on a tensor-parallel model); the training model is untouched. Costs a compile at the first
    steps.
    On a tensor-parallel model every tp rank must use the same config (checked when the engine is built).
    `separate_stream`: the background thread (`Engine.start()`, as in training) queues its kernels on a CUDA stream
    of its own rather than the one the trainer's thread uses, so the GPU may run decode steps and training kernels
    side by side; what both touch is ordered by `Engine.pause()` and the KV release (`agentrl.engine.streams`).
    Off by default: while the trainer's step is bound by the host it measured no faster (BENCHMARKS.md, "Engine and
    trainer on one GPU").
    `state_snapshots` (hybrid models, with the prefix cache): how many linear-attention state snapshots the
    prefix cache keeps as resume points (see `agentrl.engine.state_snapshots`); None: `max_num_seqs`, as many as
    a quarter of the pool's budget holds. They are paid for out of the pool's budget (fewer pages), unless
    `num_pages` is given. 0 turns the prefix cache off for hybrid models.
    `max_tokens_per_step`: the tokens one step schedules (decodes and prompt chunks together). None: by model,
    `resolve_max_tokens_per_step`: 1024 for a dense model, whose steps that prefill replay one CUDA graph per token
    bucket up to it; 32768 for a hybrid one, whose steps that prefill run eagerly and are bound by the host's work a
    linear-attention layer (fla's launches), about the same for 8k tokens as for 32k, so fewer, larger steps prefill
    faster (BENCHMARKS.md, hybrid decode by prefill budget).
    `fuse_projections`: run a gated MLP's gate and up, and a gated delta net's four input projections, as one GEMM
    each, by re-pointing the model's parameters at consecutive rows of one buffer per group (the same Parameter
    objects and values; see `agentrl.engine.fused_projections`). Skipped under tensor parallelism.
    `max_model_len`, `eos_token_ids` and `seed`: in a run these follow from the rollout's `max_sample_tokens`,
    the chat format and the run's seed when left unset.
    """

    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int | None = None
    gpu_memory_fraction: float = 0.3
    cpu_kv_memory_bytes: int = 256 << 20
    max_num_seqs: int = 128
    max_tokens_per_step: int | None = None
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    eos_token_ids: tuple[int, ...] | None = None
    seed: int = 0
    kv_on_update: Literal["keep", "recompute"] = "keep"
    prefix_cache_max_age: int | None = 8
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    cuda_graphs: bool = True
    mixed_step_graphs: bool = True
    overlap: bool = True
    compile: bool | None = None
    separate_stream: bool = False
    state_snapshots: int | None = None
    fuse_projections: bool = True

    def __post_init__(self):
        check_types(self, "engine")
        for name in ("page_size", "max_num_seqs", "cpu_kv_memory_bytes"):
            require(getattr(self, name) >= 1, f"engine.{name}", "must be >= 1")
        require(self.state_snapshots is None or self.state_snapshots >= 0, "engine.state_snapshots", "must be >= 0")
        require(self.prefix_cache_max_age is None or self.prefix_cache_max_age >= 0, "engine.prefix_cache_max_age",
                "must be >= 0 (or none for no bound)")
        for name in ("num_pages", "kv_memory_bytes", "max_model_len", "max_tokens_per_step"):
            require(getattr(self, name) is None or getattr(self, name) >= 1, f"engine.{name}", "must be >= 1")
        require(0 < self.gpu_memory_fraction <= 1, "engine.gpu_memory_fraction", "must be in (0, 1]")

    def resolve_num_pages(self, bytes_per_page: int, free_device_bytes: int | None,
                          bytes_per_snapshot: int = 0) -> tuple[int, int]:
        """(pages in the pool, state snapshots); `free_device_bytes` is the accelerator's free memory (None on
        CPU), `bytes_per_snapshot` what one linear-attention state snapshot weighs (0: the model has none)."""
        budget = self.kv_memory_bytes
        if budget is None:
            budget = (int(free_device_bytes * self.gpu_memory_fraction) if free_device_bytes is not None
                      else self.cpu_kv_memory_bytes)
        snapshots = 0
        if bytes_per_snapshot:
            snapshots = self.state_snapshots
            if snapshots is None:
                snapshots = min(self.max_num_seqs, budget // 4 // bytes_per_snapshot)
        if self.num_pages is not None:
            return self.num_pages, snapshots
        budget -= snapshots * bytes_per_snapshot
        pages = budget // max(bytes_per_page, 1)
        if pages < 1:
            raise ValueError(f"a KV budget of {budget} bytes (after {snapshots} state snapshots) holds no page of "
                             f"{bytes_per_page} bytes")
        return pages, snapshots


DENSE_STEP_TOKENS = 1024
HYBRID_STEP_TOKENS = 32768


def resolve_max_tokens_per_step(config: EngineConfig, hybrid: bool) -> int:
    """`config.max_tokens_per_step`, else the default for the model's kind (see `EngineConfig`)."""
    if config.max_tokens_per_step is not None:
        return config.max_tokens_per_step
    return HYBRID_STEP_TOKENS if hybrid else DENSE_STEP_TOKENS


def resolve_eos_ids(config: EngineConfig, model, tokenizer=None) -> tuple[int, ...]:
    """The ids that end a request unless `ignore_eos`: the config's, else the model's generation config's,
    else its config's, else the tokenizer's."""
    if config.eos_token_ids is not None:
        return config.eos_token_ids
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config.get_text_config(), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int | None, capacity: int) -> int:
    """`config.max_model_len` (checked against the pool's `capacity` in tokens), else the model's limit capped
    by the pool."""
    asked = config.max_model_len
    if asked is not None:
        if asked > capacity:
            raise ValueError(f"max_model_len {asked} exceeds the KV pool's {capacity} token slots; "
                             "raise num_pages / kv_memory_bytes or lower max_model_len")
        return asked
    return min(max_position_embeddings or capacity, capacity)
