"""Paged attention: the backend interface, the torch reference backend, and the function transformers calls.

Every forward step packs all scheduled tokens of all sequences into one row `[1, T]`. Per step the engine
builds one `StepMetadata` (slot of every new token, each sequence's query span, context length and block
table); every attention layer then does two things through the backend:

    write_kv(k_cache, v_cache, key, value, meta)     new K/V go to their slots
    attend(k_cache, v_cache, query, meta, scaling)   each query attends over its sequence's pages

That pair is the whole interface, so a Triton kernel (or a CUDA graph captured around a fixed-shape
decode batch) replaces `TorchPagedAttention` without touching the model view or the scheduler.
`prepare(meta)` runs once per step for whatever the backend wants to precompute (here: gather indices and
masks), so layers do no host work.

Layout: a layer's caches are `[num_pages, page_size, num_kv_heads, head_dim]` (views into KVStorage,
last dim contiguous); `key`/`value` are `[T, num_kv_heads, head_dim]` and `query` `[T, num_heads,
head_dim]` after RoPE; `attend` returns `[T, num_heads, head_dim]`. Query row j of sequence s sits at
position `seq_lens[s] - query_len[s] + j` and sees every cached position up to its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "agentrl_paged"
STEP_KWARG = "agentrl_step"


@dataclass
class StepMetadata:
    """One forward step's layout, shared by every layer. Sequences with a single query token (decodes) come
    first: the scheduler orders them so, and `num_decodes` counts them, so a backend can split the step
    into a decode launch and a prefill launch without looking at tensor contents (no host sync)."""

    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset of each new token
    block_tables: torch.Tensor  # [B, max_pages] int64, padded with 0 (never read past a sequence's end)
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length once this step's tokens are written
    page_size: int
    max_q_len: int
    max_seq_len: int
    num_decodes: int
    host_query_start: list[int]  # the same layout on the host, for backends that plan there
    host_query_lens: list[int]
    host_seq_lens: list[int]
    plan: object = field(default=None, repr=False)  # backend-specific, built by prepare()

    @property
    def num_seqs(self) -> int:
        return len(self.host_query_lens)


def pack_step(batch, page_size: int, device: torch.device):
    """Pack the scheduled chunks into one row: `(input_ids [1, T], position_ids [1, T], logits_rows [N], meta)`.
    `logits_rows` are the rows whose next token is sampled (last token of each chunk that ends its sequence).
    Everything crosses to the device in one copy of one (pinned, on CUDA) host buffer."""
    ids, pos, slots, starts, lens, ctx, rows = [], [], [], [], [], [], []
    for item in batch:
        seq, s, n = item.seq, item.start, item.length
        starts.append(len(ids))
        lens.append(n)
        ctx.append(s + n)
        ids += seq.tokens[s:s + n]
        pos += range(s, s + n)
        slots += [seq.pages[p // page_size] * page_size + p % page_size for p in range(s, s + n)]
        if item.samples:
            rows.append(len(ids) - 1)
    width = max(len(item.seq.pages) for item in batch)
    tables = [p for item in batch for p in item.seq.pages + [0] * (width - len(item.seq.pages))]
    num_decodes = next((i for i, n in enumerate(lens) if n != 1), len(lens))
    parts = [ids, pos, slots, starts + [len(ids)], ctx, rows, tables]
    host = torch.tensor([x for part in parts for x in part], dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    ids_t, pos_t, slots_t, qsl, ctx_t, rows_t, tables_t = host.to(device, non_blocking=True).split(
        [len(part) for part in parts])
    meta = StepMetadata(
        slot_mapping=slots_t, block_tables=tables_t.view(len(batch), width), query_start_loc=qsl.int(),
        seq_lens=ctx_t.int(), page_size=page_size, max_q_len=max(lens), max_seq_len=max(ctx),
        num_decodes=num_decodes, host_query_start=starts, host_query_lens=lens, host_seq_lens=ctx,
    )
    return ids_t[None], pos_t[None], rows_t, meta


class AttentionBackend:
    def prepare(self, meta: StepMetadata) -> None:
        pass

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

    def write_kv(self, key_cache, value_cache, key, value, meta):
        flat_k = key_cache.view(-1, *key_cache.shape[2:])
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        flat_k.index_copy_(0, meta.slot_mapping, key.to(flat_k.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, value.to(flat_v.dtype))

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


BACKENDS = {"torch": TorchPagedAttention}


class PagedStep:
    """What one forward step hands to every attention layer (through the `agentrl_step` kwarg)."""

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


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} was called without the {STEP_KWARG!r} kwarg: "
            "only the engine's model view should use it, and this model does not pass attention kwargs through"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return step.attention(module, query, key, value, scaling)


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
