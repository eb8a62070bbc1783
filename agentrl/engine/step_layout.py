"""A step's inputs: the scheduled chunks laid out on the host, crossing to the device in one copy.

Every forward step packs all scheduled tokens of all sequences into one row `[1, T]`. `layout_step` lays the
chunks out on the host (token ids, positions, KV slots, query spans, context lengths, block tables, the rows whose
next token is sampled) as int64 arrays; `upload` copies them, with whatever else the step sends (the sampler's
columns), to the device in one transfer; `step_inputs` turns the device parts into the model's inputs and the
`StepMetadata` every attention layer reads. A CUDA-graph step (`cuda_graphs.py`) pads the same layout into its
static buffers instead, and a captured mixed step adds the prefill kernel's work list (`tile_table`).
`fill_placeholders` writes the step in flight's sampled ids into the rows that feed on them, on the device.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch


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

    Per-sequence work is comprehensions and per-chunk work is ranges per page: per-token Python loops would
    cost several times the host time of a large decode step."""
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


def fill_placeholders(ids: torch.Tensor, dev: dict, previous: torch.Tensor | None) -> None:
    """Write the in-flight step's sampled ids into the input rows that feed them (device to device, no sync)."""
    rows = dev.get("fill_rows")
    if rows is not None:
        dst, src = rows.view(2, -1)
        ids.index_copy_(0, dst, previous.index_select(0, src))
