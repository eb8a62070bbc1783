"""FlashAttention-4's varlen kernels (the `flash-attn-4` package, CuTe DSL) over the flat layout, as traceable ops.

On Hopper its backward is a warp-specialized wgmma kernel written for sm90, where cuDNN's fused backward (the other
Hopper choice, `cudnn_attention`) is the share of the Qwen3-0.6B train step that runs furthest below the tensor
cores' rate (BENCHMARKS.md, train step). Same contract as `cudnn_attention`: packed `[T, H, D]` tensors, `cu_seqlens`
boundaries on the device, fewer kv heads than query heads as they are, the causal mask aligned to the end of each
sequence's keys (prefix-shared rows need that). `agentrl::fa4_varlen_fwd` / `_bwd` take the longest lengths as
`SymInt`s and have fake kernels, so dynamic compiled layers trace through them without recompiles or a graph break.

The package compiles each kernel configuration once per process on first use (CuTe DSL's JIT; seconds) and launches
on the current stream without host syncs, so the trainer's CUDA graphs capture it. Importing this module needs only
torch: the package is imported on the first call.
"""

from __future__ import annotations

import importlib.util

import torch


def fa4_varlen_available() -> bool:
    """CUDA on Hopper (sm90; the kernels this module was measured with) and the `flash-attn-4` package."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # `flash_attn` itself absent
        return False


def _interface():
    from flash_attn.cute import interface

    return interface


@torch.library.custom_op("agentrl::fa4_varlen_fwd", mutates_args=())
def fa4_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   max_q: int, max_k: int, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Output `[T, Hq, D]` and the softmax's log-sum-exp `[Hq, T]` (fp32), what the backward needs."""
    out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                                max_seqlen_k=max_k, softmax_scale=scale, causal=causal,
                                                return_lse=True)
    return out, lse


@fa4_varlen_fwd.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("agentrl::fa4_varlen_bwd", mutates_args=())
def fa4_varlen_bwd(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, *_ = _interface()._flash_attn_bwd(
        q, k, v, out, grad, lse, softmax_scale=scale, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max_q, max_seqlen_k=max_k, deterministic=torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv


@fa4_varlen_bwd.register_fake
def _(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.lengths, ctx.scale, ctx.causal = (max_q, max_k), scale, causal


def _backward(ctx, grad, _lse_grad):  # the log-sum-exp is an internal of the pair, never differentiated
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = fa4_varlen_bwd(grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.lengths, ctx.scale,
                                ctx.causal)
    return dq, dk, dv, None, None, None, None, None, None


fa4_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_kernel(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool, dropout: float):
    """The `varlen_attention.Kernel` over FlashAttention-4 (Hopper, fp16/bf16). No dropout: the kernels have none."""
    if dropout:
        raise NotImplementedError("the FlashAttention-4 varlen kernel has no attention dropout")
    out, _ = fa4_varlen_fwd(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, scale, causal)
    return out
