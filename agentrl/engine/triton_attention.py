"""Paged attention on the GPU: Triton kernels behind the engine's attention interface.

Layout contract (shared with the torch reference at the bottom of this file):
- KV cache of one layer: `k_cache`, `v_cache` `[num_pages, page_size, num_kv_heads, head_dim]` (bf16 / fp16 /
  fp32; last dim contiguous), `page_size` a power of two (16 by default).
- A step's ragged batch is flattened: `q` `[total_q, num_heads, head_dim]` (last dim contiguous);
  `query_start_loc` int32 `[num_seqs + 1]` cumulative query lengths; `seq_lens` int32 `[num_seqs]` KV length of
  each sequence AFTER this step's tokens were written; `block_tables` int32/int64 `[num_seqs, max_pages]` page
  ids (entries past a sequence's last page are never read, so any padding value works).
- Query token j of sequence s (0 <= j < q_len) sits at position `seq_lens[s] - q_len + j` and attends to KV
  positions <= that. GQA: head h reads kv head `h // (num_heads // num_kv_heads)`.
- `write_kv` takes `slot_mapping` int64 `[total_q]` = page * page_size + offset; a negative slot is skipped.

Nothing here syncs with the host, so every launcher can be captured in a CUDA graph: launch grids come from
tensor shapes and static host hints (`max_q_len`, `max_seq_len`, `num_decodes`), never from tensor contents.
Kernels: decode (one program per sequence x kv head x context split, all query heads of the kv head in one
tile), a combine for the splits, a tiled causal kernel for prefill / chunked prefill, and a fused K+V scatter.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# A finite "minus infinity" for running maxima: exp2(m_old - m_new) stays 0 or 1 (never NaN) even when a
# whole tile is masked or a split of the context is empty.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, n0, kv_limit, pos, bt_row, k_base, v_base, stride_kp, stride_kt, stride_vp,
                 stride_vt, scale_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASK_KV: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over KV positions [n0, n0 + BLOCK_N), which may span several pages.

    The tile gathers its page ids itself (one per position; repeats hit L1), so a tile of BLOCK_N positions
    reads BLOCK_N / PAGE_SIZE pages in one go: wide enough loads to keep HBM busy with 16-token pages.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_ok = offs_n < kv_limit
    if MASK_KV:
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=kv_ok, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    k_ptrs = k_base + page[None, :] * stride_kp + in_page[None, :] * stride_kt + offs_d[:, None]
    v_ptrs = v_base + page[:, None] * stride_vp + in_page[:, None] * stride_vt + offs_d[None, :]
    if MASK_KV or HEAD_DIM != BLOCK_D:
        k_t = tl.load(k_ptrs, mask=kv_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)  # [D, N]
        v = tl.load(v_ptrs, mask=kv_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # [N, D]
    else:
        k_t = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2  # [M, N], log2 domain
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
    elif MASK_KV:
        s = tl.where(kv_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out_ptr, part_acc, part_m,
                   part_l, scale_log2,
                   stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_bt,
                   stride_ot, stride_oh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, ONLY_Q1: tl.constexpr):
    """One program = one sequence x one kv head x one slice of its context (split-K).

    All GROUP query heads that share the kv head ride in the rows of one dot, so each K/V byte is read once per
    kv head. Rows are padded to GROUP_PAD >= 16 because tensor-core dots need M >= 16; the padding costs
    arithmetic, not memory traffic, and decode is bound by memory traffic.
    ONLY_Q1: the grid covers every sequence of a mixed step and only those with one query token run (a captured
    mixed step cannot know on the host which sequences those are). Skipping the others saves their reads; their
    rows belong to the prefill kernel, launched after this one.
    """
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if ONLY_Q1:
        if tl.load(query_start_loc + seq + 1) - tl.load(query_start_loc + seq) != 1:
            return
    seq_len = tl.load(seq_lens + seq)
    q_row = tl.load(query_start_loc + seq).to(tl.int64)  # row of the sequence's single query token
    # Splits are cut on tile boundaries so only the last tile of a sequence needs masks.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N

    rows = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + rows
    row_ok = rows < GROUP
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(k_cache.dtype.element_ty)
    m_i = tl.full([GROUP_PAD], _NEG_BIG, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    k_base = k_cache + kvh * stride_kh
    v_base = v_cache + kvh * stride_vh
    for n0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n0, end, rows, bt_row, k_base, v_base, stride_kp, stride_kt,
                                     stride_vp, stride_vt, scale_log2, HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N,
                                     False, False, DOT_PRECISION)
    if full_end < end:
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, full_end, end, rows, bt_row, k_base, v_base, stride_kp,
                                     stride_kt, stride_vp, stride_vt, scale_log2, HEAD_DIM, BLOCK_D, PAGE_SIZE,
                                     BLOCK_N, True, False, DOT_PRECISION)
    store_ok = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        # l_i is 0 only for an empty sequence (a padding row of a captured batch): write zeros, not NaN.
        o = acc / tl.maximum(l_i, 1e-30)[:, None]
        o_ptrs = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=store_ok)
    else:
        # Partials [seq, head, split, ...] stay unnormalised; the combine kernel rescales them by their maxima.
        base = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(part_acc + base[:, None] * BLOCK_D + offs_d[None, :], acc, mask=store_ok)
        tl.store(part_m + base, m_i, mask=row_ok)
        tl.store(part_l + base, l_i, mask=row_ok)


@triton.jit
def _combine_splits_kernel(part_acc, part_m, part_l, query_start_loc, out_ptr, stride_ot, stride_oh,
                           NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           ONLY_Q1: tl.constexpr):
    """Merge the split-K partials of one (sequence, head): rescale each by exp2(m_split - m_max), sum, divide."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if ONLY_Q1:  # as in the decode kernel: rows of longer queries belong to the prefill kernel
        if tl.load(query_start_loc + seq + 1) - tl.load(query_start_loc + seq) != 1:
            return
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(part_m + base + offs_s)
    l_s = tl.load(part_l + base + offs_s)
    acc = tl.load(part_acc + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :])
    w = tl.math.exp2(m - tl.max(m, 0))  # empty splits carry m = -1e30 and l = 0, so they weigh nothing
    o = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(l_s * w, 0), 1e-30)
    q_row = tl.load(query_start_loc + seq).to(tl.int64)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["seq_offset"])
