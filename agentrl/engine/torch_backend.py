"""The reference paged-attention backend on plain torch ops: exact on any device, and what CPU runs.

It reads the step's host layout (`StepMetadata.host_*`) to build gather indices and masks once per step in
`prepare`; a static (CUDA-graph) step has only its tensors, so it is planned from them instead, for checking the
graph logic on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from agentrl.engine.attention import AttentionBackend
from agentrl.engine.step_layout import StepMetadata


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
