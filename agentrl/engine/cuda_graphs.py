"""CUDA graphs for engine steps: one replay instead of a Python walk over every layer. `DecodeGraphs` serve
pure-decode steps per batch-size bucket; `MixedGraphs` (at the bottom) serve steps that prefill, per token
bucket.

What a decode graph holds: the model view's whole forward over a padded decode batch of `bucket` rows, lm_head
included (logits `[bucket, vocab]`). Sampling runs after the replay, eagerly, on the first `n` rows: it is
a few batched ops whose knobs (which truncations run) vary per step. Steps larger than the largest bucket run
eagerly, and so do a hybrid model's steps that prefill (a chunk's delta rule runs per sequence, planned on the
host).

Hybrid models (Qwen3.5): a decode step's linear-attention layers run the conv and the single-token delta rule
over the batch of their state slots, gathered and scattered by a slot index (`linear_state.py`), so the graph
captures them like any other op: the slot of each row is one more static buffer, written before a replay, and
padding rows hold the scratch slot (they read and write nothing of a sequence's). The state tensors are
reallocated by a restore after `release_kv()`, so their addresses are part of what a graph was captured
against. Snapshots the step takes at page boundaries are copied out after the replay, eagerly.

Static inputs: one set of buffers sized for the largest bucket, shared by every graph (graphs never run
concurrently): input ids, positions, slot mapping, context lengths, block tables `[max bucket, pages of
max_model_len]` and `query_start_loc = arange` (every row is one token). Before a replay the step's rows
are copied in from its single host-to-device upload; rows past `n` are padding: token 0 at position 0,
slot -1 (the KV write skips it) and context length 0 (attention writes zeros, reads nothing). Block-table
entries past a sequence's pages may hold stale page ids: the kernels never read past `seq_lens`.

One graph per bucket: 1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512 up to `max_num_seqs` (and
`max_num_seqs` itself). The decode kernel's split-K count is a launch parameter a replay cannot change; each
graph pins the count chosen for its bucket at `max_model_len`, the longest context it may meet. Shorter
contexts then leave some splits empty (a program that finds no tile writes an empty partial and exits),
which costs little next to capturing a graph per split count as contexts grow mid-run. The first decode
step captures every bucket, largest first, so the others reuse the largest one's scratch memory in the
shared pool.

Why graphs stay valid, and when they do not: a graph replays kernels on the addresses it captured.
- Parameters: the view reads the training model's own tensors, and an optimizer step updates them in place,
  so a replay after `p.add_(...)` reads the new values. A parameter re-assigned to new storage (`p.data = t`,
  `load_state_dict` into a fresh tensor) would leave a graph on the old storage: every replay first compares
  the parameters' and buffers' addresses with those captured against, and captures again if one moved.
- KV pool: `release_kv()` frees the pool's device tensor (the point is to hand its memory to the training
  step) and `restore_kv()` allocates a new one. The caching allocator usually returns the same address for
  the same size once the training step has freed its memory; when it does, the graphs stay; when it does
  not, they are dropped (freeing their pool) and captured again on first use. Keeping the storage at a fixed
  address across a release would need virtual-memory remapping (reserve the range, unmap and remap physical
  pages), which torch does not expose; the cost of this choice is a capture per bucket in use after such a
  restore, about two eager forwards each.
Captures use `capture_error_mode="thread_local"`: the trainer may issue CUDA work on its own thread while
the engine thread captures, and the default global mode would make those calls fail.

The capture function is a parameter, so the bucket choice, buffer filling, padding and re-capture logic run
on CPU in tests with a stand-in "graph" that simply calls the function again at each replay.
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from agentrl.engine.attention import AttentionBackend, PagedStep, stepping
from agentrl.engine.kv_storage import KVStorage
from agentrl.engine.linear_state import LinearStates
from agentrl.engine.model_view import Geometry
from agentrl.engine.step_layout import StepMetadata, fill_placeholders, layout_step, tile_table, upload
from agentrl.graph_capture import record_graph


@dataclass(frozen=True)
class ForwardParts:
    """What a captured step runs on, handed over by the engine: the model view, the attention backend, the KV
    storage and each attention layer's index in it, the model's geometry, and the bounds the static buffers are
    sized for (`max_model_len` in pages of `page_size`), and a hybrid model's linear-attention state slots."""

    view: nn.Module
    backend: AttentionBackend
    storage: KVStorage
    layer_slot: dict[int, int]  # layer_idx -> its layer in `storage`
    geometry: Geometry
    page_size: int
    device: torch.device
    max_model_len: int
    linear: LinearStates | None = None


BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Padded batch sizes: `BUCKETS` below `max_num_seqs`, every 256 past the last, and `max_num_seqs` itself."""
    sizes = [b for b in BUCKETS if b < max_num_seqs]
    top = BUCKETS[-1]
    while top + 256 < max_num_seqs:
        top += 256
        sizes.append(top)
    return tuple(sizes) + (max_num_seqs,)


def graphs_supported(view) -> bool:
    """False for models whose forward decides on the host from tensor contents, which a replay would skip:
    rotary embeddings that rescale with the sequence length ("dynamic", "longrope") read the largest position."""
    return not any(getattr(m, "rope_type", "default") in ("dynamic", "longrope") for m in view.modules())


def cuda_capture(fn, pool):
    """Run `fn` once, then capture one call into a graph in `pool` (`graph_capture.record_graph`). Returns
    `replay()`, which replays it and returns the captured call's output (a tensor the replay rewrites in place)."""
    graph, out = record_graph(fn, pool, warmup=True)

    def replay():
        graph.replay()
        return out

    return replay


class _GraphSet:
    """What decode and mixed-step graphs share: the parts they run on, one memory pool, the addresses the graphs
    were captured against, and the capture function."""

    def __init__(self, parts: ForwardParts, capture=None, exclusive=contextlib.nullcontext):
        """`capture(fn, pool)` records a graph (`cuda_capture`); `exclusive()` holds off other threads' GPU work
        around it (`StepLock.exclusive`)."""
        self.view, self.backend, self.storage = parts.view, parts.backend, parts.storage
        self._exclusive = exclusive
        self.layer_slot, self.geometry = parts.layer_slot, parts.geometry
        self.page_size, self.device, self.max_model_len = parts.page_size, parts.device, parts.max_model_len
        self.linear = parts.linear
        self._capture_fn = capture or cuda_capture
        self._tensors = list(self.view.parameters()) + list(self.view.buffers())
        self._graphs: dict[int, object] = {}  # bucket -> replay
        self._binding: tuple | None = None
        self._pool = None
        self._warm = False
        self.captures = 0  # graphs captured, re-captures included
        self.replays = 0

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def invalidate(self) -> None:
        """Drop every graph (and with them their memory pool); the next use captures again."""
        self._graphs.clear()
        self._pool = None

    def warmup(self) -> None:
        """Capture every bucket not captured yet, largest first (the smaller graphs then reuse its scratch
        memory in the shared pool), under one wait for other threads' work rather than one per bucket."""
        self._check_binding()
        with self._exclusive():
            for bucket in reversed(self.buckets):
                if bucket not in self._graphs:
                    self._capture(bucket)
        self._warm = True

    def _check_binding(self) -> None:
        """Graphs hold the addresses of the KV pool and of every parameter and buffer: if one moved (a restored
        pool at a new address, a re-assigned parameter), the graphs would read stale memory."""
        binding = (self.storage.kv.data_ptr(), tuple(t.data_ptr() for t in self._tensors),
                   self.linear.data_ptrs() if self.linear is not None else None)
        if binding != self._binding:
            if self._graphs:
                self.invalidate()
            self._binding = binding

    def _replay(self, bucket: int, fill: dict[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Copy the step into the static buffers (`fill`: buffer -> its rows, sliced from the step's upload),
        then replay the bucket's graph, capturing it first if needed."""
        self._check_binding()
        replay = self._graphs.get(bucket) or self._capture(bucket)
        for buffer, rows in fill.items():
            buffer[:rows.shape[0]].copy_(rows)
        out = replay()
        self.replays += 1
        return out

    def _store(self, bucket: int, forward) -> object:
        if self._pool is None and self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        with self._exclusive():
            replay = self._capture_fn(forward, self._pool)
        self._graphs[bucket] = replay
        self.captures += 1
        return replay

    def _capture(self, bucket: int):
        raise NotImplementedError


class DecodeGraphs(_GraphSet):
    def __init__(self, parts: ForwardParts, max_num_seqs: int, capture=None, exclusive=contextlib.nullcontext):
        super().__init__(parts, capture, exclusive)
        self.buckets = batch_buckets(max_num_seqs)
        top, width = self.buckets[-1], -(-self.max_model_len // self.page_size)
        device = self.device
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.pos = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(top, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.linear_slots = (torch.full((top,), self.linear.scratch, dtype=torch.long, device=device)
                             if self.linear is not None else None)
        self.linear_snaps = (torch.full((top,), -1, dtype=torch.long, device=device)
                             if self.linear is not None else None)  # snapshots written in the kernel, -1: none

    # -- choosing ------------------------------------------------------------------------------------
    def accepts(self, batch) -> bool:
        """A pure-decode step that fits a bucket (decodes come first, so the last item tells)."""
        return bool(batch) and batch[-1].decode and len(batch) <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    # -- running -------------------------------------------------------------------------------------
    def run(self, batch, extra: dict, previous: torch.Tensor | None = None,
            linear=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Replay the step's graph. `extra` holds more host parts for the step's one upload (the sampler's
        columns, the rows to fill from `previous`, the in-flight step's sampled ids); `linear` is a hybrid
        model's plan of the step's state slots. Returns logits `[n, vocab]` (a view of the graph's output: read
        it before the next replay) and the uploaded device parts."""
        n = len(batch)
        bucket = self.bucket(n)
        host = layout_step(batch, self.page_size, pad_to=bucket)
        if not self._warm:
            self.warmup()
        parts = {name: host.parts[name] for name in ("ids", "pos", "slots", "ctx", "tables")}
        if linear is not None:
            if linear.restores or linear.chunks:
                raise AssertionError("a decode step restores no snapshot and runs no chunk")
            linear_parts = linear.parts()
            linear_parts["lin_slots"] = np.pad(linear_parts["lin_slots"], (0, bucket - n),
                                               constant_values=self.linear.scratch)
            if "lin_snaps" in linear_parts:
                linear_parts["lin_snaps"] = np.pad(linear_parts["lin_snaps"], (0, bucket - n), constant_values=-1)
            parts.update(linear_parts)
        dev = upload({**parts, **extra}, self.device)
        self.block_tables[:n, :host.width].copy_(dev["tables"].view(n, host.width))
        self.ids[:bucket].copy_(dev["ids"])
        fill_placeholders(self.ids, dev, previous)
        fill = {self.pos: dev["pos"], self.slots: dev["slots"], self.seq_lens: dev["ctx"]}
        if linear is not None:
            linear.dev = dev  # the snapshots taken after the replay read their indices from it
            fill[self.linear_slots] = dev["lin_slots"]
            if "lin_snaps" in dev:
                fill[self.linear_snaps] = dev["lin_snaps"]
        logits = self._replay(bucket, fill)
        return logits[:n], dev

    # -- capturing -----------------------------------------------------------------------------------
    def _capture(self, bucket: int):
        geo = self.geometry
        splits = self.backend.decode_splits(bucket, self.max_model_len, geo.num_kv_heads, geo.head_dim, self.device)
        meta = StepMetadata(
            slot_mapping=self.slots[:bucket], block_tables=self.block_tables[:bucket],
            query_start_loc=self.query_start_loc[:bucket + 1], seq_lens=self.seq_lens[:bucket],
            page_size=self.page_size, max_q_len=1, max_seq_len=self.max_model_len, num_decodes=bucket,
            host_query_start=list(range(bucket)), host_query_lens=[1] * bucket,
            host_seq_lens=[self.max_model_len] * bucket, static=True, decode_splits=splits)
        step = PagedStep(self.backend, self.storage, meta, self.layer_slot)
        ids, pos = self.ids[:bucket][None], self.pos[:bucket][None]
        kwargs = {}
        if self.linear is not None:
            kwargs[LinearStates.KWARG] = self.linear.static_plan(self.linear_slots[:bucket], self.linear_snaps[:bucket])

        def forward() -> torch.Tensor:
            self.backend.prepare(meta)
            with torch.no_grad(), stepping(step):
                out = self.view(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
            return out.logits[0]

        # All rows padding while warming up and capturing: nothing is written to or read from the KV pool, and
        # only the scratch state slot.
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        if self.linear is not None:
            self.linear_slots.fill_(self.linear.scratch)
            self.linear_snaps.fill_(-1)
        return self._store(bucket, forward)


def token_buckets(max_tokens_per_step: int) -> tuple[int, ...]:
    """Padded token counts of mixed steps: powers of two from 64 below `max_tokens_per_step`, and it itself."""
    sizes, size = [], 64
    while size < max_tokens_per_step:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (max_tokens_per_step,)


class MixedGraphs(_GraphSet):
    """Graphs for steps that prefill: any mix of decodes and prompt chunks, padded to a token bucket.

    Eager, such a step is host-bound: its forward spends longer launching kernels than running them
    (benchmarks/profile_engine.py), and in training many of the engine's steps are of this kind, because some
    rollout is always starting a turn.

    A bucket's graph runs the forward over `bucket` tokens and `seqs = min(max_num_seqs, bucket)` sequences:
    token rows past the step's are padding (slot -1, never attended), sequence rows past the step's have no
    query and no context. Attention cannot take its launch grids from the step, so the decode kernel runs
    over every sequence row and keeps those with one query token, and the prefill kernel runs the rows of a
    tile table the host lists per step (`step_layout.tile_table`). The lm_head runs on `seqs` rows gathered by a
    static index (the step's sampled rows, then row 0 as padding). The first step that prefills captures every
    bucket, largest first, as the first decode step does: in training a capture waits for the trainer's work
    beside it, and later steps of a run pay none. A bucket dropped since (`invalidate`) is captured again on its
    next use."""

    def __init__(self, parts: ForwardParts, max_num_seqs: int, max_tokens_per_step: int, capture=None,
                 exclusive=contextlib.nullcontext):
        super().__init__(parts, capture, exclusive)
        geo = self.geometry
        self.buckets = token_buckets(max_tokens_per_step)
        self.max_num_seqs = max_num_seqs
        self.tokens_per_tile = self.backend.tokens_per_tile(geo.num_heads, geo.num_kv_heads, geo.head_dim)
        top, device = self.buckets[-1], self.device
        seqs, width = self.seqs(top), -(-self.max_model_len // self.page_size)
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.pos = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(seqs, width, dtype=torch.int32, device=device)
        self.rows = torch.zeros(seqs, dtype=torch.long, device=device)
        self.tiles = torch.full((self.table_rows(top), 2), -1, dtype=torch.long, device=device)

    def seqs(self, bucket: int) -> int:
        return min(self.max_num_seqs, bucket)

    def table_rows(self, bucket: int) -> int:
        """Most tiles a step of `bucket` tokens can have: every chunk has >= 2 tokens and adds <= 1 partial tile."""
        return -(-bucket // self.tokens_per_tile) + min(self.seqs(bucket), bucket // 2)

    def accepts(self, batch) -> bool:
        """Any step within the top bucket: the scheduler's token budget is `max_tokens_per_step`, decodes included."""
        return bool(batch) and sum(i.length for i in batch) <= self.buckets[-1]

    def bucket(self, tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, tokens)]

    def run(self, batch, extra: dict,
            previous: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """As `DecodeGraphs.run`, for a step of any mix."""
        host = layout_step(batch, self.page_size)
        tokens, n, sampled = host.parts["ids"].size, len(batch), host.parts["rows"].size
        bucket = self.bucket(tokens)
        if not self._warm:
            self.warmup()
        seqs, table_rows = self.seqs(bucket), self.table_rows(bucket)
        pad = bucket - tokens
        parts = {
            "ids": np.pad(host.parts["ids"], (0, pad)),
            "pos": np.pad(host.parts["pos"], (0, pad)),
            "slots": np.pad(host.parts["slots"], (0, pad), constant_values=-1),
            "qsl": np.pad(host.parts["qsl"], (0, seqs - n), mode="edge"),
            "ctx": np.pad(host.parts["ctx"], (0, seqs - n)),
            "rows": np.pad(host.parts["rows"], (0, seqs - sampled)),
            "tables": host.parts["tables"],
            "tiles": tile_table(host.lens, host.ctx, self.tokens_per_tile, table_rows).reshape(-1),
        }
        dev = upload({**parts, **extra}, self.device)
        self.block_tables[:n, :host.width].copy_(dev["tables"].view(n, host.width))
        self.ids[:bucket].copy_(dev["ids"])
        fill_placeholders(self.ids, dev, previous)
        logits = self._replay(bucket, {
            self.pos: dev["pos"], self.slots: dev["slots"], self.query_start_loc: dev["qsl"],
            self.seq_lens: dev["ctx"], self.rows: dev["rows"], self.tiles: dev["tiles"].view(table_rows, 2)})
        return logits[:sampled], dev

    def _capture(self, bucket: int):
        geo = self.geometry
        seqs = self.seqs(bucket)
        splits = self.backend.decode_splits(seqs, self.max_model_len, geo.num_kv_heads, geo.head_dim, self.device)
        meta = StepMetadata(
            slot_mapping=self.slots[:bucket], block_tables=self.block_tables[:seqs],
            query_start_loc=self.query_start_loc[:seqs + 1], seq_lens=self.seq_lens[:seqs],
            page_size=self.page_size, max_q_len=bucket, max_seq_len=self.max_model_len, num_decodes=0,
            host_query_start=[], host_query_lens=[], host_seq_lens=[], static=True, decode_splits=splits,
            tile_table=self.tiles[:self.table_rows(bucket)])
        step = PagedStep(self.backend, self.storage, meta, self.layer_slot)
        ids, pos, rows = self.ids[:bucket][None], self.pos[:bucket][None], self.rows[:seqs]

        def forward() -> torch.Tensor:
            self.backend.prepare(meta)
            with torch.no_grad(), stepping(step):
                out = self.view(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=rows)
            return out.logits[0]

        # Nothing to do while warming up and capturing: no slot written, no query, no tile, and the lm_head's
        # rows inside this bucket (the last step's may lie past it).
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        self.query_start_loc.zero_()
        self.tiles.fill_(-1)
        self.rows.zero_()
        return self._store(bucket, forward)
