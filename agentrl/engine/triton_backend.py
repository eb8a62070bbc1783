"""The Triton paged-attention kernels behind the engine's `AttentionBackend` interface (the default on CUDA).

Importing this module imports triton; `backends.make_backend` does so only on CUDA (or when "triton" is asked
for by name: tests run it on CPU under the Triton interpreter). Every call reads the step's device tensors and
static host hints only (decodes first, `num_decodes`, `max_q_len`, `max_seq_len`, a pinned split count), so
nothing here syncs with the host and a CUDA graph can capture a whole decode forward.
"""

from __future__ import annotations

import torch

from agentrl.engine import triton_attention as kernels
from agentrl.engine.attention import AttentionBackend


class TritonPagedAttention(AttentionBackend):
    supports_graphs = True

    def prepare(self, meta):
        # The graphs' static block tables are int32; eager steps upload int64. One dtype means one compiled
        # variant of each kernel, and the graph captures compile it before the first eager step needs it.
        if meta.block_tables.dtype != torch.int32:
            meta.block_tables = meta.block_tables.int()

    def write_kv(self, key_cache, value_cache, key, value, meta):
        kernels.write_kv(key, value, key_cache, value_cache, meta.slot_mapping)  # slot -1 (padding) is skipped

    def attend(self, key_cache, value_cache, query, meta, scaling):
        return kernels.paged_attention(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scaling,
            max_q_len=meta.max_q_len, max_seq_len=meta.max_seq_len, num_decodes=meta.num_decodes,
            num_splits=meta.decode_splits, tile_table=meta.tile_table)

    def tokens_per_tile(self, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
        return kernels.tokens_per_tile(num_heads, num_kv_heads, head_dim)

    def decode_splits(self, num_seqs: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                      device: torch.device) -> int:
        block_n = kernels.decode_config(head_dim)["block_n"]
        return kernels.choose_num_splits(num_seqs, num_kv_heads, max_seq_len, block_n, kernels._num_sms(device))

