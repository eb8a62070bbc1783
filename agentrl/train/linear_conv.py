"""Sample boundaries for the short causal convolution of linear-attention layers in a packed row.

A hybrid model's gated-delta-net layer runs a depthwise causal convolution (a window of `kernel` positions) before
its delta rule. In a packed row, the first `kernel - 1` positions of a sample would read the end of the sample
before it. flash-linear-attention's delta rule takes the boundaries (`cu_seqlens`), but transformers calls its
convolution through `causal_conv1d_fn`, whose PyTorch fallback (used whenever the `causal-conv1d` package is absent)
ignores them, and the package's own kernel takes `seq_idx`, not `cu_seqlens`. So while a packed forward runs,
`packed_conv_boundaries` replaces that function in the model's modeling module with one that keeps each output
within its own sample (reading zeros before it, as a sample run alone does): on CUDA with flash-linear-attention,
that package's varlen convolution, which takes `cu_seqlens`; elsewhere, the original convolution over the samples
spread apart by `kernel - 1` zeros, the real positions gathered back.

Where flash-linear-attention's delta rule cannot train (its backward refuses some Triton and GPU combinations;
the run finds out before its first step), `use_reference_delta_rule` marks the model so that the same context
also replaces the chunked delta rule by transformers' PyTorch reference run sample by sample over `cu_seqlens`:
the rest of the layer stays packed, and each sample's recurrence starts from zero state as it does alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import inspect
import sys

import torch

# The active boundaries and the row's length, read on the host once per forward: a read per layer (int(cu[-1]))
# would make the host wait for the device at every linear-attention layer.
_CU_SEQLENS: contextvars.ContextVar[tuple[torch.Tensor, int] | None] = contextvars.ContextVar(
    "agentrl_conv_cu_seqlens", default=None)
_MARK = "_agentrl_boundary_conv"
_REFERENCE_RULE = "_agentrl_reference_delta_rule"  # set on a model's linear-attention layers
_RULE = "torch_chunk_gated_delta_rule"  # the name transformers' gated delta nets call their chunked rule by


def spread_index(cu_seqlens: torch.Tensor, length: int, gap: int) -> torch.Tensor:
    """Where each of the row's `length` positions goes once every segment is preceded by `gap` zeros."""
    bounds = cu_seqlens.to(torch.long)
    segment = torch.bucketize(torch.arange(length, device=bounds.device), bounds[1:], right=True)
    return torch.arange(length, device=bounds.device) + (segment + 1) * gap


def varlen_conv():
    """flash-linear-attention's causal convolution over `cu_seqlens` (Triton, forward and backward), or None where
    the package is absent."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


def _boundary_conv(conv):
    def conv_within_samples(hidden_states: torch.Tensor, weight, bias=None, activation=None, **kwargs):
        active = _CU_SEQLENS.get()
        batch, channels, length = hidden_states.shape
        if active is None or batch != 1 or active[1] != length:
            return conv(hidden_states, weight, bias, activation, **kwargs)
        cu = active[0]
        fla_conv = varlen_conv() if hidden_states.is_cuda else None
        if fla_conv is not None:
            # The samples' own kernel: no spreading, and a Triton backward rather than cuDNN's depthwise one.
            # `hidden_states` is [1, D, T] as the layer lays it out: a transposed view of [1, T, D].
            out, _ = fla_conv(hidden_states.transpose(1, 2), weight, bias, activation=activation,
                              cu_seqlens=cu.to(torch.int32))
            return out.transpose(1, 2)
        gap = weight.shape[-1] - 1
        index = spread_index(cu, length, gap)
        spread = hidden_states.new_zeros(1, channels, length + (cu.numel() - 1) * gap)
        spread[..., index] = hidden_states
        return conv(spread, weight, bias, activation, **kwargs)[..., index]

    setattr(conv_within_samples, _MARK, True)
    return conv_within_samples


def _segmented_rule(rule):
    """The PyTorch reference of `rule` run once per sample of `cu_seqlens`, from zero state (no final state: the
    training forward keeps none)."""
    reference = inspect.unwrap(rule)

    def rule_within_samples(query, key, value, g, beta, cu_seqlens=None, initial_state=None,
                            output_final_state=False, **kwargs):
        active = _CU_SEQLENS.get()
        cu = cu_seqlens if cu_seqlens is not None else (active[0] if active is not None else None)
        if cu is None or query.shape[0] != 1 or initial_state is not None or output_final_state:
            return rule(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
                        output_final_state=output_final_state, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k in ("chunk_size", "use_qk_l2norm_in_kernel")}
        bounds = cu.tolist()
        outs = [reference(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b], **kwargs)[0]
                for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return torch.cat(outs, dim=1), None

    setattr(rule_within_samples, _MARK, True)
    return rule_within_samples


def use_reference_delta_rule(model) -> None:
    """From now on, packed forwards of `model` (inside `packed_conv_boundaries`) run the chunked delta rule
    through the PyTorch reference, sample by sample."""
    for layer in model.modules():
        if hasattr(layer, "conv1d") and hasattr(sys.modules.get(type(layer).__module__), _RULE):
            setattr(layer, _REFERENCE_RULE, True)


def _modeling_modules(model) -> list:
    """The modules defining `causal_conv1d_fn` that the model's linear-attention layers call."""
    found = []
    for layer in model.modules():
        module = sys.modules.get(type(layer).__module__)
        if hasattr(layer, "conv1d") and hasattr(module, "causal_conv1d_fn") and module not in found:
            found.append(module)
    return found


@contextlib.contextmanager
def packed_conv_boundaries(model, cu_seqlens: torch.Tensor, length: int | None = None):
    """While active, the linear-attention convolutions of `model` stay within the samples `cu_seqlens` bounds
    (the cumulative boundaries of one flat row, `[0, n1, n1 + n2, ..., length]`). `length`: the row's length where
    the caller knows it on the host (else it is read from `cu_seqlens`, one wait for the device)."""
    patched = []
    reference = any(getattr(layer, _REFERENCE_RULE, False) for layer in model.modules())
    for module in _modeling_modules(model):
        if not getattr(module.causal_conv1d_fn, _MARK, False):
            patched.append((module, "causal_conv1d_fn", module.causal_conv1d_fn))
            module.causal_conv1d_fn = _boundary_conv(module.causal_conv1d_fn)
        if reference and hasattr(module, _RULE) and not getattr(getattr(module, _RULE), _MARK, False):
            patched.append((module, _RULE, getattr(module, _RULE)))
            setattr(module, _RULE, _segmented_rule(getattr(module, _RULE)))
    token = _CU_SEQLENS.set((cu_seqlens, int(cu_seqlens[-1]) if length is None else length))
    try:
        yield
    finally:
        _CU_SEQLENS.reset(token)
        for module, name, original in reversed(patched):
            setattr(module, name, original)
