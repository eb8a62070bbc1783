"""Sample boundaries for the short causal convolution of linear-attention layers in a packed row.

A hybrid model's gated-delta-net layer runs a depthwise causal convolution (a window of `kernel` positions) before
its delta rule. In a packed row, the first `kernel - 1` positions of a sample would read the end of the sample
before it. flash-linear-attention's delta rule takes the boundaries (`cu_seqlens`), but transformers calls its
convolution through `causal_conv1d_fn`, whose PyTorch fallback (used whenever the `causal-conv1d` package is absent)
ignores them, and the package's own kernel takes `seq_idx`, not `cu_seqlens`. So the model's modeling module gets
a wrapper of that function (installed once; outside a packed forward it calls what it wraps), and while a packed
forward runs (`packed_conv_boundaries`) the wrapper keeps each output within its own sample (reading zeros before
it, as a sample run alone does): on CUDA with flash-linear-attention, that package's varlen convolution, which takes
`cu_seqlens`; elsewhere, the original convolution over the samples spread apart by `kernel - 1` zeros, the real
positions gathered back.

The chunked delta rule gets a wrapper too, for two cases. Where flash-linear-attention's rule cannot train (its
backward refuses some Triton and GPU combinations, and agentrl's stand-in for the kernel it refuses,
`delta_rule_backward`, did not cover it; the run finds out before its first step),
`use_reference_delta_rule` marks the model, and packed forwards run transformers' PyTorch reference sample by sample
over `cu_seqlens`: the rest of the layer stays packed, each sample's recurrence starting from zero state as alone.
And in a prefix-shared row (`tree`, from `prefix_forward`) the prefixes run first and every suffix starts from its
prefix's final state, its convolution window reaching back into the prefix's last inputs: what it sees unshared.

Both wrappers are graph breaks for compiled layers (`torch.compiler.disable`), and being the same objects across
forwards, they let compiled hybrid layers keep their graphs.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import sys
import warnings
from dataclasses import dataclass

import torch

from agentrl.autotune_lock import serialize_autotuners
from agentrl.linear_kernels import by_sequence, plain_function, route_by_device


@dataclass
class _Tree:
    """A prefix-shared row (`prefix_forward`): which sequences continue another (a suffix its group's prefix), laid
    out for the two layers that carry state along the sequence, built once per forward on the host."""

    index: torch.Tensor  # conv: each token's place in the spread row (sequences apart, a history slot before each)
    history_dst: torch.Tensor  # conv: the history slots a suffix takes from its prefix's last tokens ...
    history_src: torch.Tensor  # ... and those tokens
    spread: int  # conv: the spread row's length
    roots: torch.Tensor  # rule: tokens of sequences without a parent (prefixes, unshared samples, padding)
    cu_roots: torch.Tensor
    children: torch.Tensor  # rule: tokens of suffixes, which start from their prefix's final state
    cu_children: torch.Tensor
    parent: torch.Tensor  # rule: for each suffix, its prefix's place among the roots
    bounds: tuple[list[int], list[int]]  # host boundaries of roots and children (the reference rule's loop)


@dataclass
class _Active:
    cu: torch.Tensor
    length: int  # read on the host once per forward: a read per layer (int(cu[-1])) waits for the device each time
    tree: _Tree | None = None
    reference: bool = False  # the delta rule through transformers' PyTorch reference (`use_reference_delta_rule`)
    chunks: torch.Tensor | None = None  # fla's chunk indices of the row, built on the host (`chunk_indices`)


_CU_SEQLENS: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("agentrl_conv_cu_seqlens", default=None)
_REFERENCE_RULE = "_agentrl_reference_delta_rule"  # set on a model's linear-attention layers
_RULE = "torch_chunk_gated_delta_rule"  # the name transformers' gated delta nets call their chunked rule by
CHUNK_SIZE = 64  # the chunks of flash-linear-attention's gated delta rule and varlen convolution


def chunk_indices(lengths: list[int], capacity: int | None = None, size: int = CHUNK_SIZE) -> list[tuple[int, int]]:
    """flash-linear-attention's `chunk_indices` for sequences of `lengths` laid end to end: (sequence, chunk within
    it) for every `size`-token chunk, in order. Passed to its kernels, they need not build them from `cu_seqlens` on
    the device, which reads a count back to the host (a wait on the device per forward and backward).

    `capacity`: that many entries (a fixed grid for CUDA graphs), the rest pointing one chunk past the end of the
    last non-empty sequence: a block every kernel masks out entirely (nothing read or written outside a sequence),
    while its last-token reads stay inside the sequence."""
    out = [(n, t) for n, length in enumerate(lengths) for t in range(-(-length // size))]
    if capacity is not None:
        if capacity < len(out):
            raise ValueError(f"{len(out)} chunks exceed the capacity of {capacity}")
        last = max((n for n, length in enumerate(lengths) if length), default=None)
        if last is None and capacity > len(out):
            raise ValueError("padding chunks need a non-empty sequence to point past")
        if last is not None:
            out += [(last, -(-lengths[last] // size))] * (capacity - len(out))
    return out


def spread_index(cu_seqlens: torch.Tensor, length: int, gap: int) -> torch.Tensor:
    """Where each of the row's `length` positions goes once every segment is preceded by `gap` zeros."""
    bounds = cu_seqlens.to(torch.long)
    segment = torch.bucketize(torch.arange(length, device=bounds.device), bounds[1:], right=True)
    return torch.arange(length, device=bounds.device) + (segment + 1) * gap


