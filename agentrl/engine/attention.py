"""Paged attention: the backend interface, and the function transformers calls in every attention layer.

Per step the engine builds one `StepMetadata` (`step_layout.py`: slot of every new token, each sequence's query
span, context length and block table); every attention layer then does two things through the backend:

    write_kv(k_cache, v_cache, key, value, meta)     new K/V go to their slots
    attend(k_cache, v_cache, query, meta, scaling)   each query attends over its sequence's pages

That pair is the whole interface, so the Triton kernels (`triton_backend.py`, the default on CUDA) replace the
torch reference (`torch_backend.py`) without touching the model view or the scheduler, and a CUDA graph captured
around a fixed-shape step (`cuda_graphs.py`) replays them; `backends.py` names them and picks one.
`prepare(meta)` runs once per step for whatever the backend wants to precompute (gather indices and masks, a
dtype), so layers do no host work.

Layout: a layer's caches are `[num_pages, page_size, num_kv_heads, head_dim]` (views into KVStorage,
last dim contiguous); `key`/`value` are `[T, num_kv_heads, head_dim]` and `query` `[T, num_heads,
head_dim]` after RoPE; `attend` returns `[T, num_heads, head_dim]`. Query row j of sequence s sits at
position `seq_lens[s] - query_len[s] + j` and sees every cached position up to its own.

The model view's attention modules reach the step through `stepping(step)` / `current_step()` rather than
through their kwargs (see `stepping`); `register()` installs `paged_attention_forward` under
`ATTN_IMPLEMENTATION`.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from agentrl.engine.step_layout import StepMetadata

ATTN_IMPLEMENTATION = "agentrl_paged"
_current = threading.local()


class AttentionBackend:
    """What a paged-attention backend implements; `backends.make_backend` builds one by name."""

    # True when prepare/write_kv/attend of a static step issue only device work with no host sync, so a CUDA
    # graph can capture them.
    supports_graphs = False

    def prepare(self, meta: StepMetadata) -> None:
        pass

    def decode_splits(self, num_seqs: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                      device: torch.device) -> int | None:
        """The split-K count a decode launch of this shape would choose (None: the backend has no such knob).
        A captured graph pins the count chosen for its bucket at the longest context."""
        return None

    def tokens_per_tile(self, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
        """Query tokens per row of a mixed step's tile table (the reference backend reads the layout itself, so
        any tiling serves it)."""
        return 64

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 meta: StepMetadata) -> None:
        raise NotImplementedError

    def attend(self, key_cache: torch.Tensor, value_cache: torch.Tensor, query: torch.Tensor, meta: StepMetadata,
               scaling: float) -> torch.Tensor:
        raise NotImplementedError


class PagedStep:
    """What one forward step hands to every attention layer (through `stepping`)."""

    def __init__(self, backend: AttentionBackend, storage, meta: StepMetadata, layer_slot: dict[int, int]):
        self.backend, self.storage, self.meta, self.layer_slot = backend, storage, meta, layer_slot

    def attention(self, module, query, key, value, scaling):
        layer = self.layer_slot[module.layer_idx]
        k_cache, v_cache = self.storage.key_cache(layer), self.storage.value_cache(layer)
        # [1, H, T, D] -> [T, H, D]: the packed step is one row, so drop it
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        self.backend.write_kv(k_cache, v_cache, k, v, self.meta)
        out = self.backend.attend(k_cache, v_cache, q, self.meta, scaling)
        return out.unsqueeze(0), None  # [1, T, Hq, D], as transformers' attention functions return


@contextlib.contextmanager
def stepping(step: PagedStep):
    """Make `step` what every paged attention layer of forwards on this thread reads.

    The step travels beside the forward rather than through its kwargs so that compiled decoder layers never see
    it: a new object every step would be a new guard, and a recompile, every step."""
    previous = getattr(_current, "step", None)
    _current.step = step
    try:
        yield step
    finally:
        _current.step = previous


def current_step() -> PagedStep | None:
    return getattr(_current, "step", None)


@torch.compiler.disable  # a compiled decoder layer breaks its graph here and calls the kernels eagerly
def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step = current_step()
    if step is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} was called outside `attention.stepping(...)`: only "
            "the engine's model view should use it"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return step.attention(module, query, key, value, scaling)


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
