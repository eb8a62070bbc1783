"""Projections that read the same input, run by the engine as one GEMM over the training tensors themselves.

A decode step's GEMMs are skinny (a row per sequence), so each one costs its launch and tail besides the weight
bytes it reads: a gated delta net's four input projections (qkv, z, and b and a, a head wide each) and an MLP's
gate and up are six GEMMs where two would read the same bytes. Concatenating the weights would copy them, and the
engine never decodes from a copy. Instead the model's own parameters are re-pointed, once, at consecutive rows of
one buffer per group (`fuse_rows`): each stays the same Parameter object, contiguous, with its own gradient, so the
trainer, its optimizer (whose in-place steps now write into the buffer), checkpoints and `save_pretrained` see
what they saw before, and the engine's view multiplies by the buffer as a whole.

Left alone: tensor-parallel parameters (DTensors, sharded module by module), projections with a bias, and groups
of other dtypes or widths. Should a parameter's data be replaced later (`.to()`, `param.data = ...`),
`FusedProjections.refresh`, run before every step, notices and that module goes back to its own projections (a
parameter replaced by another Parameter object is lost to the engine's view whatever this module does).
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

ATTR = "agentrl_fused"  # on a view module: its group's weight rows as one tensor, or None (its own projections)


def _fusable(linears: list[nn.Linear]) -> bool:
    weights = [lin.weight for lin in linears]
    first = weights[0]
    return all(isinstance(lin, nn.Linear) and lin.bias is None for lin in linears) and all(
        type(w.data) is torch.Tensor and w.dim() == 2 and w.is_contiguous() and w.dtype == first.dtype
        and w.device == first.device and w.shape[1] == first.shape[1] for w in weights)


def spanning_view(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows of `weights`, in order, as one tensor over their storage, if they lie back to back in one; else
    None. No copy and no autograd: what the engine's forward reads."""
    first = weights[0]
    ptr, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for w in weights:
        if w.untyped_storage().data_ptr() != ptr or w.storage_offset() != offset or not w.is_contiguous():
            return None
        offset += w.numel()
    rows, cols = sum(w.shape[0] for w in weights), first.shape[1]
    return first.detach().as_strided((rows, cols), (cols, 1), first.storage_offset())


def fuse_rows(linears: list[nn.Linear]) -> None:
    """Re-point the weights of `linears` at consecutive rows of one new buffer (values unchanged, same Parameter
    objects), unless they lie so already or the group is not fusable (`_fusable`)."""
    weights = [lin.weight for lin in linears]
    if not _fusable(linears) or spanning_view(weights) is not None:
        return
    with torch.no_grad():
        buffer = torch.cat([w.detach() for w in weights])
    row = 0
    for w in weights:
        w.data = buffer[row:row + w.shape[0]]
        row += w.shape[0]


# ---------------------------------------------------------------------------------------------------- forwards


def _mlp_forward(self, x):
    """A gated MLP (`down(act(gate(x)) * up(x))`) with gate and up as one GEMM."""
    fused = getattr(self, ATTR)
    if fused is None:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    gate, up = F.linear(x, fused).split([self.gate_proj.weight.shape[0], self.up_proj.weight.shape[0]], dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def linear_attention_inputs(module, x):
    """A gated delta net's four input projections of `x [T, hidden]`: qkv `[T, conv_dim]`, z, b, a (views of one
    GEMM's output where the module's weights are fused)."""
    fused = getattr(module, ATTR, None)
    parts = (module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a)
    if fused is None:
        return tuple(p(x) for p in parts)
    return F.linear(x, fused).split([p.out_features for p in parts], dim=-1)


def _is_gated_mlp(module) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj")) \
        and callable(getattr(module, "act_fn", None))


def _same_as_own_forward(module) -> bool:
    """Whether `_mlp_forward` computes `module`'s own forward, checked once per MLP class on a small stand-in (its three
    weights swapped for random 16 x 8 ones on the CPU, in fp32, so the check costs nothing whatever the model's size
    and does not depend on its values): the patch assumes the gated form, which other arithmetic would silently
    break."""
    import copy

    gen = torch.Generator(device="cpu").manual_seed(0)
    small = {"gate_proj": (16, 8), "up_proj": (16, 8), "down_proj": (8, 16)}
    memo = {id(getattr(module, name).weight): nn.Parameter(torch.randn(shape, generator=gen))
            for name, shape in small.items()}
    try:
        probe = copy.deepcopy(module, memo)
        setattr(probe, ATTR, torch.cat([probe.gate_proj.weight, probe.up_proj.weight]).detach())
        x = torch.randn(3, 8, generator=gen)
        with torch.no_grad():
            want, got = type(module).forward(probe, x), _mlp_forward(probe, x)
    except Exception:  # a forward that reads more than the gated form does
        return False
    return want.shape == got.shape and bool(torch.allclose(want, got, rtol=1e-5, atol=1e-6))


class FusedProjections:
    """The fused groups of a view: every gated MLP's gate and up, and `linear_modules`' four input projections
    (their forward, `linear_state._packed_forward`, reads them through `linear_attention_inputs`)."""

    def __init__(self, view: nn.Module, linear_modules=()):
        self.groups: list[tuple[nn.Module, list[nn.Linear]]] = []
        checked: dict[type, bool] = {}
        for module in view.modules():
            if not _is_gated_mlp(module):
                continue
            kind = type(module)
            if kind not in checked:
                checked[kind] = _same_as_own_forward(module)
                if not checked[kind]:
                    warnings.warn(f"{kind.__name__} is not the gated MLP the engine fuses; its projections run "
                                  "one by one", stacklevel=3)
            if checked[kind]:
                module.forward = types.MethodType(_mlp_forward, module)
                self.groups.append((module, [module.gate_proj, module.up_proj]))
        for module in linear_modules:
            self.groups.append((module, [module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a]))
        # The view's own modules: nobody else re-assigns their Parameter objects, only (perhaps) their data
        self._weights = [lin.weight for _, linears in self.groups for lin in linears]
        for _, linears in self.groups:
            fuse_rows(linears)
        # Each group's rows read after every group has moved: a parameter two groups share would have left the
        # first group's buffer when the second moved it.
        self._bind()

    @property
    def fused(self) -> int:
        """How many groups run as one GEMM."""
        return sum(getattr(module, ATTR) is not None for module, _ in self.groups)

    def _addresses(self) -> tuple:
        return tuple(map(torch.Tensor.data_ptr, self._weights))

    def refresh(self) -> None:
        """Re-derive each group's rows if a parameter moved since the last look (None where they no longer lie back
        to back): the engine never reads a buffer the parameters have left."""
        if self._addresses() != self._binding:
            self._bind()

    def _bind(self) -> None:
        for module, linears in self.groups:
            setattr(module, ATTR, spanning_view([lin.weight for lin in linears]) if _fusable(linears) else None)
        self._binding = self._addresses()
