"""The trainer's flat forward and backward replayed from CUDA graphs, one pair per shape bucket.

Why: the training step of a small model is bound by launching kernels from Python, thousands a step (a few dozen
a decoder layer, forward and backward, even compiled). In a run the engine's thread steps beside it in the same
process, and every launch lets go of the GIL and must win it back from that thread, which doubles the trainer's
step (BENCHMARKS.md, "Engine and trainer on one GPU"). Replayed from a graph, a micro-batch's decoder forward is one
launch and its backward another; only the chunked lm_head and the loss, a few dozen kernels, stay eager.

How, for one micro-batch on the flat layout (`logprobs.flat_layout`, `prefix_forward.tree_flat_layout`):
- Shapes come from few buckets (`Buckets`): the row's length on a grid (multiples, then steps of 1.25x, capped at
  one packed row; past one row, whole rows plus eighths of a row); the sample boundaries' count, the longest query
  and key sequence and the gathered keys of a prefix-shared row on powers of two or the same grid. The padding is
  laid out as segments of its own (no real token attends to it; every padding position is computed, from valid
  ids and positions, so nothing undefined reaches a gradient), and boundary lists are filled up with empty
  segments.
- The first micro-batch of a bucket with gradients runs eagerly (it also compiles and tunes whatever the compiled
  layers and the backward need for it; a forward without gradients does neither and does not count); the second
  captures the forward and the backward into graphs that share one memory pool, then replays.
  Captures run under `guard` (the run passes `Engine.pause`): no other thread's GPU work lands inside one.
- The backward graph adds into each parameter's `.grad` in place, so those tensors must stay where the capture
  saw them: before every replay, gradients the optimizer set to None (or that an eager micro-batch made anew) are
  put back into the captured tensors (`_bind_grads`), zeroed or copied, in two foreach kernels.
- Graphs read the parameters in place, so optimizer updates need no re-capture (as the engine's decode graphs).

The same code runs on CPU with a stand-in capture (`capture=stand_in_capture`: replay re-runs the captured
function), which is how the tests check bucketing, the replay's autograd plumbing and gradient binding without a
GPU; the padded eager path (`capture=None`) is the reference a graph must equal bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import OrderedDict
from dataclasses import dataclass, fields, replace
from types import SimpleNamespace
from typing import Callable, ContextManager

import torch

from agentrl.graph_capture import record_graph
from agentrl.train.linear_conv import CHUNK_SIZE, packed_conv_boundaries
from agentrl.train.varlen_attention import KV_INDEX

_log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ padding plans


@dataclass(frozen=True)
class Padding:
    """How a flat row of `real` tokens is padded: its length, the padding's own segments, and the capacities of the
    boundary lists (segments) and of a prefix-shared row's gathered keys."""

    length: int
    tails: tuple[int, ...]
    segments: int  # boundary entries - 1: real segments, tails, then empty segments
    keys: int  # gathered keys: the real ones, the tails', then unused entries
    max_q: int
    max_k: int
    chunks: int | None = None  # fla's chunk indices a hybrid's row holds (None: as many as its segments have)


Plan = Callable[[int, int, int, int, int], Padding]  # (real tokens, segments, keys, max_q, max_k) -> Padding


