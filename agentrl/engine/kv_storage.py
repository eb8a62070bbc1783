"""The device memory behind the paged KV pool, and handing it back for a training step.

One tensor `[layers, 2 (k, v), pages, page_size, kv_heads, head_dim]`: a page id means the same slots in
every layer, so one block table serves all of them, and saving or restoring a set of pages is one gather.

Release keeps live pages by copying them to host memory rather than dropping them to be recomputed:
- it is exact, bit for bit, where a recompute runs the prompt through prefill instead of decode kernels
  (different reduction orders) and, after a weight update, through different weights;
- it costs what the live KV weighs, not the pool, far less than prefilling the same contexts again
  (BENCHMARKS.md); the zero-sync design this project comes from released its whole cache this way every step
  at no measurable cost per step.
"""

from __future__ import annotations

import torch


class KVStorage:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.kv: torch.Tensor | None = self._allocate()
        self._saved: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def _allocate(self) -> torch.Tensor:
        # Zeroed, not empty: the reference attention multiplies masked slots by a zero weight, and
        # uninitialised memory can hold NaN, which survives that product.
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    @property
    def released(self) -> bool:
        return self.kv is None

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def release(self, live_pages: list[int]) -> int:
        """Copy `live_pages` to host memory and drop the device tensor. Returns the bytes saved."""
        if self.kv is None:
            return 0
        index = torch.tensor(live_pages, dtype=torch.long, device=self.device)
        saved = self.kv.index_select(2, index)
        if self.device.type != "cpu":
            host = torch.empty(saved.shape, dtype=saved.dtype, pin_memory=True)
            host.copy_(saved)
            saved = host
        self._saved = (index.cpu(), saved)
        self.kv = None
        return saved.numel() * saved.element_size()

    def restore(self) -> None:
        if self.kv is not None:
            return
        self.kv = self._allocate()
        if self._saved is not None:
            index, saved = self._saved
            self.kv.index_copy_(2, index.to(self.device), saved.to(self.device, non_blocking=True))
            self._saved = None
