"""Varlen attention for the training forward: the micro-batch's samples end to end in one row, boundaries given.

flex_attention on packed `[R, T]` rows computes the rows' padding and is slower than flash attention (BENCHMARKS.md,
train step). Flash attention's varlen kernel takes the real tokens as one flat row
`[1, N]` plus cumulative sample boundaries (`cu_seqlens`) and attends causally within each sample only, so neither
the padding nor the attention between samples is computed. `logprobs.packed_hidden_states` builds that flat row
whenever the model's attention implementation is one registered here (`takes_flat_layout`).

Transformers passes `cu_seq_lens_q/k` and `max_length_q/k` given to the decoder's forward through every layer to
the attention function unchanged; implementations it does not know get no mask built (the boundaries are the
mask). Registered `traced`, the attention function is traced into compiled decoder layers: the kernel is an op
with a fake implementation taking the max lengths as `SymInt`s (flash's aten op, `cudnn_attention`'s), so dynamic
layers neither recompile on them nor break their graph. A graph break there costs a copy of each of q, k and v's
gradients: the compiled layer hands them over as transposed views, and a dynamic layer's backward plans their
incoming gradients contiguous (functorch guesses tangent strides only for static shapes). Otherwise (a kernel that
is not an op, like `reference_kernel`) it is kept out of `torch.compile` (`torch.compiler.disable`).

A prefix-shared batch (`prefix_forward`) also passes `kv_index`: the keys and values are gathered by it before
the kernel runs, so a query sequence (a suffix) can have keys that are not contiguous in the row (the prefix, then
its own tokens), with `cu_seq_lens_k` counting sequences in the gathered keys. Where a sequence has more keys than
queries, the causal mask is aligned to the end of its keys, as flash attention's varlen kernel aligns it.

The kernel is a parameter so the same plumbing runs on CPU with `reference_kernel` (per-sample SDPA), which is
how the tests check the flat layout without a GPU. Nothing CUDA-specific runs at import or registration.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "agentrl_varlen"
CUDNN_IMPLEMENTATION = "agentrl_varlen_cudnn"  # the same plumbing around `cudnn_attention.cudnn_kernel`
FA4_IMPLEMENTATION = "agentrl_varlen_fa4"  # and around `fa4_attention.fa4_kernel`
KV_INDEX = "agentrl_kv_index"  # the kwarg naming, for each gathered key, its position in the flat row

# Implementations that read sample boundaries from the kwargs and so need the flat layout.
_FLAT: set[str] = set()

# (q [T, Hq, D], k [T, Hkv, D], v, cu_q, cu_k, max_q, max_k, scale, causal, dropout) -> [T, Hq, D]
Kernel = Callable[..., torch.Tensor]


def flash_kernel(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool, dropout: float):
    """Flash attention's varlen forward (CUDA, fp16/bf16). The aten op is differentiable (FlashAttentionBackward)
    and takes fewer kv heads than query heads as they are (GQA). It needs a unit stride on the head dim only;
    `.contiguous()` is a no-op for the layouts transformers hands in and keeps any other layout safe."""
    out = torch.ops.aten._flash_attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, dropout, causal, False, scale=scale)
    return out[0]


def reference_kernel(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool, dropout: float):
    """Each segment through SDPA on its own: exact, slow, any device and dtype (the CPU stand-in for flash). A
    segment with more keys than queries is causal from the end of its keys, as in flash attention."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    gqa = q.shape[1] != k.shape[1]
    pieces = []
    for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        if q1 == q0:
            continue
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        mask = None
        if causal and k1 - k0 != q1 - q0:  # SDPA's is_causal would align to the start of the keys
            mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).tril((k1 - k0) - (q1 - q0))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout,
                                           is_causal=causal and mask is None, scale=scale, enable_gqa=gqa)
        pieces.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(pieces)