def _prefill_kernel(q_ptr, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out_ptr, scale_log2, seq_offset,
                    tile_table, stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                    stride_bt, stride_ot, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, TABLE: tl.constexpr):
    """One program = one tile of query tokens of one sequence x one kv head (tiled, online softmax).

    Row r of the tile is query token r // GROUP under head r % GROUP of this kv head: the GROUP heads that
    share K/V are packed into one tile, so each K/V tile is loaded once for all of them. Works for any mix of
    q_len >= 1 (decode rows, whole prompts, chunks after a cached prefix).

    Which tile: without TABLE the grid is (tiles of the longest query, sequences, kv heads). With TABLE the
    grid is (rows of `tile_table`, kv heads) and row i of the int64 table `[n, 2]` names (sequence, tile), or
    sequence -1 for no work: a captured mixed step has a fixed grid, and the host lists each step's tiles
    (most keys first) into it.
    """
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    if TABLE:
        seq = tl.load(tile_table + 2 * tl.program_id(0))
        tile = tl.load(tile_table + 2 * tl.program_id(0) + 1)
        kvh = tl.program_id(1)
        if seq < 0:
            return
    else:
        # Last tiles first: under the causal mask they see the most keys, so starting them early evens the tail.
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = tl.program_id(1) + seq_offset  # prefills follow the step's decodes
        kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    tok0 = tile * TOKENS
    if tok0 >= q_len:  # the grid is sized by the static max_q_len; shorter sequences leave early
        return
    seq_len = tl.load(seq_lens + seq)
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tok0 + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < q_len)
    d_ok = offs_d < HEAD_DIM
    pos = prefix + tok
    tok_abs = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok_abs[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(k_cache.dtype.element_ty)
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    k_base = k_cache + kvh * stride_kh
    v_base = v_cache + kvh * stride_vh
    # Positions every row of the tile may see need no mask; only the tiles crossing the diagonal do.
    first_pos = prefix + tok0
    last_pos = prefix + tl.minimum(tok0 + TOKENS, q_len) - 1
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n0, seq_len, pos, bt_row, k_base, v_base, stride_kp,
                                     stride_kt, stride_vp, stride_vt, scale_log2, HEAD_DIM, BLOCK_D, PAGE_SIZE,
                                     BLOCK_N, False, False, DOT_PRECISION)
    for n0 in range(full_end, last_pos + 1, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n0, last_pos + 1, pos, bt_row, k_base, v_base, stride_kp,
                                     stride_kt, stride_vp, stride_vt, scale_log2, HEAD_DIM, BLOCK_D, PAGE_SIZE,
                                     BLOCK_N, True, True, DOT_PRECISION)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + tok_abs[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_mapping, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """One program = one new token: its K and V for every kv head go to its slot in one launch."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:  # padding tokens of a captured batch, or tokens whose KV is not kept
        return
    page, in_page = slot // PAGE_SIZE, slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=ok)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=ok)
    kc = k_cache + page * stride_kcp + in_page * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = v_cache + page * stride_vcp + in_page * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k.to(k_cache.dtype.element_ty), mask=ok)
    tl.store(vc, v.to(v_cache.dtype.element_ty), mask=ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V `[total_q, num_kv_heads, head_dim]` into their slots (negative slot = skip)."""
    total, num_kv_heads, head_dim = k.shape
    if total == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _write_kv_kernel[(total,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_cache.shape[1], num_warps=2 if num_kv_heads * head_dim <= 1024 else 4)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter has no SMs; pretend to be the H200 so the heuristic is exercised
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def decode_config(head_dim: int) -> dict:
    """Decode tiles. 64 positions x 128 dims = 16 KiB each of K and V per tile (four 16-token pages per load).
    Compiled for sm_90 this is 128 registers and ~39 KiB shared memory, so 4 programs fit per SM; with the
    page-id -> K/V load chain the pipeliner fetches page ids two tiles ahead and K/V one tile ahead at 3 stages
    (5 stages double-buffer K/V at ~72 KiB). `benchmarks/attention.py --sweep` measures the alternatives."""
    block_n = 64 if head_dim > 64 else 128
    return {"block_n": block_n, "num_warps": 4, "num_stages": 3}


def prefill_config(head_dim: int) -> dict:
    return {"block_m": 128, "block_n": 64, "num_warps": 8 if head_dim > 64 else 4, "num_stages": 2}


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Split-K only when (sequence, kv head) pairs cannot fill the GPU: aim for ~4 programs per SM (what fits
    in registers and shared memory at the default tiles), keep >= 4 tiles per split so the partials stay a small
    fraction of the traffic. A power of two <= 32."""
    programs = num_seqs * num_kv_heads
    if programs >= 4 * num_sms:
        return 1
    want = triton.cdiv(4 * num_sms, programs)
    most = max(1, triton.cdiv(max_seq_len, block_n) // 4)
    return max(1, min(triton.next_power_of_2(want), 32, 1 << (most.bit_length() - 1)))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 caches: exact products, not tf32


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None,
                    max_q_len: int | None = None, out: torch.Tensor | None = None, *, max_seq_len: int | None = None,
                    num_decodes: int = 0, num_splits: int | None = None, config: dict | None = None,
                    tile_table: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a ragged step over the paged cache; returns `[total_q, num_heads, head_dim]`.

    Static hints (host ints; keep them fixed across replays of a captured graph):
    - `max_q_len`: 1 takes the decode kernel; > 1 the tiled prefill kernel, whose grid has
      cdiv(max_q_len, tokens per tile) tiles per sequence. None: 1 if total_q == num_seqs, else total_q
      (correct, but launches idle programs).
    - `num_decodes`: the first `num_decodes` sequences have q_len 1; with max_q_len > 1 they go to the decode
      kernel and the rest to the prefill kernel (a mixed step ordered decodes-first).
    - `max_seq_len`: bound on seq_lens for the split-K choice (None: the width of `block_tables` in tokens).
    - `num_splits` / `config`: override the heuristics (benchmarks, tests).
    - `tile_table` (a captured mixed step, see `tile_table`): the decode kernel runs over every sequence and
      keeps those of one query token; the prefill kernel runs the table's tiles. `max_q_len` and `num_decodes`
      are then unused, so one graph serves any mix of decodes and chunks that fits its buffers.
    """
    total_q, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    assert num_heads % k_cache.shape[2] == 0 and k_cache.shape[1] & (k_cache.shape[1] - 1) == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    scale = head_dim ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if total_q == 0 or num_seqs == 0:
        return out
    if tile_table is not None:
        max_len = max_seq_len if max_seq_len is not None else block_tables.shape[1] * k_cache.shape[1]
        _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale * _LOG2E, max_len,
                       num_splits, {**decode_config(head_dim), **(config or {})}, only_q1=True)
        _launch_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale * _LOG2E, 0, 0,
                        {**prefill_config(head_dim), **(config or {})}, tile_table=tile_table)
        return out
    if max_q_len is None:
        max_q_len = 1 if total_q == num_seqs else total_q
    if max_q_len == 1:
        num_decodes = num_seqs
    # Per-sequence tensors are sliced; q and out stay whole because query_start_loc indexes them.
    if num_decodes:
        max_len = max_seq_len if max_seq_len is not None else block_tables.shape[1] * k_cache.shape[1]
        _launch_decode(q, k_cache, v_cache, block_tables[:num_decodes], seq_lens[:num_decodes], query_start_loc,
                       out, scale * _LOG2E, max_len, num_splits, {**decode_config(head_dim), **(config or {})})
    if num_decodes < num_seqs:
        # Whole tensors and an offset rather than slices: a slice's address moves with `num_decodes`, and Triton
        # compiles a variant per pointer alignment it meets.
        _launch_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale * _LOG2E, max_q_len,
                        num_decodes, {**prefill_config(head_dim), **(config or {})})
    return out


