"""cuDNN's fused attention over the flat layout, as traceable ops: the training forward's varlen kernel on Hopper.

NVIDIA's cudnn-frontend package (`nvidia-cudnn-frontend`, module `cudnn`) ships `torch.ops.cudnn.sdpa_fwd` and
`sdpa_bwd`: cuDNN SDPA graphs over packed `[T, H, D]` tensors with `cu_seqlens` boundaries (ragged offsets on the
device), fewer kv heads than query heads as they are, the causal mask aligned to the end of each sequence's keys
when asked (as flash attention's varlen kernel aligns it, which prefix-shared rows need). On the H200 its forward
and backward over the Qwen3-0.6B rows take a fifth less time than flash attention's (BENCHMARKS.md, train step).

The package's ops take the longest sequence lengths as plain `int`s, so a compiled layer that traced them would
specialise on each value; `agentrl::cudnn_varlen_fwd` / `_bwd` wrap them with `SymInt` lengths and fake kernels,
so the attention traces into dynamic compiled layers without recompiles or a graph break (a graph break there
copies q, k and v's gradients into the compiled backward's planned layout: BENCHMARKS.md). The backward hands the
package's backward the forward's log-sum-exp in the padded layout it takes (its own conversion, on the device).

The package builds one cuDNN graph per (sequences, longest sequence, total tokens) it meets (its build time is not
measured apart); the trainer's buckets (`flat_graphs.Buckets`) keep those few. Importing this module needs only torch: the
package is imported on the first call.
"""

from __future__ import annotations

import importlib.util

import torch


def cudnn_varlen_available() -> bool:
    """CUDA (sm80 or newer) and NVIDIA's cudnn-frontend package."""
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
            and importlib.util.find_spec("cudnn") is not None)


def _package_ops():
    import cudnn.sdpa.fwd.torch_op as ops  # registers torch.ops.cudnn.sdpa_fwd / sdpa_bwd

    return ops


@torch.library.custom_op("agentrl::cudnn_varlen_fwd", mutates_args=())
def cudnn_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Output `[T, Hq, D]` and the softmax's log-sum-exp `[T, Hq, 1]` (fp32), what the backward needs."""
    _package_ops()
    return torch.ops.cudnn.sdpa_fwd(q, k, v, scale, is_causal=causal, causal_bottom_right=causal, cu_seqlens_q=cu_q,
                                    cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k, return_lse=True)


@cudnn_varlen_fwd.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[0], q.shape[1], 1,
                                                                          dtype=torch.float32)


@torch.library.custom_op("agentrl::cudnn_varlen_bwd", mutates_args=())
def cudnn_varlen_bwd(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
                     causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ops = _package_ops()
    padded = ops.thd_lse_to_padded(lse[:, :, 0], cu_q, max_q)  # the layout the package's backward takes
    return torch.ops.cudnn.sdpa_bwd(grad, q, k, v, out, padded, scale, is_causal=causal, causal_bottom_right=causal,
                                    cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k,
                                    is_deterministic=torch.are_deterministic_algorithms_enabled())


@cudnn_varlen_bwd.register_fake
def _(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.lengths, ctx.scale, ctx.causal = (max_q, max_k), scale, causal


def _backward(ctx, grad, _lse_grad):  # the log-sum-exp is an internal of the pair, never differentiated
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = cudnn_varlen_bwd(grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.lengths, ctx.scale,
                                  ctx.causal)
    return dq, dk, dv, None, None, None, None, None, None


cudnn_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def cudnn_kernel(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool, dropout: float):
    """The `varlen_attention.Kernel` over cuDNN (CUDA, fp16/bf16). No dropout: the ops have none."""
    if dropout:
        raise NotImplementedError("the cuDNN varlen kernel has no attention dropout")
    out, _ = cudnn_varlen_fwd(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, scale, causal)
    return out
