"""Paged attention: the backend interface, the torch reference backend, and the function transformers calls.

Every forward step packs all scheduled tokens of all sequences into one row `[1, T]`. Per step the engine
builds one `StepMetadata` (slot of every new token, each sequence's query span, context length and block
table); every attention layer then does two things through the backend:

    write_kv(k_cache, v_cache, key, value, meta)     new K/V go to their slots
    attend(k_cache, v_cache, query, meta, scaling)   each query attends over its sequence's pages

That pair is the whole interface, so the Triton kernels (`triton_backend.py`, the default on CUDA) replace
`TorchPagedAttention` without touching the model view or the scheduler, and a CUDA graph captured around a
fixed-shape decode batch (`cuda_graphs.py`) replays them. `prepare(meta)` runs once per step for whatever
the backend wants to precompute (here: gather indices and masks), so layers do no host work.

Layout: a layer's caches are `[num_pages, page_size, num_kv_heads, head_dim]` (views into KVStorage,
last dim contiguous); `key`/`value` are `[T, num_kv_heads, head_dim]` and `query` `[T, num_heads,
head_dim]` after RoPE; `attend` returns `[T, num_heads, head_dim]`. Query row j of sequence s sits at
position `seq_lens[s] - query_len[s] + j` and sees every cached position up to its own.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "agentrl_paged"
_current = threading.local()


@dataclass
class StepMetadata:
    """One forward step's layout, shared by every layer. Sequences with a single query token (decodes) come
    first: the scheduler orders them so, and `num_decodes` counts them, so a backend can split the step
    into a decode launch and a prefill launch without looking at tensor contents (no host sync).

    A `static` step is the metadata a CUDA graph was captured with: every row is one decode, the tensors are
    fixed buffers refilled before each replay, and the host fields describe shapes and bounds only
    (`host_seq_lens` holds the bound `max_seq_len`); `decode_splits` pins the decode kernel's split-K count,
    which a replay cannot change."""

    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset of each new token (-1: write nothing)
    block_tables: torch.Tensor  # [B, max_pages] int64 / int32, padded (never read past a sequence's end)
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length once this step's tokens are written (0: padding row)
    page_size: int
    max_q_len: int
    max_seq_len: int
    num_decodes: int
    host_query_start: list[int]  # the same layout on the host, for backends that plan there
    host_query_lens: list[int]
    host_seq_lens: list[int]
    plan: object = field(default=None, repr=False)  # backend-specific, built by prepare()
    static: bool = False
    decode_splits: int | None = None
    tile_table: torch.Tensor | None = None  # a captured mixed step's prefill tiles (see `tile_table`)

    @property
    def num_seqs(self) -> int:
        return len(self.host_query_lens)


@dataclass
class HostStep:
    """A step's layout on the host, as int64 arrays waiting for their one copy to the device."""

    parts: dict[str, np.ndarray]
    starts: list[int]
    lens: list[int]
    ctx: list[int]
    width: int  # block-table columns: the most pages any sequence of the step holds
    num_decodes: int


def _chunk_slots(pages: list[int], start: int, n: int, page_size: int) -> list[int]:
    """Slots of positions [start, start + n): one range per page touched, not one Python step per token."""
    out: list[int] = []
    p, end = start, start + n
    while p < end:
        page = p // page_size
        stop = min((page + 1) * page_size, end)
        shift = pages[page] * page_size - page * page_size
        out += range(p + shift, stop + shift)
        p = stop
    return out