class _KeysNoSegmentReads(torch.autograd.Function):
    """Identity on the gathered keys and values; the backward zeroes the gradient rows of entries that no segment
    reads (those at and past `cu_k[-1]`). Flash attention's varlen backward never writes those rows (its gradient
    buffers start uninitialized), and a prefix-shared row on a bucket's shape has such entries: the gathered keys are
    padded to the bucket with index 0. Their gradient would be whatever the memory held, added by the gather's
    backward into the keys and values of the row's first token: wrong weights, or NaN ones."""

    @staticmethod
    def forward(ctx, k, v, cu_k):
        ctx.save_for_backward(cu_k)
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dk, dv):
        (cu_k,) = ctx.saved_tensors
        read = (torch.arange(dk.shape[0], device=dk.device) < cu_k[-1]).view(-1, *[1] * (dk.dim() - 1))
        return torch.where(read, dk, 0), torch.where(read, dv, 0), None


def make_attention(kernel: Kernel, name: str, traced: bool = False):
    """A transformers attention function `(module, query, key, value, attention_mask, ...)` around `kernel`.
    `traced`: compiled layers trace through it (the kernel must be an op with a fake implementation) instead of
    breaking their graph around it."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
        missing = [k for k in names if kwargs.get(k) is None]
        if missing:
            raise RuntimeError(
                f"attention implementation {name!r} needs the sample boundaries ({', '.join(missing)} missing): "
                "it attends within the segments of one flat row and never builds a mask. Run the model through "
                "agentrl.train.logprobs (which passes them), or give this call another attn_implementation")
        if query.shape[0] != 1:
            raise ValueError(f"attention implementation {name!r} takes one flat row, got a batch of {query.shape[0]}")
        if kwargs.get("sliding_window") is not None:
            raise NotImplementedError(f"attention implementation {name!r} has no sliding window")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        cu_q, cu_k = (kwargs[k].to(device=query.device, dtype=torch.int32) for k in ("cu_seq_lens_q", "cu_seq_lens_k"))
        # [1, H, T, D] -> [T, H, D]: the flat layout has one row. A view, not t[0]: indexing's backward writes each
        # gradient into a zeroed copy of the whole input (a fill and a strided copy per tensor and layer, a visible
        # share of a step's backward: BENCHMARKS.md).
        q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))
        if kwargs.get(KV_INDEX) is not None:  # a prefix-shared row: each query sequence's keys, gathered
            # along the flat tokens, so the gathered keys are contiguous for the kernel and their gradient's
            # scatter lands in the flat layout the view above hands back
            index = kwargs[KV_INDEX].to(query.device)
            k, v = k.index_select(0, index), v.index_select(0, index)
        if kwargs.get(KV_INDEX) is not None and torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            k, v = _KeysNoSegmentReads.apply(k, v, cu_k)
        max_q, max_k = kwargs["max_length_q"], kwargs["max_length_k"]
        if not traced:  # traced, they stay symbolic (int() would specialise the layer on each value)
            max_q, max_k = int(max_q), int(max_k)
        out = kernel(q, k, v, cu_q, cu_k, max_q, max_k, float(scaling), bool(getattr(module, "is_causal", True)),
                     float(dropout))
        return out[None], None  # [1, T, Hq, D], as transformers' attention functions return

    return attention if traced else torch.compiler.disable(attention)


def register(name: str = ATTN_IMPLEMENTATION, kernel: Kernel = flash_kernel, traced: bool = False) -> str:
    """Register `kernel` with transformers as attention implementation `name` (flat layout); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, make_attention(kernel, name, traced))
    _FLAT.add(name)
    return name


def takes_flat_layout(model) -> bool:
    """Whether `model` (or its decoder) runs an implementation registered here, which needs the flat layout."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) in _FLAT


def varlen_attention_available() -> bool:
    """CUDA with flash attention (sm80 or newer) and the aten varlen op."""
    if not torch.cuda.is_available() or not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    built = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if built is not None and not built():
        return False
    return torch.cuda.get_device_capability()[0] >= 8