_VARLEN_CONV_FAILED: list[str] = []  # why flash-linear-attention's convolution failed here, once it has


def varlen_conv():
    """flash-linear-attention's causal convolution over `cu_seqlens` (Triton, forward and backward), or None where
    the package is absent or its convolution failed once in this process."""
    if _VARLEN_CONV_FAILED or importlib.util.find_spec("fla") is None:
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
        if active is None or batch != 1 or active.length != length:
            return conv(hidden_states, weight, bias, activation, **kwargs)
        cu, tree = active.cu, active.tree
        if tree is not None:  # a suffix's window reaches back into its prefix's last tokens, as unshared
            spread = hidden_states.new_zeros(1, channels, tree.spread)
            spread[..., tree.index] = hidden_states
            spread[..., tree.history_dst] = hidden_states[..., tree.history_src]
            return conv(spread, weight, bias, activation, **kwargs)[..., tree.index]
        fla_conv = varlen_conv() if hidden_states.is_cuda else None
        if fla_conv is not None:
            # The samples' own kernel: no spreading, and a Triton backward rather than cuDNN's depthwise one.
            # `hidden_states` is [1, D, T] as the layer lays it out: a transposed view of [1, T, D].
            try:
                chunks = {} if active.chunks is None else {"chunk_indices": active.chunks}
                out, _ = fla_conv(hidden_states.transpose(1, 2), weight, bias, activation=activation,
                                  cu_seqlens=cu.to(torch.int32), **chunks)
                return out.transpose(1, 2)
            except Exception as exc:  # another package version's signature, a kernel that fails here: spread
                _VARLEN_CONV_FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                warnings.warn(f"flash-linear-attention's varlen convolution failed ({_VARLEN_CONV_FAILED[0]}); "
                              "packed rows spread their samples apart for transformers' convolution instead",
                              stacklevel=2)
        gap = weight.shape[-1] - 1
        index = spread_index(cu, length, gap)
        spread = hidden_states.new_zeros(1, channels, length + (cu.numel() - 1) * gap)
        spread[..., index] = hidden_states
        return conv(spread, weight, bias, activation, **kwargs)[..., index]

    conv_within_samples.__wrapped__ = conv  # `inspect.unwrap` reaches what it wraps, transformers' own at the end
    # Compiled layers break around it (it reads the forward's boundaries from a context).
    return torch.compiler.disable(conv_within_samples)