def _common(q, k_cache, v_cache, block_tables, out):
    head_dim = q.shape[2]
    strides = (*q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
               *out.stride()[:2])
    return strides, dict(HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                         PAGE_SIZE=k_cache.shape[1], DOT_PRECISION=_dot_precision(k_cache.dtype))


def _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale_log2, max_len,
                   num_splits, cfg, only_q1=False):
    num_seqs, num_heads, num_kv_heads = seq_lens.shape[0], q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    strides, common = _common(q, k_cache, v_cache, block_tables, out)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_len, cfg["block_n"], _num_sms(q.device))
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    if num_splits > 1:
        shape = (num_seqs, num_heads, num_splits)
        part_acc = torch.empty((*shape, common["BLOCK_D"]), dtype=torch.float32, device=q.device)
        part_m = torch.empty(shape, dtype=torch.float32, device=q.device)
        part_l = torch.empty(shape, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_m = part_l = out  # not touched with one split
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_acc, part_m, part_l, scale_log2,
        *strides, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg["block_n"],
        NUM_SPLITS=num_splits, ONLY_Q1=only_q1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common)
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_m, part_l, query_start_loc, out, *out.stride()[:2], NUM_SPLITS=num_splits,
            HEAD_DIM=common["HEAD_DIM"], BLOCK_D=common["BLOCK_D"], ONLY_Q1=only_q1, num_warps=4)


