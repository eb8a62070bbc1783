"""The engine's knobs, and how the KV pool's size follows from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_ON_UPDATE = ("keep", "recompute")


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
    """

    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int | None = None
    gpu_memory_fraction: float = 0.3
    cpu_kv_memory_bytes: int = 256 << 20
    max_num_seqs: int = 128
    max_tokens_per_step: int = 1024
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    eos_token_ids: tuple[int, ...] | None = None
    seed: int = 0
    kv_on_update: str = "keep"
    attention_backend: str = "torch"

    def __post_init__(self):
        for name in ("page_size", "max_num_seqs", "max_tokens_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"kv_on_update must be one of {KV_ON_UPDATE}, got {self.kv_on_update!r}")
        if self.eos_token_ids is not None:
            self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)

    def resolve_num_pages(self, bytes_per_page: int, device: torch.device) -> int:
        if self.num_pages is not None:
            return self.num_pages
        if self.kv_memory_bytes is not None:
            budget = self.kv_memory_bytes
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * self.gpu_memory_fraction)
        else:
            budget = self.cpu_kv_memory_bytes
        pages = budget // max(bytes_per_page, 1)
        if pages < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no page of {bytes_per_page} bytes")
        return pages