def _segmented_rule(rule):
    """The chunked delta rule of a packed row: sample by sample through the PyTorch reference (where the varlen
    kernels cannot train), or through `rule` itself (flash-linear-attention's, which takes boundaries and
    per-sequence states). In a prefix-shared row each suffix starts from its prefix's final state: the prefixes run
    first, then the suffixes. Outside a packed forward that needs either, `rule` as it is."""
    reference = plain_function(rule)

    def run(query, key, value, g, beta, cu, bounds, initial_state, kwargs, reference_rule):
        if reference_rule:
            return by_sequence(reference, query, key, value, g, beta, bounds, initial_state, **kwargs)
        return rule(query, key, value, g=g, beta=beta, cu_seqlens=cu, initial_state=initial_state,
                    output_final_state=True, **kwargs)

    def rule_within_samples(query, key, value, g, beta, cu_seqlens=None, initial_state=None,
                            output_final_state=False, **kwargs):
        active = _CU_SEQLENS.get()
        needed = active is not None and (active.reference or active.tree is not None)
        cu = cu_seqlens if cu_seqlens is not None else (active.cu if active is not None else None)
        if not needed or cu is None or query.shape[0] != 1 or initial_state is not None or output_final_state:
            if active is not None and active.chunks is not None and cu_seqlens is not None:
                kwargs = {**kwargs, "chunk_indices": active.chunks}  # fla's kernel, the row's own boundaries
            return rule(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
                        output_final_state=output_final_state, **kwargs)
        if active.reference:
            kwargs = {k: v for k, v in kwargs.items() if k in ("chunk_size", "use_qk_l2norm_in_kernel")}
        tree = active.tree
        if tree is None:
            return run(query, key, value, g, beta, cu, cu.tolist(), None, kwargs, True)[0], None
        pick = [lambda t, idx=idx: t.index_select(1, idx) for idx in (tree.roots, tree.children)]
        parts = [[p(t) for t in (query, key, value, g, beta)] for p in pick]
        out_roots, finals = run(*parts[0], tree.cu_roots, tree.bounds[0], None, kwargs, active.reference)
        out = query.new_zeros(*value.shape[:2], *out_roots.shape[2:]).index_copy(1, tree.roots, out_roots)
        if tree.children.numel():
            out_children, _ = run(*parts[1], tree.cu_children, tree.bounds[1], finals.index_select(0, tree.parent),
                                  kwargs, active.reference)
            out = out.index_copy(1, tree.children, out_children)
        return out, None

    rule_within_samples.__wrapped__ = rule
    return torch.compiler.disable(rule_within_samples)  # compiled layers break around it, as around the conv


def use_reference_delta_rule(model) -> None:
    """From now on, packed forwards of `model` (inside `packed_conv_boundaries`) run the chunked delta rule
    through the PyTorch reference, sample by sample."""
    for layer in model.modules():
        if hasattr(layer, "conv1d") and hasattr(sys.modules.get(type(layer).__module__), _RULE):
            setattr(layer, _REFERENCE_RULE, True)


def uses_reference_delta_rule(model) -> bool:
    """Whether `use_reference_delta_rule` marked `model` (its packed rows' rule then reads boundaries on the host)."""
    return any(getattr(layer, _REFERENCE_RULE, False) for layer in model.modules())


def _modeling_modules(model) -> list:
    """The modules defining `causal_conv1d_fn` that the model's linear-attention layers call."""
    found = []
    for layer in model.modules():
        module = sys.modules.get(type(layer).__module__)
        if hasattr(layer, "conv1d") and hasattr(module, "causal_conv1d_fn") and module not in found:
            found.append(module)
    return found


def tree_supported(model) -> bool:
    """Whether `model`'s linear-attention layers are ones `packed_conv_boundaries(tree=...)` can share a prefix in
    (their modeling module exposes the convolution and the chunked rule it patches)."""
    modules = _modeling_modules(model)
    return bool(modules) and all(hasattr(m, _RULE) for m in modules)


