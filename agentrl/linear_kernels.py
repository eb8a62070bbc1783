"""transformers' delta-rule names, sent to the kernels the tensors' device can run.

transformers decides once, when a hybrid model's modeling module is imported, that its `torch_chunk_gated_delta_rule`
and `torch_recurrent_gated_delta_rule` run flash-linear-attention's Triton kernels wherever that package is installed,
whatever device the tensors are on. fla's kernels need CUDA (or Triton's interpreter), so with the `gpu` extra on
a machine without a GPU every hybrid forward failed inside Triton ("0 active drivers"), the engine's first prefill
among them. `route_by_device` puts a dispatcher in front of those names, once per modeling module: CUDA tensors
(or any tensor while `TRITON_INTERPRET=1`) go to what transformers chose, others to its PyTorch reference; a packed
call there (`cu_seqlens`) runs the reference sequence by sequence, each from its own initial state.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys

import torch

NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_ROUTED = "_agentrl_routed_by_device"


def fla_runs_on(tensor: torch.Tensor) -> bool:
    """Whether flash-linear-attention's kernels can run on `tensor`'s device here."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def plain_function(fn):
    """transformers' own PyTorch function behind the wrappers around it: `functools.wraps` chains (`__wrapped__`)
    and, in transformers releases that route these names through hub kernels, a module (`Func`) whose `forward`
    closes over the wrapped function. Its signature names the arguments the function takes; the module's is
    `(*args, **kwargs)`, and calling it can still reach fla's kernel."""
    seen = set()
    while id(fn) not in seen:
        seen.add(id(fn))
        fn = inspect.unwrap(fn)
        forward = getattr(type(fn), "forward", None) if isinstance(fn, torch.nn.Module) else None
        cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ())) if forward is not None else {}
        if "func" not in cells or not callable(cells["func"].cell_contents):
            return fn
        fn = cells["func"].cell_contents
    return fn


def _routed(chosen):
    reference = plain_function(chosen)
    accepted = set(inspect.signature(reference).parameters)

    @functools.wraps(chosen)
    def rule(query, key, value, g, beta, cu_seqlens=None, initial_state=None, output_final_state=False, **kwargs):
        if fla_runs_on(query):
            return chosen(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
                          output_final_state=output_final_state, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        if cu_seqlens is None:
            return reference(query, key, value, g=g, beta=beta, initial_state=initial_state,
                             output_final_state=output_final_state, **kwargs)
        out, finals = by_sequence(reference, query, key, value, g, beta, cu_seqlens.tolist(), initial_state, **kwargs)
        return out, (finals if output_final_state else None)

    setattr(rule, _ROUTED, True)
    return rule


def by_sequence(reference, query, key, value, g, beta, bounds: list[int], initial_state=None, **kwargs):
    """`reference` (one sequence at a time, transformers' PyTorch rule) over each segment of `bounds`, each from
    its row of `initial_state` (zeros without); returns the outputs laid end to end and the final states (fp32,
    `[segments, heads, K, V]`: an empty segment's is where it started)."""
    zero = query.new_zeros(value.shape[2], key.shape[-1], value.shape[-1], dtype=torch.float32)
    outs, finals = [], []
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = initial_state[j:j + 1] if initial_state is not None else None
        if b == a:
            finals.append(init[0] if init is not None else zero)
            continue
        out, final = reference(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                               initial_state=init, output_final_state=True, **kwargs)
        outs.append(out)
        finals.append(final[0])
    return torch.cat(outs, dim=1), torch.stack(finals)


def route_by_device(model) -> None:
    """Route the delta-rule names of the modeling modules of `model`'s linear-attention layers (`model` may be one
    such layer) by device (module docstring); idempotent, and a no-op where fla is not installed (transformers then
    chose the references already)."""
    if importlib.util.find_spec("fla") is None:
        return
    for layer in model.modules():
        module = sys.modules.get(type(layer).__module__)
        if not hasattr(layer, "conv1d") or module is None:
            continue
        for name in NAMES:
            current = getattr(module, name, None)
            if current is not None and not _is_routed(current):
                setattr(module, name, _routed(current))


def _is_routed(fn) -> bool:
    """Whether `fn` is the router or wraps it (`__wrapped__` down the chain: agentrl's own wrappers set it)."""
    while fn is not None:
        if getattr(fn, _ROUTED, False):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False