class RoundUp:
    """Today's eager plan: the length rounded up to `multiple`, the padding one segment, no other capacity."""

    def __init__(self, multiple: int = 1):
        if multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {multiple}")
        self.multiple = multiple

    def __call__(self, real: int, segments: int, keys: int, max_q: int, max_k: int) -> Padding:
        length = -(-real // self.multiple) * self.multiple
        tail = length - real
        tails = (tail,) if tail else ()
        return Padding(length, tails, segments + len(tails), keys + tail, max(max_q, tail), max(max_k, tail))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class Buckets:
    """Few distinct shapes: each one is a pair of graphs (captured once, kept for the run).

    `row_tokens` is the packer's row capacity. The packer fills rows close to it, so a micro-batch of k rows is
    most often just under k full rows: the grid also holds every multiple of the capacity (rounded up to
    `multiple`), and past one row every eighth of a row. Without it a full row of 8,192 tokens lands on the
    geometric step above it (8,832), and the padding costs the step 8% of its compute."""

    def __init__(self, multiple: int = 128, ratio: float = 1.25, min_segments: int = 8, row_tokens: int | None = None):
        if multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {multiple}")
        self.multiple, self.ratio, self.min_segments = multiple, ratio, min_segments
        self.row = None if row_tokens is None else -(-row_tokens // multiple) * multiple

    def grid(self, n: int) -> int:
        """The smallest grid value >= n: multiples up to 8 of them, then steps of `ratio` rounded to multiples;
        with `row_tokens`, capped at one row, and past one row also whole rows plus eighths of a row (whichever
        is smaller). Eighths, not multiples: the step's token count moves by hundreds from step to step, and a
        finer grid past the first row would make most steps a new bucket (eager, then a capture)."""
        if self.row is None:
            return self._steps(n)
        if n <= self.row:
            return min(self._steps(n), self.row)
        eighth = -(-self.row // 8 // self.multiple) * self.multiple
        return min(self._steps(n), -(-n // eighth) * eighth)

    def _steps(self, n: int) -> int:
        m, g = self.multiple, self.multiple
        while g < n:
            g = g + m if g < 8 * m else -(-int(g * self.ratio) // m) * m
        return g

    def __call__(self, real: int, segments: int, keys: int, max_q: int, max_k: int) -> Padding:
        length = self.grid(real)
        max_q = min(_pow2(max_q), length)
        tail = length - real
        tails = (max_q,) * (tail // max_q) + ((tail % max_q,) if tail % max_q else ())
        # Key sequences hold their queries, so a tail never exceeds max_k either.
        max_k = max(min(_pow2(max_k), self.grid(keys + tail)), max_q)
        capacity = _pow2(max(segments + len(tails), self.min_segments))
        # Every segment holds at most one chunk more than its tokens fill: a hybrid's fixed grid of chunks.
        return Padding(length, tails, capacity, self.grid(keys + tail), max_q, max_k,
                       chunks=-(-length // CHUNK_SIZE) + capacity)


def boundaries(lengths: list[int], capacity: int) -> list[int]:
    """Cumulative boundaries of `lengths`, filled up to `capacity` segments with empty ones."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out + [out[-1]] * (capacity - len(lengths))


# ------------------------------------------------------------------------------------------------ the forward


@dataclass
class FlatInputs:
    """One flat forward's device inputs; `kv_index` only for a prefix-shared row (`varlen_attention.KV_INDEX`)."""

    ids: torch.Tensor  # [N] long
    pos: torch.Tensor  # [N] long
    cu_q: torch.Tensor  # int32 [S + 1]
    cu_k: torch.Tensor  # int32 [S + 1]
    max_q: int
    max_k: int
    kv_index: torch.Tensor | None = None  # [K] long
    chunks: torch.Tensor | None = None  # int32 [C, 2]: a hybrid row's chunk indices (`linear_conv.chunk_indices`)

    def __post_init__(self):
        # Each tensor starts its own storage. The layouts arrive as views into one host-to-device copy (storage
        # offsets > 1), a bucket's static copies are fresh tensors (offset 0), and compiled layers guard on the
        # offset (0/1 specialization): the first capture would otherwise recompile every layer frame in the step
        # that captures (tests/train/test_compile_default.py, the graphs cases).
        self._replace_tensors(lambda t: t.clone() if t.storage_offset() else t)

    def _replace_tensors(self, new: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every tensor field through `new`, one call per distinct tensor: fields that are one tensor stay one (a
        plain row's query and key boundaries). Compiled layers guard on that aliasing too; a static copy that split
        them recompiled every layer inside the capture, whose first run of the new kernels (inductor benchmarks
        them) the capture cannot take."""
        done: dict[int, torch.Tensor] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                if id(value) not in done:
                    done[id(value)] = new(value)
                setattr(self, f.name, done[id(value)])

    def key(self) -> tuple:
        kv = -1 if self.kv_index is None else self.kv_index.numel()
        chunks = -1 if self.chunks is None else self.chunks.numel()
        # Whether the boundaries are one tensor: a bucket's static copy keeps that aliasing, so its inputs must too.
        return (self.ids.numel(), self.cu_q.numel(), self.cu_k.numel(), kv, self.max_q, self.max_k, chunks,
                self.cu_q is self.cu_k)

    def run(self, decoder) -> torch.Tensor:
        """Final hidden states `[N, H]`: the decoder over one flat row, the boundaries passed to every layer; with
        `chunks` (a hybrid model), its linear-attention layers kept within the samples on these very tensors, which
        a captured graph then reads at every replay."""
        extra = {} if self.kv_index is None else {KV_INDEX: self.kv_index}
        within = (contextlib.nullcontext() if self.chunks is None
                  else packed_conv_boundaries(decoder, self.cu_q, self.ids.numel(), chunks=self.chunks))
        with within:
            out = decoder(input_ids=self.ids[None], position_ids=self.pos[None], use_cache=False,
                          cu_seq_lens_q=self.cu_q, cu_seq_lens_k=self.cu_k, max_length_q=self.max_q,
                          max_length_k=self.max_k, **extra)
        return out.last_hidden_state.squeeze(0)  # a view; indexing [0] would copy its gradient into zeros

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def static_copy(self) -> FlatInputs:
        copy = replace(self)
        copy._replace_tensors(torch.Tensor.clone)
        return copy


def flat_forward(decoder, inputs: FlatInputs, graphs: FlatGraphs | None) -> torch.Tensor:
    return inputs.run(decoder) if graphs is None else graphs(inputs)


# ------------------------------------------------------------------------------------------------ captures


Capture = Callable[[Callable[[], None], object], Callable[[], None]]


def cuda_capture(fn: Callable[[], None], pool) -> Callable[[], None]:
    """`fn`'s kernels recorded into a CUDA graph (not run; `graph_capture.record_graph`); returns its replay.
    `guard` keeps the engine's kernels out of it."""
    graph, _ = record_graph(fn, pool)
    return graph.replay


def stand_in_capture(fn: Callable[[], None], pool) -> Callable[[], None]:
    """CPU tests' capture: nothing recorded, replay runs `fn` again."""
    return fn


def _tagged(capture: Capture, fn: Callable[[], None], pool, phase: str) -> Callable[[], None]:
    """`capture(fn, pool)`, an exception marked with the phase it came from (the forward or the backward)."""
    try:
        return capture(fn, pool)
    except Exception as exc:
        exc.capture_phase = phase
        raise


class _Entry:
    """One bucket's static inputs, graphs and output."""

    def __init__(self, decoder, params: list[torch.Tensor], inputs: FlatInputs, capture: Capture, pool):
        self.static = inputs.static_copy()
        width = decoder.config.hidden_size
        dtype = next(decoder.parameters()).dtype
        self.grad_in = torch.zeros(inputs.ids.numel(), width, dtype=dtype, device=inputs.ids.device)
        holder = SimpleNamespace(hidden=None)

        def forward():
            holder.hidden = self.static.run(decoder)

        def backward():
            torch.autograd.backward(holder.hidden, self.grad_in, inputs=params)

        self.holder = holder
        self.forward = _tagged(capture, forward, pool, "forward")
        self.backward = _tagged(capture, backward, pool, "backward")
        if holder.hidden is not None:
            # Keep the output's memory, not its autograd graph: a live graph keeps the parameters' gradient
            # accumulators alive, created on the capture stream, and the next capture or eager backward through them
            # syncs with that stream (which invalidates a capture).
            holder.hidden = holder.hidden.detach()

    def load(self, inputs: FlatInputs) -> None:
        for dst, src in zip(self.static.tensors(), inputs.tensors()):
            dst.copy_(src, non_blocking=True)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, entry):
        with torch.enable_grad():  # a stand-in replay records the autograd graph its backward replays through
            entry.forward()
        ctx.entry = entry
        return entry.holder.hidden.detach().clone()  # the static output is overwritten by the bucket's next replay

    @staticmethod
    def backward(ctx, grad):
        ctx.entry.grad_in.copy_(grad)
        ctx.entry.backward()
        return None, None


class FlatGraphs:
    """The decoder's flat forward and backward, from CUDA graphs per shape bucket (see the module docstring).

    `row_tokens`: the packer's row capacity, a step of the length grid. `capture`: `cuda_capture`,
    `stand_in_capture`, or None for the padded eager path only. `guard`: a context holding every other GPU user
    off for a capture. `capture_after`: eager micro-batches of a bucket before its
    capture (the first compiles and tunes what the bucket needs; a capture must not). `max_graphs`: buckets kept
    captured, the least recently replayed dropped first (each holds its inputs, output and gradient buffer, tens
    of MB for a 0.6B model's rows; a dropped bucket that comes back runs eagerly once more, then is captured)."""

    def __init__(self, decoder, *, pad_multiple: int = 128, row_tokens: int | None = None,
                 capture: Capture | None = cuda_capture, guard: Callable[[], ContextManager] = contextlib.nullcontext,
                 capture_after: int = 1, max_graphs: int = 32):
        self.decoder, self.capture, self.guard, self.capture_after = decoder, capture, guard, capture_after
        self.max_graphs = max_graphs
        self.padding = Buckets(pad_multiple, row_tokens=row_tokens)
        self.params = [p for p in decoder.parameters() if p.requires_grad]
        self.pool = torch.cuda.graph_pool_handle() if capture is cuda_capture else None
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()  # least recently replayed first
        self._seen: dict[tuple, int] = {}
        self._grads: list[torch.Tensor] | None = None
        self._binding = self._addresses()
        # Gives the replay's output a grad_fn.
        self._anchor = torch.zeros((), requires_grad=True, device=self.params[0].device)
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}

    def _addresses(self) -> tuple:
        return tuple(p.data_ptr() for p in self.params)

    def __call__(self, inputs: FlatInputs) -> torch.Tensor:
        binding = self._addresses()
        if binding != self._binding:
            # A graph reads each parameter at the address it was captured with: one that moved (re-pointed by the
            # engine's fused projections, replaced by `.to()`) would be read stale. Every bucket starts afresh.
            self._entries.clear()
            self._seen.clear()
            self._binding = binding
        key = inputs.key()
        entry = self._entries.get(key)
        if entry is None:
            if self.capture is None or not torch.is_grad_enabled():
                # A forward without gradients warms nothing a capture needs (compiled layers trace a separate
                # inference graph; the backward's kernels never run): it does not count as the bucket's eager run.
                self.counts["eager"] += 1
                return inputs.run(self.decoder)
            self._seen[key] = seen = self._seen.get(key, 0) + 1
            if seen <= self.capture_after:
                self.counts["eager"] += 1
                return inputs.run(self.decoder)
            if len(self._entries) >= self.max_graphs:
                dropped, _ = self._entries.popitem(last=False)
                self._seen[dropped] = 0
            try:
                with self.guard():
                    self._bind_grads()  # the backward graph adds into these tensors: they must be the final ones
                    entry = self._entries[key] = _Entry(self.decoder, self.params, inputs, self.capture, self.pool)
            except Exception as exc:  # a layer or kernel that cannot be captured here: train on, eagerly
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                phase = getattr(exc, "capture_phase", "")
                warnings.warn(f"capturing the trainer's forward and backward in CUDA graphs failed"
                              f"{f' in the {phase}' if phase else ''} ({first}); training without them", stacklevel=2)
                _log.debug("the failed capture", exc_info=exc)  # where it surfaced, for a run that asks
                self.capture = None
                self.counts["eager"] += 1
                return inputs.run(self.decoder)
            self.counts["captured"] += 1
        self._entries.move_to_end(key)
        self._bind_grads()
        entry.load(inputs)
        self.counts["replayed"] += 1
        return _Replay.apply(self._anchor, entry)

    def _bind_grads(self) -> None:
        """Every parameter's `.grad` is its captured tensor again, holding what it would hold eagerly."""
        if self._grads is None:
            self._grads = [torch.zeros_like(p) for p in self.params]
        stale = [(p, g) for p, g in zip(self.params, self._grads) if p.grad is not g]
        if not stale:
            return
        cleared = [g for p, g in stale if p.grad is None]
        moved = [(g, p.grad) for p, g in stale if p.grad is not None]
        if cleared:
            torch._foreach_zero_(cleared)
        if moved:
            torch._foreach_copy_([g for g, _ in moved], [src for _, src in moved])
        for p, g in stale:
            p.grad = g
