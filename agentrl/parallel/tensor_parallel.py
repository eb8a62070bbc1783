"""Tensor parallelism over a replica's ranks: DTensor shards for the decoder's projections, Replicate elsewhere.

What is split comes from the model's own `base_model_tp_plan` (transformers'): attention q/k/v and MLP gate/up
colwise, o_proj and down_proj rowwise (one all-reduce after each), and for Qwen3.5's linear-attention layers their
projections colwise with the output gathered, so the gated delta rule itself runs on whole tensors (its fused
q|k|v projection is not laid out per head, so it cannot be split by head without re-packing the weight).

Everything the plan leaves out (embeddings, norms, the lm_head, the delta net's convolution and gates) becomes a
DTensor with a Replicate placement, so gradient clipping and fused optimizers see one kind of parameter, and the
vocabulary projection stays whole, which is what lets the chunked lm_head multiply by its local tensor. Those
parameters' modules compute on the local view: a hook swaps every replicated parameter of a module's whole
subtree for its `to_local()` around the module's forward (a parent such as the gated delta net reads its child's
`conv1d.weight` itself, so unwrapping the child alone would not do), and gradient checkpointing's replays run
the same hooks. The local view of a replicated parameter used on a rank's own heads only (Qwen3's per-head
q_norm / k_norm, "replicated_with_grad_allreduce" in the plan) sums its gradient over the tp group.

The engine decodes from the split model in place (`agentrl.engine.tensor_parallel`): a tp rank's attention holds
`num_heads // tp` query and `num_kv_heads // tp` KV heads (`local_head_counts`), its paged KV pool is sized for
those, o_proj and down_proj all-reduce inside their modules (the hooks installed here), the lm_head is whole on
every rank, and linear-attention state stays whole.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from agentrl.parallel.mesh import Mesh

# transformers' style names → torch's parallel styles (fresh objects per module: styles carry state)
_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
}
_PARTIAL_GRAD = "replicated_with_grad_allreduce"  # replicated, but each rank's gradient covers its heads only
# Styles left out of the split: the module stays whole (Replicate) like everything the plan does not name.
# transformers 5.17 adds `embed_tokens: embedding_rowwise` to a model's plan; the embedding stays whole here, as the
# lm_head does (the chunked lm_head and the engine read the whole vocabulary on every rank).
_KEPT_WHOLE = {"embedding_rowwise"}
_LOCAL_VIEW = "_agentrl_local_view"  # on a replicated Parameter: None, or the group its gradient is summed over


def _decoder_prefix(model: nn.Module) -> tuple[str, nn.Module]:
    """Name and module of the decoder the base-model plan is written against (`model` in a CausalLM)."""
    base = getattr(model, "base_model_prefix", None)
    if base and isinstance(getattr(model, base, None), nn.Module):
        return base + ".", getattr(model, base)
    return "", model


def tensor_parallel_plan(model: nn.Module) -> dict[str, str]:
    """`{module name: style}` for every module the plan names, wildcards expanded; unknown styles raise."""
    prefix, decoder = _decoder_prefix(model)
    plan = getattr(decoder.config, "base_model_tp_plan", None) or {}
    if not plan:
        raise NotImplementedError(f"{type(model).__name__} has no base_model_tp_plan to split it by")
    names = [name for name, _ in decoder.named_modules() if name]
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if style in _KEPT_WHOLE:
            continue
        if style not in _STYLES and style != _PARTIAL_GRAD:
            raise NotImplementedError(f"tp plan style {style!r} (for {pattern}) is not supported")
        for name in names:
            if fnmatch.fnmatchcase(name, pattern) and name.count(".") == pattern.count("."):
                out[prefix + name] = style
    return out


def _heads(config) -> tuple[int, int]:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    return heads, getattr(cfg, "num_key_value_heads", None) or heads


def local_head_counts(config, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) one tp rank's attention holds: what the engine's view and KV pool are sized by."""
    heads, kv = _heads(config)
    return heads // tp_size, kv // tp_size


