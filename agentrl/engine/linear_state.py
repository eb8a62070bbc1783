"""Per-sequence state slots for linear-attention layers (Qwen3.5's gated delta net), beside the paged KV.

A linear-attention layer keeps no KV: each sequence carries a convolution window (the last `kernel - 1` inputs
of the short causal conv) and a recurrent matrix per value head. They live in two tensors stacked over the
layers, `conv [layers, slots + 1, channels, kernel - 1]` and `recurrent [layers, slots + 1, heads, dk, dv]`,
indexed by a per-sequence slot, so a packed step runs the projections over all its tokens at once. The extra
slot is scratch: the padding rows of a captured decode step read and write it.

Per step (`plan`), each sequence's part of the packed row is either
- one token continuing from its slot (a decode): all of these run together, the conv window and the
  single-token delta rule over the batch of their slots, state gathered by slot index and scattered back.
  That path is tensor ops on device indices only, so a CUDA graph captures it (`static_plan`): the slots
  are a persistent buffer written before each replay;
- a chunk (a prompt, or a continuation after a cached prefix): the conv and the chunked delta rule for that
  sequence alone, from zero state if it starts at position 0.

Varlen kernels (CUDA with flash-linear-attention): all the chunks of a step run as one varlen call instead
(`linear_varlen.py`). Without CUDA or fla, the per-sequence path above runs: the CPU path, and the reference the
varlen one is tested against.
Decode rows on CUDA (`fused_decode`) run `triton_delta_rule`, reading and writing each row's window and state in
place by slot; elsewhere the rule (fla's or transformers') runs between a gather and a scatter. Both are capturable.

Prefix-cache resume points (`state_snapshots.py`): the state at the deepest page boundary a step reaches
for a sequence is copied into a snapshot attached to the page that ends there. A chunk that crosses that
boundary runs the delta rule in two pieces split at it, so the snapshot is the state *at* the boundary; a
step whose part ends on the boundary is copied out after the forward. A sequence admitted on cached pages
starts from the snapshot of its deepest one, copied into its slot before the forward. The split points
depend only on positions, so the same prompt is computed the same way whether or not the cache is on.

The view's linear-attention modules get this forward instead of transformers' own, which reads its state
from a Cache object over a padded batch; on the per-sequence path the math functions (conv, chunked / recurrent
delta rule, gated norm) are still the model's own, so a fused kernel registered for them is what runs
(transformers resolves its `torch_*_gated_delta_rule` names to fla's kernels where fla is installed; on a device fla
cannot run on, `agentrl.linear_kernels` sends them to its PyTorch reference).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from agentrl.engine.fused_projections import linear_attention_inputs
from agentrl.engine.linear_varlen import VarlenLayout, _qkv, _varlen_chunks, varlen_kernels, varlen_layout
from agentrl.linear_kernels import route_by_device

_REQUIRED = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj",
             "key_dim", "value_dim", "head_k_dim", "head_v_dim", "conv_kernel_size", "activation")


def fused_decode(device: torch.device, modules: list, kernels) -> Callable | None:
    """`triton_delta_rule.decode_rows` where Triton compiles (CUDA), the conv's activation is its SiLU and, checked
    once here on the first layer, it matches the gathered path (`check_decode_rows`; else one warning); else None."""
    if device.type != "cuda" or {m.activation for m in modules} - {"silu", "swish"} \
            or importlib.util.find_spec("triton") is None:
        return None
    from agentrl.engine.triton_delta_rule import check_decode_rows, decode_rows

    first = modules[0]
    impl = sys.modules[type(first).__module__]
    rule = kernels.recurrent if kernels is not None else impl.torch_recurrent_gated_delta_rule
    failure = check_decode_rows(first, lambda module, *args: _decode_rows(module, rule, *args))
    if failure is not None:
        warnings.warn(f"the fused hybrid decode kernel {failure}; decoding through the gathered rule instead",
                      stacklevel=3)
        return None
    return decode_rows


class LinearStates:
    KWARG = "agentrl_linear"

    def __init__(self, view: torch.nn.Module, geometry, num_slots: int):
        wanted = set(geometry.linear_layers)
        self.modules: dict[int, torch.nn.Module] = {}
        for module in view.modules():
            idx = getattr(module, "layer_idx", None)
            if idx in wanted and hasattr(module, "in_proj_b"):
                missing = [a for a in _REQUIRED if not hasattr(module, a)]
                if missing:
                    raise NotImplementedError(
                        f"linear-attention layer {type(module).__name__} lacks {missing}: the engine serves "
                        "Qwen3.5-style gated delta nets only")
                self.modules[idx] = module
        if set(self.modules) != wanted:
            raise NotImplementedError(
                f"no supported linear-attention module found for layers {sorted(wanted - set(self.modules))}")
        shapes = set()
        for m in self.modules.values():
            route_by_device(m)
            shapes.add(((m.key_dim * 2 + m.value_dim, m.conv_kernel_size - 1),
                        (m.value_dim // m.head_v_dim, m.head_k_dim, m.head_v_dim)))
            m.forward = types.MethodType(_packed_forward, m)
        if len(shapes) != 1:
            raise NotImplementedError(f"linear-attention layers of several shapes {sorted(shapes)}")
        (self.conv_shape, self.recurrent_shape), = shapes
        self.layers = tuple(sorted(self.modules))
        self.position = {idx: i for i, idx in enumerate(self.layers)}  # layer_idx -> its row in the state tensors
        p = next(iter(self.modules.values())).in_proj_qkv.weight
        self.device, self.dtype = p.device, p.dtype
        # None: the per-sequence path. Settable, so a test or benchmark can run one engine on each path.
        self.kernels = varlen_kernels(self.device)
        # Decode rows as one fused step, states updated in place (`_decode_rows` less its rule); None: `_decode_rows`.
        self.fused_decode = fused_decode(self.device, list(self.modules.values()), self.kernels)
        self.num_slots = num_slots
        self.scratch = num_slots
        self.snapshots = None  # the prefix cache's `StateSnapshots`, attached by the engine when it has one
        self.conv, self.recurrent = self.allocate(num_slots + 1)
        self._slot_of: dict[int, int] = {}  # request id -> slot
        self._free = list(range(num_slots - 1, -1, -1))
        self._saved = None

    def allocate(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed conv and recurrent tensors of `n` states. The recurrent state is fp32: the delta rule
        accumulates in it over the whole sequence."""
        layers = len(self.layers)
        conv = torch.zeros((layers, n, *self.conv_shape), dtype=self.dtype, device=self.device)
        recurrent = torch.zeros((layers, n, *self.recurrent_shape), dtype=torch.float32, device=self.device)
        return conv, recurrent

    @property
    def bytes_per_state(self) -> int:
        """One sequence's state over every linear-attention layer (what a snapshot weighs)."""
        conv = int(np.prod(self.conv_shape)) * torch.empty((), dtype=self.dtype).element_size()
        return len(self.layers) * (conv + int(np.prod(self.recurrent_shape)) * 4)

    def data_ptrs(self) -> tuple:
        """Where the states live, and the snapshots that captured decode steps write (`snapshots_in_kernel`)."""
        snaps = self.snapshots
        held = snaps is not None and snaps.conv is not None
        return (self.conv.data_ptr(), self.recurrent.data_ptr(),
                *((snaps.conv.data_ptr(), snaps.recurrent.data_ptr()) if held else ()))

    def snapshots_in_kernel(self, snapshots) -> bool:
        """Whether decode rows write their page-boundary snapshots inside the fused kernel (one more write of the
        state) rather than through a gather and a scatter after the step."""
        return self.fused_decode is not None and snapshots is not None

    # -- planning ------------------------------------------------------------------------------------
    def plan(self, batch, running, page_size: int, snapshots=None) -> "StepPlan":
        """Where each scheduled part's state comes from and goes: slots, restores from snapshots before the
        forward, and snapshots taken at the page boundaries the step reaches (`snapshots`: the prefix cache's
        snapshot pool, None without one)."""
        plan = StepPlan(self, snapshots)
        in_kernel = self.snapshots_in_kernel(snapshots)
        if snapshots is not None:
            snapshots.begin_step()
        slots, row = [], 0
        for item in batch:  # restores first: a snapshot taken below may evict one restored from (the copy runs first)
            seq = item.seq
            slot = self._slot(seq, running)
            slots.append(slot)
            if seq.resume_page is not None and item.start > 0:
                plan.restores.append((snapshots.index(seq.resume_page), slot))
            seq.resume_page = None
        for item, slot in zip(batch, slots):
            seq, start, n = item.seq, item.start, item.length
            end, fresh = start + n, start == 0
            boundary = end // page_size * page_size
            split = boundary - start if start < boundary < end else 0
            snap = -1
            if boundary > start and snapshots is not None:
                snap = snapshots.take(seq.pages[boundary // page_size - 1], seq)
            single = n == 1 and not fresh
            if single:
                plan.single_rows.append(row)
                plan.single_slots.append(slot)
                if in_kernel:
                    plan.single_snaps.append(snap)
            else:
                plan.chunks.append(Chunk(row, n, slot, fresh, split, snap if split else -1))
            if snap >= 0 and not split and not (single and in_kernel):
                plan.saves.append((slot, snap))
            row += n
        if self.kernels is not None and plan.chunks:
            plan.varlen = varlen_layout(plan.chunks, self.conv_shape[1])
        return plan

    def static_plan(self, slots: torch.Tensor, snaps: torch.Tensor) -> "StepPlan":
        """A captured decode step's plan: row i decodes from slot `slots[i]` and, where snapshots are written in
        the kernel, writes its snapshot `snaps[i]` (buffers written before each replay; padding rows hold the
        scratch slot and no snapshot, -1)."""
        in_kernel = self.snapshots_in_kernel(self.snapshots)
        plan = StepPlan(self, self.snapshots if in_kernel else None)
        plan.single_slots_dev = slots
        plan.single_snaps_dev = snaps if in_kernel else None
        plan.num_singles = slots.shape[0]
        return plan

    def _slot(self, seq, running) -> int:
        slot = self._slot_of.get(seq.request_id)
        if slot is None:
            if not self._free:
                self._release_preempted({s.request_id for s in running})
            slot = self._free.pop()  # slots >= max_num_seqs >= running sequences
            self._slot_of[seq.request_id] = slot
        return slot

    def free(self, seq) -> None:
        slot = self._slot_of.pop(seq.request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _release_preempted(self, running_ids: set[int]) -> None:
        """Slots of preempted sequences go back: they restart from position 0 or from a snapshot anyway."""
        for rid in [r for r in self._slot_of if r not in running_ids]:
            self._free.append(self._slot_of.pop(rid))

    # -- copies around a step ----------------------------------------------------------------------
    def before(self, plan: "StepPlan") -> None:
        """Restore the slots of sequences resuming from a snapshot (device indices from the step's upload); on the
        varlen path, zero the slots of chunks starting at position 0, which then continue from them like any other."""
        if "lin_fresh" in plan.dev:
            self.conv.index_fill_(1, plan.dev["lin_fresh"], 0)
            self.recurrent.index_fill_(1, plan.dev["lin_fresh"], 0)
        if plan.restores:
            snaps, slots = plan.dev["lin_restore"].view(2, -1)
            _copy_states((self.conv, self.recurrent), slots, (plan.snapshots.conv, plan.snapshots.recurrent), snaps)

    def after(self, plan: "StepPlan") -> None:
        """Copy the states that ended on a page boundary into their snapshots."""
        if plan.saves:
            slots, snaps = plan.dev["lin_save"].view(2, -1)
            _copy_states((plan.snapshots.conv, plan.snapshots.recurrent), snaps, (self.conv, self.recurrent), slots)

    # -- memory --------------------------------------------------------------------------------------
    def release(self) -> None:
        self._saved = (self.conv.cpu(), self.recurrent.cpu())
        self.conv = self.recurrent = None

    def restore(self) -> None:
        if self._saved is not None:
            conv, rec = self._saved
            self.conv, self.recurrent = conv.to(self.device), rec.to(self.device)
            self._saved = None


def _copy_states(dst: tuple, dst_index: torch.Tensor, src: tuple, src_index: torch.Tensor) -> None:
    """`dst[:, dst_index] = src[:, src_index]` for each pair of `[layers, n, ...]` state tensors, a layer at a time: the
    gathered temporary is one layer's, not every layer's (a step that prefills 128 Qwen3.5-0.8B-shaped prompts to
    a page boundary saves 128 whole states, 2.4 GB at once)."""
    for d, s in zip(dst, src):
        for layer in range(d.shape[0]):
            d[layer].index_copy_(0, dst_index, s[layer].index_select(0, src_index))


@dataclass
class Chunk:
    """A sequence's multi-token part of the packed row (or a single token from zero state)."""

    row: int
    length: int
    slot: int
    fresh: bool  # starts at position 0: zero state
    split: int  # offset of the page boundary where the delta rule is split, 0: not split
    snap: int  # snapshot written at the split, -1: none


@dataclass
class StepPlan:
    states: LinearStates
    snapshots: object  # StateSnapshots or None
    single_rows: list[int] = field(default_factory=list)
    single_slots: list[int] = field(default_factory=list)
    single_snaps: list[int] = field(default_factory=list)  # snapshot each single row writes in the kernel, -1: none
    chunks: list[Chunk] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (snapshot, slot)
    saves: list[tuple[int, int]] = field(default_factory=list)  # (slot, snapshot)
    dev: dict = field(default_factory=dict)
    varlen: "VarlenLayout | None" = None  # the chunks' layout for the varlen kernels; None: per-sequence path
    num_singles: int = 0
    single_slots_dev: torch.Tensor | None = None
    single_snaps_dev: torch.Tensor | None = None  # None: no snapshot written in the decode kernel
    single_rows_dev: torch.Tensor | None = None  # None: the singles are rows 0 .. num_singles - 1

    def parts(self) -> dict[str, np.ndarray]:
        """Host index arrays that travel in the step's one upload."""
        out = {}
        if self.single_slots:
            out["lin_slots"] = np.array(self.single_slots, dtype=np.int64)
            if self.single_rows != list(range(len(self.single_rows))):
                out["lin_rows"] = np.array(self.single_rows, dtype=np.int64)
            if self.single_snaps:
                out["lin_snaps"] = np.array(self.single_snaps, dtype=np.int64)
        if self.restores:
            out["lin_restore"] = np.array(self.restores, dtype=np.int64).T.reshape(-1)
        if self.saves:
            out["lin_save"] = np.array(self.saves, dtype=np.int64).T.reshape(-1)
        if self.varlen is not None:
            out.update(self.varlen.parts)
        return out

    def bind(self, dev: dict[str, torch.Tensor]) -> None:
        """Take the device indices of the step's upload."""
        self.dev = dev
        self.num_singles = len(self.single_slots)
        if self.num_singles:
            self.single_slots_dev = dev["lin_slots"]
            self.single_rows_dev = dev.get("lin_rows")
            self.single_snaps_dev = dev.get("lin_snaps")


def _packed_forward(self, hidden_states, *args, **kwargs):
    """The view's forward of a linear-attention layer over the step's one packed row. In three parts so that a
    compiled decoder layer (`engine.compile`) fuses the elementwise work around the state: the projections and
    gates and the gated norm + output projection are plain tensor ops; `_core`, which reads the step's plan and
    moves states by slot, stays out of the graph."""
    plan: StepPlan | None = kwargs.get(LinearStates.KWARG)
    if plan is None:
        raise RuntimeError("the engine's linear-attention forward was called without its step plan")
    x = hidden_states[0]  # the packed step is one row
    total = x.shape[0]
    mixed, z, b, a = linear_attention_inputs(self, x)  # mixed: [T, conv_dim], its rows strided when fused
    z = z.reshape(total, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    core = _core(self, plan, mixed, g, beta)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(1, total, -1))


@torch.compiler.disable  # host-planned indices, in-place state updates and fused kernels: run as written
def _core(self, plan: "StepPlan", mixed, g, beta):
    """The conv and delta rule of every row of the step: decode rows over their slots, chunks per sequence or
    through the varlen kernels. Returns `[T, Hv, Dv]`."""
    impl = sys.modules[type(self).__module__]
    total = mixed.shape[0]
    states = plan.states
    layer = states.position[self.layer_idx]
    conv_states, rec_states = states.conv[layer], states.recurrent[layer]
    kernels = states.kernels
    rule = kernels.recurrent if kernels is not None else impl.torch_recurrent_gated_delta_rule
    fused = states.fused_decode
    if fused is None:
        decode = functools.partial(_decode_rows, self, rule)
    elif plan.single_snaps_dev is None:
        decode = functools.partial(fused, self)
    else:  # page-boundary snapshots written by the kernel
        snaps = plan.snapshots
        decode = functools.partial(fused, self, snapshot=(snaps.conv[layer], snaps.recurrent[layer],
                                                          plan.single_snaps_dev))
    if plan.num_singles == total:  # every row a decode: the graph path, and most eager steps
        return decode(mixed, g, beta, conv_states, rec_states, plan.single_slots_dev)
    core = mixed.new_empty(total, self.value_dim // self.head_v_dim, self.head_v_dim)
    if plan.num_singles:
        rows = plan.single_rows_dev
        if rows is None:
            n = plan.num_singles
            core[:n] = decode(mixed[:n], g[:n], beta[:n], conv_states, rec_states, plan.single_slots_dev)
        else:
            core.index_copy_(0, rows, decode(mixed.index_select(0, rows), g.index_select(0, rows),
                                             beta.index_select(0, rows), conv_states, rec_states,
                                             plan.single_slots_dev))
    if plan.varlen is not None:
        out = _varlen_chunks(self, kernels, mixed, g, beta, conv_states, rec_states, plan, layer)
        rows = plan.varlen.rows
        if rows is not None:
            core[rows[0]:rows[1]] = out
        else:
            core.index_copy_(0, plan.dev["lin_chunk_rows"], out)
    snapshots = plan.snapshots
    for chunk in plan.chunks if plan.varlen is None else ():
        snap_conv = snap_rec = None
        if chunk.snap >= 0:
            snap_conv, snap_rec = snapshots.conv[layer, chunk.snap], snapshots.recurrent[layer, chunk.snap]
        r, n = chunk.row, chunk.length
        core[r:r + n] = _chunk_rows(self, impl, mixed[r:r + n], g[r:r + n], beta[r:r + n], conv_states,
                                    rec_states, chunk, snap_conv, snap_rec)
    return core


def _decode_rows(self, rule, mixed, g, beta, conv_states, rec_states, slots):
    """One token for each of `len(slots)` sequences, each continuing from its slot: the conv window and the single-token
    delta rule `rule` (recurrent form, one initial state per row) over the whole batch, state gathered by slot and
    scattered back. Rows are independent, so a row's result does not depend on the batch it runs in."""
    from transformers.activations import ACT2FN

    b = mixed.shape[0]
    window = torch.cat([conv_states.index_select(0, slots).to(mixed.dtype), mixed[:, :, None]], dim=-1)  # [B, C, K]
    conv_states.index_copy_(0, slots, window[:, :, 1:].to(conv_states.dtype))
    y = F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=window.shape[1])  # [B, C, 1]
    y = ACT2FN[self.activation](y).transpose(1, 2)  # [B, 1, C]
    q, k, v = _qkv(self, y, b, 1)
    out, final = rule(
        q, k, v, g=g[:, None], beta=beta[:, None], initial_state=rec_states.index_select(0, slots),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    rec_states.index_copy_(0, slots, final.to(rec_states.dtype))
    return out[:, 0]  # [B, Hv, Dv]


def _chunk_rows(self, impl, mixed, g, beta, conv_states, rec_states, chunk: Chunk, snap_conv, snap_rec):
    """One sequence's chunk: the conv over its window, the delta rule (split at `chunk.split`, where the state is
    written into the snapshot `snap_conv` / `snap_rec` if given)."""
    from transformers.activations import ACT2FN

    n, slot, width = chunk.length, chunk.slot, self.conv_kernel_size - 1
    seg = mixed.transpose(0, 1)  # [C, n]
    prev = torch.zeros_like(conv_states[slot]) if chunk.fresh else conv_states[slot]
    window = torch.cat([prev.to(seg.dtype), seg], dim=-1)  # [C, K - 1 + n]
    conv_states[slot] = window[:, window.shape[-1] - width:]
    if snap_conv is not None:  # the window's last `width` inputs before the boundary
        snap_conv.copy_(window[:, chunk.split:chunk.split + width])
    y = F.conv1d(window[None], self.conv1d.weight, self.conv1d.bias, groups=window.shape[0])[0]  # [C, n]
    y = ACT2FN[self.activation](y).transpose(0, 1)[None]  # [1, n, C]
    q, k, v = _qkv(self, y, 1, n)
    state = None if chunk.fresh else rec_states[slot:slot + 1]
    outs = []
    for a, b in ((0, chunk.split), (chunk.split, n)) if chunk.split else ((0, n),):
        rule = impl.torch_recurrent_gated_delta_rule if b - a == 1 and state is not None else \
            impl.torch_chunk_gated_delta_rule
        out, state = rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[a:b][None], beta=beta[a:b][None],
                          initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        if a == 0 and snap_rec is not None:
            snap_rec.copy_(state[0])
        outs.append(out[0])
    rec_states[slot] = state[0].to(rec_states.dtype)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