def _tree(lengths: list[int], parents: list[int], gap: int, device) -> _Tree:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    index, dst, src, roots, children, parent = [], [], [], [], [], []
    root_of = {}
    cu_roots, cu_children, at = [0], [0], 0
    for j, (n, p) in enumerate(zip(lengths, parents)):
        at += gap  # the history slots before sequence j
        if p >= 0:  # filled from the parent's last tokens, right-aligned; zeros where the parent is shorter
            take = min(gap, lengths[p])
            dst += range(at - take, at)
            src += range(starts[p] + lengths[p] - take, starts[p] + lengths[p])
            children += range(starts[j], starts[j] + n)
            cu_children.append(cu_children[-1] + n)
            parent.append(root_of[p])
        else:
            root_of[j] = len(cu_roots) - 1
            roots += range(starts[j], starts[j] + n)
            cu_roots.append(cu_roots[-1] + n)
        index += range(at, at + n)
        at += n
    # One copy to the device, from pinned memory on CUDA (a pageable copy waits for everything queued before it).
    parts = (index, dst, src, roots, cu_roots, children, cu_children, parent)
    host = torch.tensor([x for part in parts for x in part], dtype=torch.long)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=True).split([len(part) for part in parts])
    index, dst, src, roots, cu_roots_d, children, cu_children_d, parent_d = moved
    return _Tree(index, dst, src, at, roots, cu_roots_d.int(), children, cu_children_d.int(), parent_d,
                 (cu_roots, cu_children))


@contextlib.contextmanager
def packed_conv_boundaries(model, cu_seqlens: torch.Tensor, length: int | None = None,
                           tree: tuple[list[int], list[int]] | None = None, chunks: torch.Tensor | None = None):
    """While active, the linear-attention convolutions of `model` stay within the samples `cu_seqlens` bounds
    (the cumulative boundaries of one flat row, `[0, n1, n1 + n2, ..., length]`). `length`: the row's length where
    the caller knows it on the host (else it is read from `cu_seqlens`, one wait for the device). `tree`: a
    prefix-shared row's sequence lengths and each one's parent (-1 for none): a suffix then continues its prefix's
    convolution window and recurrent state, as it would unshared. `chunks`: the row's `chunk_indices` for
    flash-linear-attention's kernels (`[chunks, 2]` int32 on the device, from `chunk_indices`).

    The modeling module's convolution and chunked rule are wrapped once, for good: outside a packed forward (another
    thread, the engine, a plain forward) the wrappers call what they wrap, and the same function objects across
    forwards are what lets compiled layers keep their graphs."""
    install_wrappers(model)
    reference = uses_reference_delta_rule(model)
    gap = max((layer.conv1d.weight.shape[-1] - 1 for layer in model.modules() if hasattr(layer, "conv1d")), default=0)
    shared = _tree(*tree, gap, cu_seqlens.device) if tree is not None else None
    token = _CU_SEQLENS.set(_Active(cu_seqlens, int(cu_seqlens[-1]) if length is None else length, shared,
                                    reference, chunks if shared is None and not reference else None))
    try:
        yield
    finally:
        _CU_SEQLENS.reset(token)


_INSTALLED: dict[tuple[str, str], object] = {}  # (modeling module, name) -> the wrapper installed there


def install_wrappers(model) -> None:
    """Wrap the convolution and chunked delta rule of `model`'s modeling modules, once: a function found there is
    wrapped unless it is the wrapper installed before (by identity: a function that wraps ours with
    `functools.wraps` copies its attributes, so a mark would say "ours" of it)."""
    if importlib.util.find_spec("fla") is not None:
        serialize_autotuners()  # fla's autotuned kernels behind them are called from the engine's thread too
    route_by_device(model)  # beneath ours: fla's kernels only where the tensors' device can run them
    for module in _modeling_modules(model):
        for name, wrap in (("causal_conv1d_fn", _boundary_conv), (_RULE, _segmented_rule)):
            current = getattr(module, name, None)
            if current is not None and current is not _INSTALLED.get((module.__name__, name)):
                _INSTALLED[(module.__name__, name)] = wrapper = wrap(current)
                setattr(module, name, wrapper)