def check_divisible(config, tp_size: int) -> None:
    heads, kv = _heads(config)
    if heads % tp_size or kv % tp_size:
        raise ValueError(f"parallel.tp_size={tp_size} must divide the attention heads ({heads}) and the KV heads "
                         f"({kv}): each rank holds whole heads")


def apply_tensor_parallel(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Split `model` in place over `mesh`'s tp ranks (a no-op at tp_size 1) and return it.

    Every rank of the replica calls this with the model on its `mesh.device`; shards and replicated values are
    taken from tp rank 0, so whatever the other ranks loaded is overwritten with it.
    """
    if mesh.tp_size == 1:
        return model
    check_divisible(model.config, mesh.tp_size)
    elsewhere = next((n for n, p in model.named_parameters() if p.device.type != mesh.device.type), None)
    if elsewhere is not None:
        raise ValueError(f"move the model to {mesh.device} before splitting it ({elsewhere} is on "
                         f"{model.get_parameter(elsewhere).device})")
    tp_mesh = mesh.tp_mesh
    plan = tensor_parallel_plan(model)
    parallelize_module(model, tp_mesh, {name: _STYLES[style]() for name, style in plan.items() if style in _STYLES})
    partial = {name for name, style in plan.items() if style == _PARTIAL_GRAD}
    replicated: dict[int, nn.Parameter] = {}  # id(plain parameter) → its DTensor, so tied weights stay tied
    for name, module in model.named_modules():
        for key, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            if id(param) not in replicated:
                new = nn.Parameter(distribute_tensor(param.data, tp_mesh, [Replicate()]),
                                   requires_grad=param.requires_grad)
                setattr(new, _LOCAL_VIEW, mesh.tp_group if name in partial else None)
                replicated[id(param)] = new
            module._parameters[key] = replicated[id(param)]
    for module in model.modules():
        if any(_is_local_view(p) for p in module.parameters()):
            module.register_forward_pre_hook(_enter_local_view)
            module.register_forward_hook(_leave_local_view, always_call=True)
    return model


def _is_local_view(param) -> bool:
    return isinstance(param, DTensor) and hasattr(param, _LOCAL_VIEW)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the incoming gradient over `group` (once per use, so gradient
    accumulation over micro-batches adds whole gradients, never re-reduces an accumulated one)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _local(param: DTensor) -> torch.Tensor:
    local = param.to_local()
    group = getattr(param, _LOCAL_VIEW)
    return _SumGradOverGroup.apply(local, group) if group is not None else local


# Hooks take the module as an argument rather than closing over it: the engine's view deep-copies modules with
# their hooks, and each copy must swap its own parameters.
def _enter_local_view(module: nn.Module, args):
    swapped = []
    for sub in module.modules():
        for key, param in sub._parameters.items():
            if _is_local_view(param):
                sub._parameters[key] = _local(param)
                swapped.append((sub, key, param))
    module.__dict__.setdefault("_agentrl_swapped", []).append(swapped)


def _leave_local_view(module: nn.Module, args, output):
    stack = module.__dict__.get("_agentrl_swapped")
    if stack:
        for sub, key, param in stack.pop():
            sub._parameters[key] = param
    return output


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole CPU tensors for every entry of the state dict: what a single process saves and loads.

    A collective over the tp group (every rank of the replica must call it). Sharded parameters are gathered;
    replicated ones are read locally.
    """
    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().cpu()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors (as `full_state_dict` returns) into a split model: each rank keeps its own slice, no
    communication. Tied entries are written once per key, with the same values."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise KeyError(f"the state dict lacks {len(missing)} entries, first {missing[0]!r}")
    for key, target in own.items():
        full = state[key]
        if isinstance(target, DTensor):
            piece = distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements,
                                      src_data_rank=None)
            target.to_local().copy_(piece.to_local())
        else:
            target.copy_(full)