def _block_m(cfg: dict, group: int) -> int:
    return max(cfg["block_m"], triton.next_power_of_2(group))  # at least one token per tile


def tokens_per_tile(num_heads: int, num_kv_heads: int, head_dim: int, config: dict | None = None) -> int:
    """Query tokens in one tile of the prefill kernel (its rows hold every head of a kv head's group)."""
    group = num_heads // num_kv_heads
    return _block_m({**prefill_config(head_dim), **(config or {})}, group) // group


def _launch_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale_log2, max_q_len,
                    seq_offset, cfg, tile_table=None):
    num_seqs, group = seq_lens.shape[0] - seq_offset, q.shape[1] // k_cache.shape[2]
    strides, common = _common(q, k_cache, v_cache, block_tables, out)
    block_m = _block_m(cfg, group)
    table = tile_table is not None
    if table:
        grid = (tile_table.shape[0], k_cache.shape[2])
    else:
        grid = (triton.cdiv(max_q_len, block_m // group), num_seqs, k_cache.shape[2])
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale_log2, seq_offset,
        tile_table if table else seq_lens, *strides, GROUP=group, BLOCK_M=block_m, BLOCK_N=cfg["block_n"],
        TABLE=table, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common)


def reference_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                              scale: float | None, max_q_len: int | None = None, out: torch.Tensor | None = None,
                              **_hints) -> torch.Tensor:
    """The same contract in plain torch: gather each sequence's pages, then causal SDPA in fp32.

    Reads `seq_lens` / `query_start_loc` on the host, so it syncs: a CPU path and a test oracle, not for graphs.
    """
    total_q, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, length in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if b == a:
            continue
        if length == 0:
            out[a:b] = 0
            continue
        pages = block_tables[s, :math.ceil(length / page_size)].long()
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:length].float().transpose(0, 1)  # [Hkv, L, D]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:length].float().transpose(0, 1)
        pos = torch.arange(length - (b - a), length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].float().transpose(0, 1), k, v, attn_mask=mask, scale=scale,
            enable_gqa=num_heads != num_kv_heads)
        out[a:b] = o.transpose(0, 1).to(out.dtype)
    return out
