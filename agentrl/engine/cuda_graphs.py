"""CUDA graphs for pure-decode steps: one replay instead of a Python walk over every layer.

What a graph holds: the model view's whole forward over a padded decode batch of `bucket` rows, lm_head
included (logits `[bucket, vocab]`). Sampling runs after the replay, eagerly, on the first `n` rows: it is
a few batched ops whose knobs (which truncations run) vary per step. Mixed prefill + decode steps run
eagerly.

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

import torch

from agentrl.engine import attention


def fill_placeholders(ids: torch.Tensor, dev: dict, previous: torch.Tensor | None) -> None:
    """Write the in-flight step's sampled ids into the input rows that feed them (device to device, no sync)."""
    rows = dev.get("fill_rows")
    if rows is not None:
        dst, src = rows.view(2, -1)
        ids.index_copy_(0, dst, previous.index_select(0, src))

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
    """Run `fn` once on a side stream (Triton compiles its kernels and cuBLAS sets up its workspaces, which
    must not happen during capture), then capture one call into a graph in `pool`. Returns `replay()`, which
    replays it and returns the captured call's output (a tensor the replay rewrites in place)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


class DecodeGraphs:
    def __init__(self, view, backend, storage, layer_slot: dict[int, int], geometry, page_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device, capture=None):
        self.view, self.backend, self.storage, self.layer_slot = view, backend, storage, layer_slot
        self.geometry, self.page_size, self.device = geometry, page_size, device
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_num_seqs)
        self._capture_fn = capture or cuda_capture
        top, width = self.buckets[-1], -(-max_model_len // page_size)
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.pos = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(top, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self._tensors = list(view.parameters()) + list(view.buffers())
        self._graphs: dict[int, object] = {}  # bucket -> replay
        self._binding: tuple | None = None
        self._pool = None
        self._warm = False
        self.captures = 0  # graphs captured, re-captures included
        self.replays = 0

    @classmethod
    def for_engine(cls, engine, capture=None) -> "DecodeGraphs":
        return cls(engine.view, engine.backend, engine.storage, engine._layer_slot, engine.geometry,
                   engine.pool.page_size, engine.config.max_num_seqs, engine.max_model_len, engine.device, capture)

    # -- choosing ------------------------------------------------------------------------------------
    def accepts(self, batch) -> bool:
        """A pure-decode step that fits a bucket (decodes come first, so the last item tells)."""
        return bool(batch) and batch[-1].decode and len(batch) <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    # -- running -------------------------------------------------------------------------------------
    def run(self, batch, extra: dict, previous: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Replay the step's graph. `extra` holds more host parts for the step's one upload (the sampler's
        columns, the rows to fill from `previous`, the in-flight step's sampled ids). Returns logits `[n, vocab]`
        (a view of the graph's output: read it before the next replay) and the uploaded device parts."""
        n = len(batch)
        bucket = self.bucket(n)
        host = attention.layout_step(batch, self.page_size, pad_to=bucket)
        self._check_binding()
        if not self._warm:
            self.warmup()
        replay = self._graphs.get(bucket) or self._capture(bucket)
        parts = {name: host.parts[name] for name in ("ids", "pos", "slots", "ctx", "tables")}
        dev = attention.upload({**parts, **extra}, self.device)
        self.ids[:bucket].copy_(dev["ids"])
        fill_placeholders(self.ids, dev, previous)
        self.pos[:bucket].copy_(dev["pos"])
        self.slots[:bucket].copy_(dev["slots"])
        self.seq_lens[:bucket].copy_(dev["ctx"])
        self.block_tables[:n, :host.width].copy_(dev["tables"].view(n, host.width))
        logits = replay()
        self.replays += 1
        return logits[:n], dev

    def warmup(self) -> None:
        """Capture every bucket not captured yet, largest first (the smaller graphs then reuse its scratch
        memory in the shared pool)."""
        self._check_binding()
        for bucket in reversed(self.buckets):
            if bucket not in self._graphs:
                self._capture(bucket)
        self._warm = True

    def invalidate(self) -> None:
        """Drop every graph (and with them their memory pool); the next use captures again."""
        self._graphs.clear()
        self._pool = None

    # -- capturing -----------------------------------------------------------------------------------
    def _check_binding(self) -> None:
        """Graphs hold the addresses of the KV pool and of every parameter and buffer: if one moved (a restored
        pool at a new address, a re-assigned parameter), the graphs would read stale memory."""
        binding = (self.storage.kv.data_ptr(), tuple(t.data_ptr() for t in self._tensors))
        if binding != self._binding:
            if self._graphs:
                self.invalidate()
            self._binding = binding

    def _capture(self, bucket: int):
        geo = self.geometry
        splits = self.backend.decode_splits(bucket, self.max_model_len, geo.num_kv_heads, geo.head_dim, self.device)
        meta = attention.StepMetadata(
            slot_mapping=self.slots[:bucket], block_tables=self.block_tables[:bucket],
            query_start_loc=self.query_start_loc[:bucket + 1], seq_lens=self.seq_lens[:bucket],
            page_size=self.page_size, max_q_len=1, max_seq_len=self.max_model_len, num_decodes=bucket,
            host_query_start=list(range(bucket)), host_query_lens=[1] * bucket,
            host_seq_lens=[self.max_model_len] * bucket, static=True, decode_splits=splits)
        step = attention.PagedStep(self.backend, self.storage, meta, self.layer_slot)
        ids, pos = self.ids[:bucket][None], self.pos[:bucket][None]

        def forward() -> torch.Tensor:
            self.backend.prepare(meta)
            with torch.no_grad(), attention.stepping(step):
                out = self.view(input_ids=ids, position_ids=pos, use_cache=False)
            return out.logits[0]

        # All rows padding while warming up and capturing: nothing is written to or read from the KV pool.
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        if self._pool is None and self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        replay = self._capture_fn(forward, self._pool)
        self._graphs[bucket] = replay
        self.captures += 1
        return replay
