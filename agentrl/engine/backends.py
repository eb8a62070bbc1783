"""The attention backends by name, each imported only when asked for.

A name maps to a loader that imports its backend's module and returns the class, so the Triton backend (and
triton itself) load only where they run, and no backend module needs to import this one or register itself.
"""

from __future__ import annotations

from typing import Callable

import torch

from agentrl.engine.attention import AttentionBackend


def _torch() -> type[AttentionBackend]:
    from agentrl.engine.torch_backend import TorchPagedAttention

    return TorchPagedAttention


def _triton() -> type[AttentionBackend]:
    from agentrl.engine.triton_backend import TritonPagedAttention  # imports triton: ImportError without it

    return TritonPagedAttention


BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {"torch": _torch, "triton": _triton}


def make_backend(name: str, device: torch.device, page_size: int) -> AttentionBackend:
    """The backend called `name`; "auto" is Triton on CUDA (if triton imports and pages are a power of two,
    as its kernels require), else the torch reference."""
    power_of_two = page_size & (page_size - 1) == 0
    if name == "auto":
        if device.type == "cuda" and power_of_two:
            try:
                return _triton()()
            except ImportError:
                pass
        return _torch()()
    if name not in BACKENDS:
        raise ValueError(f"attention_backend {name!r}: one of {sorted({'auto', *BACKENDS})}")
    if name == "triton" and not power_of_two:
        raise ValueError(f"the triton backend needs a power-of-two page_size, got {page_size}")
    return BACKENDS[name]()()
