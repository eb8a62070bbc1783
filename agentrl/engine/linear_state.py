"""Per-sequence state slots for linear-attention layers (Qwen3.5's gated delta net), beside the paged KV.

A linear-attention layer keeps no KV: each sequence carries a convolution window (the last
`kernel - 1` inputs of the short causal conv) and a recurrent matrix per value head. They live in slot
tensors indexed by a per-sequence slot, so a packed step runs the projections over all its tokens at
once and only the conv and the delta rule go sequence by sequence, each from its own slot. A sequence
that starts (or restarts after preemption) from position 0 starts from zero state.

The view's linear-attention modules get this forward instead of transformers' own, which reads its state
from a Cache object over a padded batch; the math functions (conv, chunked / recurrent delta rule, gated
norm) are still the model's own, so a fused kernel registered for them is what runs.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

_REQUIRED = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj",
             "key_dim", "value_dim", "head_k_dim", "head_v_dim", "conv_kernel_size", "activation")


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
        first = next(iter(self.modules.values()))
        p = first.in_proj_qkv.weight
        self.num_slots = num_slots
        self._shapes = {}
        for idx, m in self.modules.items():
            conv_dim = m.key_dim * 2 + m.value_dim
            heads = m.value_dim // m.head_v_dim
            self._shapes[idx] = ((num_slots, conv_dim, m.conv_kernel_size - 1),
                                 (num_slots, heads, m.head_k_dim, m.head_v_dim))
            m.forward = types.MethodType(_packed_forward, m)
        self.device, self.dtype = p.device, p.dtype
        self._allocate()
        self._slot_of: dict[int, int] = {}  # request id -> slot
        self._free = list(range(num_slots - 1, -1, -1))
        self._saved = None

    def _allocate(self) -> None:
        # The recurrent state stays fp32: the delta rule accumulates in it over the whole sequence.
        self.conv = {i: torch.zeros(c, dtype=self.dtype, device=self.device) for i, (c, _) in self._shapes.items()}
        self.recurrent = {i: torch.zeros(r, dtype=torch.float32, device=self.device)
                          for i, (_, r) in self._shapes.items()}

    def plan(self, batch, running) -> "_Plan":
        """(first row, length, slot, starts fresh) per scheduled sequence, in packed order."""
        segments, row = [], 0
        for item in batch:
            seq = item.seq
            slot = self._slot_of.get(seq.request_id)
            if slot is None:
                if not self._free:
                    self._release_preempted({s.request_id for s in running})
                slot = self._free.pop()  # slots >= max_num_seqs >= running sequences
                self._slot_of[seq.request_id] = slot
            segments.append((row, item.length, slot, item.start == 0))
            row += item.length
        return _Plan(self, segments)

    def free(self, seq) -> None:
        slot = self._slot_of.pop(seq.request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _release_preempted(self, running_ids: set[int]) -> None:
        """Slots of preempted sequences go back: they restart from position 0 and zero state anyway."""
        for rid in [r for r in self._slot_of if r not in running_ids]:
            self._free.append(self._slot_of.pop(rid))

    def release(self) -> None:
        self._saved = ({i: t.cpu() for i, t in self.conv.items()}, {i: t.cpu() for i, t in self.recurrent.items()})
        self.conv = self.recurrent = None

    def restore(self) -> None:
        if self._saved is not None:
            conv, rec = self._saved
            self.conv = {i: t.to(self.device) for i, t in conv.items()}
            self.recurrent = {i: t.to(self.device) for i, t in rec.items()}
            self._saved = None


class _Plan:
    def __init__(self, states: LinearStates, segments):
        self.states, self.segments = states, segments


def _packed_forward(self, hidden_states, *args, **kwargs):
    plan: _Plan | None = kwargs.get(LinearStates.KWARG)
    if plan is None:
        raise RuntimeError("the engine's linear-attention forward was called without its step plan")
    impl = sys.modules[type(self).__module__]
    from transformers.activations import ACT2FN

    x = hidden_states[0]  # the packed step is one row
    total = x.shape[0]
    mixed = self.in_proj_qkv(x)  # [T, conv_dim]
    z = self.in_proj_z(x).reshape(total, -1, self.head_v_dim)
    beta = self.in_proj_b(x).sigmoid()
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
    weight = self.conv1d.weight  # [C, 1, K]
    width = self.conv_kernel_size - 1
    conv_states, rec_states = plan.states.conv[self.layer_idx], plan.states.recurrent[self.layer_idx]
    outs = []
    for row, n, slot, fresh in plan.segments:
        seg = mixed[row:row + n].transpose(0, 1)  # [C, n]
        prev = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
        window = torch.cat([prev.to(seg.dtype), seg], dim=-1)  # [C, K - 1 + n]
        conv_states[slot] = window[:, window.shape[-1] - width:]
        y = F.conv1d(window[None], weight, self.conv1d.bias, groups=window.shape[0])[0]  # [C, n]
        y = ACT2FN[self.activation](y).transpose(0, 1)[None]  # [1, n, C]
        q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(1, n, -1, self.head_k_dim)
        k = k.reshape(1, n, -1, self.head_k_dim)
        v = v.reshape(1, n, -1, self.head_v_dim)
        if v.shape[2] != k.shape[2]:  # transformers 5.17 repeats q/k heads in the module, 5.24 in the rule
            q = q.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
            k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
        initial = None if fresh else rec_states[slot:slot + 1]
        rule = impl.torch_recurrent_gated_delta_rule if n == 1 and not fresh else impl.torch_chunk_gated_delta_rule
        out, final = rule(q, k, v, g=g[row:row + n][None], beta=beta[row:row + n][None], initial_state=initial,
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        rec_states[slot] = final[0].to(rec_states.dtype)
        outs.append(out[0])
    core = torch.cat(outs, dim=0)  # [T, Hv, Dv]
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(1, total, -1))
