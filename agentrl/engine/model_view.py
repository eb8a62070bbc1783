"""A second view of the training model for the engine: new module objects, the very same parameters.

The attention implementation is a setting on the config, read by every attention module at every forward
from every thread, so it cannot be switched to paged attention around the engine's forwards while the
trainer runs its own forward on another thread. The view has its own copy of each config (the deepcopy
memo maps each submodule's config to one copy, so composite models keep their text config distinct) with
our attention implementation, and every parameter and buffer is the original tensor: an in-place optimizer
step is what the next decode step reads, and nothing is ever copied.

A tensor-parallel model's view shares its DTensor parameters the same way, and the hooks that make its modules
compute on local tensors (torch's parallel styles, `agentrl.parallel`'s local views) are copied with the modules:
they take the module they run on as an argument, so each copy handles its own.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from agentrl.models import decoder_layers


@dataclass(frozen=True)
class Geometry:
    """What the KV pool must hold per token: the full-attention layers and their KV heads. Head counts are this
    rank's own under tensor parallelism (`tp_size` ranks, each attending over its slice of the heads)."""

    num_layers: int
    attention_layers: tuple[int, ...]  # layer_idx of each layer with a KV cache, in order
    linear_layers: tuple[int, ...]  # layer_idx of each linear-attention layer (recurrent state, no KV)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    vocab_size: int
    tp_size: int = 1


def geometry(model: nn.Module, tp_size: int = 1) -> Geometry:
    """`model`'s geometry as one of `tp_size` tensor-parallel ranks sees it (the vocabulary is whole everywhere:
    the lm_head is replicated)."""
    cfg = model.config.get_text_config()
    n = cfg.num_hidden_layers
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)[:n]
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise NotImplementedError(
            f"the engine serves full attention (paged KV) and Qwen3.5-style linear attention; this model has "
            f"layer types {unknown} (e.g. sliding windows), which need a backend that honours them"
        )
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    local_heads, local_kv_heads = heads, getattr(cfg, "num_key_value_heads", None) or heads
    if tp_size > 1:
        from agentrl.parallel.tensor_parallel import local_head_counts

        local_heads, local_kv_heads = local_head_counts(cfg, tp_size)
    return Geometry(
        num_layers=n,
        attention_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        num_heads=local_heads,
        num_kv_heads=local_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None),
        vocab_size=cfg.vocab_size,
        tp_size=tp_size,
    )


def make_view(model: nn.Module, attn_implementation: str) -> nn.Module:
    """The view: module structure deep-copied, every parameter and buffer shared, configs copied and set
    to `attn_implementation`, in eval mode whatever mode the training model is in."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    view = copy.deepcopy(model, memo=dict(shared))
    configs = {}
    for module in view.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            configs[id(cfg)] = cfg
            for name in getattr(cfg, "sub_configs", {}) or {}:
                sub = getattr(cfg, name, None)
                if sub is not None and hasattr(sub, "_attn_implementation"):
                    configs[id(sub)] = sub
    for cfg in configs.values():
        cfg._attn_implementation = attn_implementation
    for module in view.modules():
        # `Module.compile()` on the training model leaves a compiled call bound to the *training* module; copied
        # over, the view would run the trainer's forward (its attention) instead of its own.
        module.__dict__.pop("_compiled_call_impl", None)
    view.eval()
    assert_shares_parameters(model, view)
    return view


def assert_shares_parameters(model: nn.Module, view: nn.Module) -> None:
    ours = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    theirs = dict(itertools.chain(view.named_parameters(), view.named_buffers()))
    if ours.keys() != theirs.keys():
        raise RuntimeError("the model view's parameters and buffers do not match the model's")
    for name, tensor in ours.items():
        if theirs[name] is not tensor:
            raise RuntimeError(f"the model view holds a copy of {name}; it must share the training tensor")


def model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    raise ValueError("the model has no floating-point parameters")


def compile_decoder_layers(model: nn.Module, activation_memory_budget: float | None = None, **options) -> int:
    """`torch.compile` every decoder layer of `model` on its own (`options` go to `Module.compile`); returns the
    number compiled. The engine compiles its view's layers (the norms, rotary embedding, SwiGLU and residual adds
    fuse into a few kernels instead of dozens of small launches a layer, a large share of a decode step; paged
    attention is `torch.compiler.disable`d, so each layer compiles as the graphs around it), the trainer its
    model's. Shapes go dynamic at the second length seen.

    The layers of every copy of a model class share their code objects and dynamo's one cache per frame: the
    trainer's entries plus the engine's exceeded the default limit of 8 on transformers' shared wrapper frames,
    and a frame past the limit runs eagerly from then on, with all it calls; hence 64.

    `activation_memory_budget` (training only; a process-wide functorch setting read when the backward is
    partitioned): below 1 the compiled layers recompute their cheapest activations in the backward instead of
    saving them."""
    from torch._functorch import config as functorch_config

    if activation_memory_budget is not None:
        functorch_config.activation_memory_budget = activation_memory_budget
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(**options)
    return len(layers)