def layout_step(batch, page_size: int, pad_to: int | None = None) -> HostStep:
    """Host layout of the scheduled chunks. `pad_to` (a pure-decode step for a captured graph) pads the
    per-token and per-sequence parts to that many rows: token 0 at position 0, slot -1 (no KV write),
    context length 0 (nothing attended).

    Per-sequence work is comprehensions and per-chunk work is ranges per page: a 512-sequence decode step
    was measured at ~1 ms of host time this way, per-token Python loops cost several."""
    ps = page_size
    seqs = [item.seq for item in batch]
    first = [item.start for item in batch]
    lens = [item.length for item in batch]
    nd = next((i for i, n in enumerate(lens) if n != 1), len(lens))
    ids = [seq.tokens[s] for seq, s in zip(seqs[:nd], first)]
    pos = first[:nd]
    slots = [seq.pages[s // ps] * ps + s % ps for seq, s in zip(seqs[:nd], first)]
    for seq, s, n in zip(seqs[nd:], first[nd:], lens[nd:]):
        ids += seq.tokens[s:s + n]
        pos += range(s, s + n)
        slots += _chunk_slots(seq.pages, s, n, ps)
    ctx = [s + n for s, n in zip(first, lens)]
    ends = list(itertools.accumulate(lens))
    rows = [e - 1 for e, c, seq in zip(ends, ctx, seqs) if c == len(seq.tokens)]  # chunks that end their sequence
    num_pages = [len(seq.pages) for seq in seqs]
    width = max(num_pages)
    tables = np.zeros((len(seqs), width), dtype=np.int64)
    tables[np.arange(width)[None, :] < np.array(num_pages)[:, None]] = np.fromiter(
        itertools.chain.from_iterable(seq.pages for seq in seqs), dtype=np.int64, count=sum(num_pages))
    starts = [e - n for e, n in zip(ends, lens)]
    if pad_to is not None:
        extra = pad_to - len(batch)
        ids, pos, slots, ctx = ids + [0] * extra, pos + [0] * extra, slots + [-1] * extra, ctx + [0] * extra
    parts = {name: np.array(v, dtype=np.int64) for name, v in
             (("ids", ids), ("pos", pos), ("slots", slots), ("qsl", [0] + ends), ("ctx", ctx), ("rows", rows))}
    parts["tables"] = tables.reshape(-1)
    return HostStep(parts, starts, lens, ctx[:len(batch)], width, nd)


def tile_table(lens, ctx, tokens_per_tile: int, capacity: int) -> np.ndarray:
    """The prefill kernel's work list for a mixed step of fixed grid: one row (sequence, tile) per tile of
    `tokens_per_tile` query tokens of every sequence with more than one query token (those of one token go to
    the decode kernel), tiles that see the most keys first (they take longest, so starting them first evens
    the tail), then rows (-1, 0) up to `capacity`."""
    lens, ctx = np.asarray(lens, dtype=np.int64), np.asarray(ctx, dtype=np.int64)
    chunks = np.flatnonzero(lens > 1)
    count = -(-lens[chunks] // tokens_per_tile)
    seq = np.repeat(chunks, count)
    tile = np.arange(seq.size) - np.repeat(np.cumsum(count) - count, count)
    keys = ctx[seq] - lens[seq] + np.minimum((tile + 1) * tokens_per_tile, lens[seq])
    order = np.argsort(-keys, kind="stable")
    if seq.size > capacity:
        raise ValueError(f"{seq.size} prefill tiles exceed the table's {capacity} rows")
    table = np.full((capacity, 2), -1, dtype=np.int64)
    table[:, 1] = 0
    table[:seq.size, 0], table[:seq.size, 1] = seq[order], tile[order]
    return table


def upload(parts: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Every part in one (pinned, on CUDA) host buffer and one copy; returns the device views by name.

    Each part starts on a 16-byte boundary: Triton specialises a kernel on the alignment of its pointer
    arguments, so parts at odd int64 offsets (which move with the step's sizes) would compile extra variants of
    every kernel they reach, in the middle of a run."""
    sizes = [a.size for a in parts.values()]
    starts = np.cumsum([0] + [n + (n & 1) for n in sizes])
    flat = np.zeros(int(starts[-1]), dtype=np.int64)
    for start, a in zip(starts, parts.values()):
        flat[start:start + a.size] = a.reshape(-1)
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    return {name: dev[start:start + n] for name, start, n in zip(parts, starts.tolist(), sizes)}


def step_inputs(host: HostStep, dev: dict[str, torch.Tensor], page_size: int):
    """`(input_ids [1, T], position_ids [1, T], logits_rows [N], meta)` from an uploaded eager step."""
    meta = StepMetadata(
        slot_mapping=dev["slots"], block_tables=dev["tables"].view(len(host.lens), host.width),
        query_start_loc=dev["qsl"].int(), seq_lens=dev["ctx"].int(), page_size=page_size,
        max_q_len=max(host.lens), max_seq_len=max(host.ctx), num_decodes=host.num_decodes,
        host_query_start=host.starts, host_query_lens=host.lens, host_seq_lens=host.ctx,
    )
    return dev["ids"][None], dev["pos"][None], dev["rows"], meta


def pack_step(batch, page_size: int, device: torch.device):
    """Pack the scheduled chunks into one row: `(input_ids [1, T], position_ids [1, T], logits_rows [N], meta)`.
    `logits_rows` are the rows whose next token is sampled (last token of each chunk that ends its sequence).
    Everything crosses to the device in one copy of one (pinned, on CUDA) host buffer."""
    host = layout_step(batch, page_size)
    return step_inputs(host, upload(host.parts, device), page_size)


class AttentionBackend:
    # True when prepare/write_kv/attend of a static step issue only device work with no host sync, so a CUDA
    # graph can capture them.
    supports_graphs = False

    def prepare(self, meta: StepMetadata) -> None:
        pass

    def decode_splits(self, num_seqs: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                      device: torch.device) -> int | None:
        """The split-K count a decode launch of this shape would choose (None: the backend has no such knob).
        A captured graph pins the count chosen for its bucket at the longest context."""
        return None

    def tokens_per_tile(self, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
        """Query tokens per row of a mixed step's tile table (the reference backend reads the layout itself, so
        any tiling serves it)."""
        return 64

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 meta: StepMetadata) -> None:
        raise NotImplementedError

    def attend(self, key_cache: torch.Tensor, value_cache: torch.Tensor, query: torch.Tensor, meta: StepMetadata,
               scaling: float) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class _TorchPlan:
    decode_rows: torch.Tensor | None  # [Bd] rows of single-token sequences
    decode_slots: torch.Tensor | None  # [Bd, Kmax] slots of their context, 0 past the end
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Kmax]
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (row, n, slots [L], mask [n, L] or None)


class TorchPagedAttention(AttentionBackend):
    """Reference paged attention on plain torch ops: exact, and slow only where gathers are (CPU tests).

    Single-token sequences (decode) are attended as one padded batch; each multi-token chunk (prefill)
    on its own with a causal mask offset by the context already cached.
    """

    def prepare(self, meta: StepMetadata) -> None:
        if meta.static and meta.tile_table is not None:
            # A mixed step's layout is in its tensors only: read it back (a sync, fine for this CPU check path).
            qsl, ctx = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
            lens = [b - a for a, b in zip(qsl, qsl[1:])]
            live = [i for i, n in enumerate(lens) if n]
            host = replace(meta, host_query_start=[qsl[i] for i in live], host_query_lens=[lens[i] for i in live],
                           host_seq_lens=[ctx[i] for i in live], block_tables=meta.block_tables[live],
                           static=False, tile_table=None)
            self.prepare(host)
            meta.plan = host.plan
            return
        if meta.static:
            meta.plan = self._static_plan(meta)
            return
        device, ps = meta.slot_mapping.device, meta.page_size
        decode = [i for i, n in enumerate(meta.host_query_lens) if n == 1]
        plan = _TorchPlan(None, None, None, [])
        if decode:
            rows = torch.tensor([meta.host_query_start[i] for i in decode], dtype=torch.long)
            lens = torch.tensor([meta.host_seq_lens[i] for i in decode], dtype=torch.long)
            kmax = max(meta.host_seq_lens[i] for i in decode)
            tables = meta.block_tables[torch.tensor(decode, dtype=torch.long, device=device)]
            pos = torch.arange(kmax, device=device)
            slots = tables[:, pos // ps] * ps + pos % ps
            valid = pos[None, :] < lens.to(device)[:, None]
            plan.decode_rows = rows.to(device)
            plan.decode_slots = slots.masked_fill(~valid, 0)
            plan.decode_mask = valid[:, None, None, :]
        for i, n in enumerate(meta.host_query_lens):
            if n == 1:
                continue
            length = meta.host_seq_lens[i]
            pos = torch.arange(length, device=device)
            slots = meta.block_tables[i, pos // ps] * ps + pos % ps
            mask = None
            if length != n:  # a chunk after cached context: row r sees keys up to length - n + r
                q_pos = torch.arange(length - n, length, device=device)
                mask = pos[None, :] <= q_pos[:, None]
            plan.prefills.append((meta.host_query_start[i], n, slots, mask))
        meta.plan = plan

    @staticmethod
    def _static_plan(meta: StepMetadata) -> _TorchPlan:
        """A static (graph) step from its tensors alone: every row decodes over the block table's full width,
        masked by `seq_lens`. Padding rows (length 0) see slot 0 of their stale first page, so they stay
        finite; their outputs are never used. Slow (the whole width is gathered): for checking the graph
        logic on CPU, while CUDA graphs use a backend with `supports_graphs`."""
        ps, tables, lens = meta.page_size, meta.block_tables, meta.seq_lens
        pos = torch.arange(tables.shape[1] * ps, device=tables.device)
        slots = tables[:, pos // ps].long() * ps + pos % ps
        valid = (pos[None, :] < lens[:, None]) | ((lens[:, None] == 0) & (pos[None, :] == 0))
        rows = torch.arange(tables.shape[0], device=tables.device)
        return _TorchPlan(rows, slots.masked_fill(~valid, 0), valid[:, None, None, :], [])

    def write_kv(self, key_cache, value_cache, key, value, meta):
        flat_k = key_cache.view(-1, *key_cache.shape[2:])
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        slots = meta.slot_mapping
        if meta.static:  # padding rows carry slot -1 (the boolean index syncs: fine for this CPU check path)
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        flat_k.index_copy_(0, slots, key.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, value.to(flat_v.dtype))

    def attend(self, key_cache, value_cache, query, meta, scaling):
        plan: _TorchPlan = meta.plan
        flat_k = key_cache.view(-1, *key_cache.shape[2:])  # [slots, Hkv, D]
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        gqa = query.shape[1] != flat_k.shape[1]
        out = torch.empty_like(query)
        if plan.decode_rows is not None:
            q = query[plan.decode_rows].unsqueeze(2)  # [Bd, Hq, 1, D]
            k = flat_k[plan.decode_slots].transpose(1, 2)  # [Bd, Hkv, Kmax, D]
            v = flat_v[plan.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=plan.decode_mask,
                                               scale=scaling, enable_gqa=gqa)
            out[plan.decode_rows] = o.squeeze(2)
        for row, n, slots, mask in plan.prefills:
            q = query[row:row + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            k = flat_k[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            v = flat_v[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                               enable_gqa=gqa)
            out[row:row + n] = o[0].transpose(0, 1)
        return out


BACKENDS = {"torch": TorchPagedAttention}  # "triton" registers itself when agentrl.engine.triton_backend is imported


def make_backend(name: str, device: torch.device, page_size: int) -> AttentionBackend:
    """The backend called `name`; "auto" is Triton on CUDA (if triton imports and pages are a power of two,
    as its kernels require), else the torch reference."""
    if name == "auto":
        name = "torch"
        if device.type == "cuda" and page_size & (page_size - 1) == 0:
            try:
                import agentrl.engine.triton_backend  # noqa: F401  (registers "triton")
                name = "triton"
            except ImportError:
                pass
    elif name == "triton":
        if page_size & (page_size - 1):
            raise ValueError(f"the triton backend needs a power-of-two page_size, got {page_size}")
        import agentrl.engine.triton_backend  # noqa: F401
    if name not in BACKENDS:
        raise ValueError(f"attention_backend {name!r}: one of {sorted(set(BACKENDS) | {'auto', 'triton'})}")
    return BACKENDS[name]()


class PagedStep:
    """What one forward step hands to every attention layer (through `stepping`)."""

    def __init__(self, backend: AttentionBackend, storage, meta: StepMetadata, layer_slot: dict[int, int]):
        self.backend, self.storage, self.meta, self.layer_slot = backend, storage, meta, layer_slot

    def attention(self, module, query, key, value, scaling):
        layer = self.layer_slot[module.layer_idx]
        k_cache, v_cache = self.storage.key_cache(layer), self.storage.value_cache(layer)
        # [1, H, T, D] -> [T, H, D]: the packed step is one row, so drop it
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        self.backend.write_kv(k_cache, v_cache, k, v, self.meta)
        out = self.backend.attend(k_cache, v_cache, q, self.meta, scaling)
        return out.unsqueeze(0), None  # [1, T, Hq, D], as transformers' attention functions return


@contextlib.contextmanager
def stepping(step: PagedStep):
    """Make `step` what every paged attention layer of forwards on this thread reads.

    The step travels beside the forward rather than through its kwargs so that compiled decoder layers never see
    it: a new object every step would be a new guard, and a recompile, every step."""
    previous = getattr(_current, "step", None)
    _current.step = step
    try:
        yield step
    finally:
        _current.step = previous


def current_step() -> PagedStep | None:
    return getattr(_current, "step", None)


@torch.compiler.disable  # a compiled decoder layer breaks its graph here and calls the kernels eagerly
def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step = current_step()
    if step is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} was called outside `attention.stepping(...)`: only "
            "the engine's model view should use it"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return step.attention(module, query, key, value, scaling)


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
