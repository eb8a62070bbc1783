"""The varlen path of the engine's linear-attention layers (`linear_state.py`): every chunk of a step through one
call of flash-linear-attention's causal conv and one of its chunked delta rule.

On CUDA with fla installed (`varlen_kernels`), all the chunks of a step run together instead of one call per
sequence: their tokens in chunk order ("chunk-major", rows of the step's packed row, a plain slice when the chunks
are the row's tail), `cu_seqlens` marking the chunks. fla's varlen conv runs over them from each slot's window
(its initial state) and gives each chunk's last window back; its delta rule runs from the states gathered from the
slots (zeroed first for chunks starting at position 0), the final states scattered back. Everything stays in the
`[tokens, channels]` layout the projections give: no transposed copies, and no depthwise conv through cuDNN. A
chunk split at a page boundary takes two delta-rule calls: the first runs every chunk up to its split (or whole),
the second the rest of the split chunks from the states the first ended with, so the snapshot is the state at the
boundary; the snapshot's conv window is gathered from the chunk's inputs before the boundary (or its slot's window
where the boundary is nearer the chunk's start than the window's width). Every index of that layout is built on the
host in `plan` and travels in the step's one upload; fla's own chunk indices are passed too, so the kernels read no
boundary back to the host. Without CUDA or fla, `linear_state`'s per-sequence path runs: the CPU path, and the
reference this one is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from agentrl.autotune_lock import serialize_autotuners


@dataclass(frozen=True)
class VarlenKernels:
    """flash-linear-attention's kernels, or stand-ins with their signatures: `chunk(q, k, v, g, beta, initial_state=,
    output_final_state=, use_qk_l2norm_in_kernel=, cu_seqlens=, chunk_indices=)`, the gated delta rule over the
    segments of one flat row; `recurrent(...)` (the same without boundaries) over a batch of single tokens; and
    `conv(x, weight, bias, initial_state=, output_final_state=, activation=, cu_seqlens=, chunk_indices=)`, the
    causal depthwise conv over the segments of `x` `[1, tokens, channels]` (`weight` `[channels, kernel]`), each
    from its `initial_state` `[segments, channels, kernel]` (the last `kernel - 1` columns are the inputs before
    the segment), returning the output and each segment's last `kernel` inputs."""

    chunk: Callable
    recurrent: Callable
    conv: Callable


FLA_CHUNK_SIZE = 64  # the chunk size of fla's chunked delta rule and varlen conv: `chunk_indices` number these chunks


def varlen_kernels(device: torch.device) -> VarlenKernels | None:
    """flash-linear-attention's kernels where they run (CUDA, package installed), else None."""
    if device.type != "cuda":
        return None
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    serialize_autotuners()  # the trainer's thread calls the same autotuned kernels
    return VarlenKernels(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, causal_conv1d)


def ieee_fp32_kernels() -> bool:
    """fp32 products in IEEE precision in every Triton kernel compiled from now on in this process, fla's included,
    for comparisons that measure fp32 arithmetic (tests, `benchmarks/hybrid_packing_layers.py`), so that a difference
    left between two fp32 paths is not tf32's. Triton's `tl.dot` on fp32 inputs defaults to tf32
    (`TRITON_F32_DEFAULT` changes that default), and fla 0.6's fused "kkt + solve_tril" kernel of the chunked delta
    rule asks for tf32 explicitly on sm80 and newer, which the variable does not override: its module constant is set
    here. (The fp32 packed hybrid test measured the same with and without the constant: what it measured was fp32's
    own rounding on an ill-conditioned tiny model, BENCHMARKS.md, history 2026-12-02.) Call it before any of those
    kernels compiles (a kernel compiled already keeps its precision, and Triton refuses a constant changed after a
    compile). Returns whether fla's constant was set (False without fla)."""
    import os

    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    try:
        import triton.language as tl
        from fla.ops.gated_delta_rule import chunk_fwd
    except ImportError:
        return False
    if not hasattr(chunk_fwd, "SOLVE_TRIL_DOT_PRECISION"):
        return False
    chunk_fwd.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")
    return True


@dataclass
class VarlenLayout:
    """Where a step's chunks go for the varlen kernels (host arrays named `lin_*`, uploaded with the step).

    The chunks' tokens are taken in chunk order ("chunk-major"): the packed row's rows `rows` (a `(start, stop)`
    slice; None: the rows `lin_chunk_rows`, gathered). The conv runs over the chunks as segments `lin_cuc` (fla's
    chunk indices `lin_cic`; absent: the same as the first delta-rule call's). The delta rule's first call runs the
    chunk-major positions `lin_p1` (absent: all of them) as segments `lin_cu1`; its second, where chunks are split,
    `lin_p2` as `lin_cu2`, from the first call's final states of the chunks `lin_split`. `lin_ci*` are fla's chunk
    indices of those segments, `(segment, chunk within it)` pairs. A split chunk writing a snapshot (`lin_snap_chunks`
    into `lin_snap_ids`) takes the conv window before its boundary from the chunk-major rows `lin_snap_rows` where
    `lin_snap_in_x` is 1, else from its slot's window, the columns `lin_snap_win` of the chunks' windows laid end to
    end."""

    parts: dict[str, np.ndarray]
    tokens: int
    rows: tuple[int, int] | None


def _segments(lengths) -> tuple[np.ndarray, np.ndarray]:
    """cu_seqlens of segments of `lengths` tokens, and fla's chunk indices of them (flattened `[NT, 2]`)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = -(-lengths // FLA_CHUNK_SIZE)
    seg = np.repeat(np.arange(len(lengths)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.concatenate([[0], np.cumsum(lengths)]), np.stack([seg, within], 1).reshape(-1)


def _spans(starts, lengths) -> np.ndarray:
    return np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)]).astype(np.int64)


def varlen_layout(chunks: list, width: int) -> VarlenLayout:
    """The layout of `chunks` (`linear_state.Chunk`s, in row order) for a conv window of `width` columns."""
    lens = np.array([c.length for c in chunks], dtype=np.int64)
    first = np.array([c.split or c.length for c in chunks], dtype=np.int64)
    base = np.cumsum(lens) - lens  # each chunk's start in chunk-major order
    starts = np.array([c.row for c in chunks], dtype=np.int64)
    contiguous = bool((starts == starts[0] + base).all())
    parts = {"lin_chunk_slots": np.array([c.slot for c in chunks], dtype=np.int64)}
    if not contiguous:
        parts["lin_chunk_rows"] = _spans(starts, lens)
    fresh = [c.slot for c in chunks if c.fresh]
    if fresh:
        parts["lin_fresh"] = np.array(fresh, dtype=np.int64)
    parts["lin_cu1"], parts["lin_ci1"] = _segments(first)
    split = np.array([i for i, c in enumerate(chunks) if c.split], dtype=np.int64)
    if split.size:
        parts["lin_cuc"], parts["lin_cic"] = _segments(lens)
        parts["lin_p1"] = _spans(base, first)
        parts["lin_p2"] = _spans(base[split] + first[split], lens[split] - first[split])
        parts["lin_cu2"], parts["lin_ci2"] = _segments(lens[split] - first[split])
        parts["lin_split"] = split
        snaps = np.array([i for i in split if chunks[i].snap >= 0], dtype=np.int64)
        if snaps.size:
            parts["lin_snap_chunks"] = snaps
            parts["lin_snap_ids"] = np.array([chunks[i].snap for i in snaps], dtype=np.int64)
            # The window before the boundary: its column j is the input `width - j` before it, in the chunk
            # (chunk-major row) or, nearer the chunk's start than `width`, in the slot's window (column split + j).
            ahead = (first[snaps][:, None] - width + np.arange(width)).reshape(-1)  # offsets in the chunk
            within = ahead >= 0
            parts["lin_snap_rows"] = np.repeat(base[snaps], width) + np.maximum(ahead, 0)
            parts["lin_snap_in_x"] = within.astype(np.int64)
            parts["lin_snap_win"] = np.repeat(snaps, width) * width + np.minimum(ahead + width, width - 1)
    rows = (int(starts[0]), int(starts[0] + lens.sum())) if contiguous else None
    return VarlenLayout(parts, int(lens.sum()), rows)


def _qkv(self, y: torch.Tensor, batch: int, n: int):
    """q, k, v `[batch, n, heads, dim]` from the conv output `[batch, n, conv_dim]`."""
    q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(batch, n, -1, self.head_k_dim)
    k = k.reshape(batch, n, -1, self.head_k_dim)
    v = v.reshape(batch, n, -1, self.head_v_dim)
    if v.shape[2] != k.shape[2]:  # transformers 5.17 repeats q/k heads in the module, 5.24 in the rule
        q = q.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
        k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    return q, k, v


def chunk_major(mixed: torch.Tensor, plan) -> torch.Tensor:
    """The rows of `mixed` `[T, ...]` that the step's chunks cover, in chunk order (`VarlenLayout`)."""
    rows = plan.varlen.rows
    return mixed[rows[0]:rows[1]] if rows is not None else mixed.index_select(0, plan.dev["lin_chunk_rows"])


def _varlen_chunks(self, kernels: VarlenKernels, mixed, g, beta, conv_states, rec_states, plan, layer: int):
    """Every chunk of the step (`plan`: its `linear_state.StepPlan`) through the varlen kernels (`VarlenLayout`):
    core rows `[tokens, Hv, Dv]` in chunk-major order. Fresh chunks' slots were zeroed before the forward
    (`LinearStates.before`)."""
    from transformers.activations import ACT2FN

    d, width, channels = plan.dev, self.conv_kernel_size - 1, mixed.shape[1]
    slots, tokens = d["lin_chunk_slots"], plan.varlen.tokens
    x = chunk_major(mixed, plan).contiguous()  # [tokens, C]; rows of a fused projection's output are strided
    windows = conv_states.index_select(0, slots).to(x.dtype)  # [chunks, C, width]
    # fla's conv state is the kernel's width: its first column is never read
    fused = self.activation in ("silu", "swish")
    y, tails = kernels.conv(x[None], self.conv1d.weight.squeeze(1), self.conv1d.bias,
                            initial_state=F.pad(windows, (1, 0)), output_final_state=True,
                            activation=self.activation if fused else None, cu_seqlens=d.get("lin_cuc", d["lin_cu1"]),
                            chunk_indices=d.get("lin_cic", d["lin_ci1"]).view(-1, 2))
    conv_states.index_copy_(0, slots, tails[..., 1:].to(conv_states.dtype))
    if "lin_snap_ids" in d:
        from_x = x.index_select(0, d["lin_snap_rows"])  # [snapshots * width, C]
        from_window = windows.transpose(1, 2).reshape(-1, channels).index_select(0, d["lin_snap_win"])
        window = torch.where(d["lin_snap_in_x"].bool()[:, None], from_x, from_window)
        plan.snapshots.conv[layer].index_copy_(0, d["lin_snap_ids"], window.view(-1, width, channels).transpose(1, 2))
    y = y if fused else ACT2FN[self.activation](y)
    q, k, v = _qkv(self, y, 1, tokens)
    g, beta = chunk_major(g, plan)[None], chunk_major(beta, plan)[None]

    def rule(p, state, cu, ci):
        pick = (lambda t: t) if p is None else (lambda t: t.index_select(1, p))
        return kernels.chunk(pick(q), pick(k), pick(v), g=pick(g), beta=pick(beta), initial_state=state,
                             output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                             chunk_indices=ci.view(-1, 2))

    out, final = rule(d.get("lin_p1"), rec_states.index_select(0, slots), d["lin_cu1"], d["lin_ci1"])
    out = out[0]
    if "lin_p2" in d:  # split chunks: the rest of each from the state at its page boundary
        if "lin_snap_ids" in d:
            at_split = final.index_select(0, d["lin_snap_chunks"])
            plan.snapshots.recurrent[layer].index_copy_(0, d["lin_snap_ids"], at_split)
        rest, last = rule(d["lin_p2"], final.index_select(0, d["lin_split"]), d["lin_cu2"], d["lin_ci2"])
        out = out.new_empty(tokens, *out.shape[1:]).index_copy_(0, d["lin_p1"], out)
        out.index_copy_(0, d["lin_p2"], rest[0])
        final = final.index_copy(0, d["lin_split"], last)
    rec_states.index_copy_(0, slots, final.to(rec_states.dtype))
    return out
