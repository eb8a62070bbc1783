"""The Triton paged-attention kernels against the torch reference, run by Triton's CPU interpreter.

`@triton.jit` picks the interpreter from TRITON_INTERPRET when a kernel is decorated, and triton's own
library functions are decorated when triton is first imported, so interpreting needs the variable set before
triton is imported at all. Rather than set it in this pytest process (where it would reach every other test
module and any triton already imported), `test_kernels_in_interpreter` runs this file again in a child
process with TRITON_INTERPRET=1; there, and only there, the kernel tests run. `TRITON_INTERPRET=1 pytest
tests/engine/test_triton_attention.py` runs them directly.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.children import INTERPRETING, interpreter_child, patch_triton_interpreter, run_in_interpreter

pytest.importorskip("triton")

in_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs in the child of test_kernels_in_interpreter")


INTERPRETER_RUN = interpreter_child(__file__)


@pytest.mark.child(INTERPRETER_RUN)
def test_kernels_in_interpreter():
    if INTERPRETING:
        pytest.skip("this process is the interpreter run")
    run_in_interpreter(INTERPRETER_RUN)


if INTERPRETING:
    patch_triton_interpreter()
    from agentrl.engine import triton_attention as ta

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def make_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, dtype=torch.float32, page_size=16, seed=0):
    """A random paged cache whose pages are handed out shuffled (non-contiguous ids) and block tables padded
    with an out-of-range id, which the kernels must never dereference."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_pages, generator=g)
    block_tables = torch.full((len(seq_lens), max(pages_per_seq) + 2), 1 << 30, dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages_per_seq):
        block_tables[s, :n] = order[used:used + n]
        used += n
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(query_start_loc[-1]), num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), query_start_loc


def check(batch, dtype, **kwargs):
    out = ta.paged_attention(*batch, None, **kwargs)
    ref = ta.reference_paged_attention(*batch, None)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < TOL[dtype], err
    return out


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_mixed_lengths(dtype, num_splits):
    # length 1, a page minus one, exactly a page, and lengths that end mid-tile and mid-page
    lens = [1, 15, 16, 37, 100]
    batch = make_batch(lens, [1] * len(lens), 4, 2, 64, dtype)
    check(batch, dtype, num_splits=num_splits, config={"block_n": 32})


@in_interpreter
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_gqa_and_head_dims(num_heads, num_kv_heads, head_dim):
    batch = make_batch([9, 50], [1, 1], num_heads, num_kv_heads, head_dim, torch.float16)
    check(batch, torch.float16, max_q_len=1, num_splits=2, config={"block_n": 16})


@in_interpreter
@pytest.mark.parametrize("num_splits", [None, 4])  # None: the heuristic, default tiles
def test_decode_padding_rows(num_splits):
    # A captured decode batch pads with empty sequences (seq_len 0): they must come out as zeros, not NaN.
    batch = make_batch([33, 1, 70], [1, 1, 1], 4, 1, 64)
    q, k_cache, v_cache, block_tables, seq_lens, qsl = batch
    seq_lens = torch.tensor([33, 0, 70], dtype=torch.int32)
    out = ta.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, 0.3, num_splits=num_splits)
    ref = ta.reference_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, 0.3)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0
    assert (out - ref).abs().max() < 1e-4


@in_interpreter
def test_num_splits_heuristic():
    assert ta.choose_num_splits(512, 8, 4096, 64, 132) == 1  # enough (seq, head) pairs to fill the GPU
    assert ta.choose_num_splits(4, 8, 32768, 64, 132) == 32
    assert ta.choose_num_splits(32, 8, 32768, 64, 132) == 4
    assert ta.choose_num_splits(4, 8, 256, 64, 132) == 1  # too short to be worth splitting


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_without_prefix(dtype):
    batch = make_batch([20, 7], [20, 7], 4, 2, 64, dtype)
    check(batch, dtype, max_q_len=20, config={"block_m": 16, "block_n": 16})


@in_interpreter
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1)])
def test_prefill_with_cached_prefix(num_heads, num_kv_heads):
    # chunks after 29 and 40 cached tokens; the tile crosses both page and diagonal boundaries
    batch = make_batch([45, 52], [16, 12], num_heads, num_kv_heads, 64)
    check(batch, torch.float32, max_q_len=16, config={"block_m": 16, "block_n": 16})


@in_interpreter
def test_prefill_head_dim_128_odd_group():
    # 6 query heads on 2 kv heads: tiles of 16 rows hold 5 tokens x 3 heads and one idle row
    batch = make_batch([30], [11], 6, 2, 128, torch.float16)
    check(batch, torch.float16, max_q_len=11, config={"block_m": 16, "block_n": 32})


@in_interpreter
def test_mixed_prefill_and_decode_batch():
    lens, q_lens = [1, 40, 18, 64, 5], [1, 1, 18, 10, 5]
    batch = make_batch(lens, q_lens, 4, 2, 64)
    check(batch, torch.float32, config={"block_m": 16, "block_n": 16})  # max_q_len None: total_q bounds it


@in_interpreter
@pytest.mark.parametrize("num_splits", [1, 2])
def test_mixed_batch_split_dispatch(num_splits):
    # decodes first, then prefill chunks: num_decodes sends the first three to the decode kernel
    lens, q_lens = [1, 40, 18, 64, 5], [1, 1, 1, 10, 5]
    batch = make_batch(lens, q_lens, 4, 2, 64, seed=3)
    check(batch, torch.float32, max_q_len=10, num_decodes=3, num_splits=num_splits,
          config={"block_m": 16, "block_n": 16})


@in_interpreter
@pytest.mark.parametrize("num_splits", [1, 2])
def test_tile_table_step_as_a_captured_mixed_step_runs_it(num_splits):
    """The launch a mixed-step graph makes: decodes and chunks in any order, then sequence rows with no query
    (padding) and token rows no sequence owns; the decode kernel keeps the one-token queries, the table's tiles
    cover the rest, and nothing is read for the padding."""
    from agentrl.engine.step_layout import tile_table
    lens, q_lens = [40, 23, 1, 64, 5, 0, 0], [1, 23, 1, 10, 1, 0, 0]
    q, k_cache, v_cache, block_tables, seq_lens, qsl = make_batch(lens, q_lens, 4, 2, 64, seed=4)
    config = {"block_m": 16, "block_n": 16}
    table = tile_table(q_lens, lens, ta.tokens_per_tile(4, 2, 64, config), capacity=12)
    q_padded = torch.cat([q, torch.randn(6, 4, 64)])  # token rows past the step's
    out = ta.paged_attention(q_padded, k_cache, v_cache, block_tables, seq_lens, qsl, None,
                             tile_table=torch.from_numpy(table), max_seq_len=64, num_splits=num_splits, config=config)
    ref = ta.reference_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, None)
    assert (out[:q.shape[0]] - ref).abs().max() < 1e-4


@in_interpreter
def test_out_buffer_and_strided_query():
    q, k_cache, v_cache, block_tables, seq_lens, qsl = make_batch([10, 21], [4, 21], 4, 2, 64)
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] with head-major storage
    out = torch.full_like(q, float("nan"))
    got = ta.paged_attention(q_strided, k_cache, v_cache, block_tables, seq_lens, qsl, None, max_q_len=21,
                             out=out, config={"block_m": 32, "block_n": 16})
    assert got is out
    ref = ta.reference_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, None)
    assert (out - ref).abs().max() < 1e-4


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_skips_negative_slots(dtype):
    num_pages, page_size, num_kv_heads, head_dim = 4, 16, 2, 64
    k_cache = torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(5, num_kv_heads, head_dim).to(dtype)
    slots = torch.tensor([3 * 16 + 15, -1, 0, 17, -1], dtype=torch.int64)
    ta.write_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[slots[keep]] = True
    assert flat_k[~written].abs().max() == 0 and flat_v[~written].abs().max() == 0


@in_interpreter
def test_write_then_decode_round_trip():
    # write_kv then paged_attention, as one engine decode step does per layer
    batch = make_batch([17, 32], [1, 1], 4, 2, 64)
    q, k_cache, v_cache, block_tables, seq_lens, qsl = batch
    k_new, v_new = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    slots = torch.stack([block_tables[s, (n - 1) // 16].long() * 16 + (n - 1) % 16
                         for s, n in enumerate(seq_lens.tolist())])
    ta.write_kv(k_new, v_new, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 64)[slots], k_new)
    check((q, k_cache, v_cache, block_tables, seq_lens, qsl), torch.float32, config={"block_n": 16})


@in_interpreter
def test_greedy_kernel_matches_argmax_and_log_softmax():
    from agentrl.engine.triton_sampling import greedy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9000, generator=g) * 4  # 9000: three blocks of 4096, the last one ragged
    logits[1, 8500] = 50.0  # the winner in the ragged tail
    logits[2, [10, 5000]] = 60.0  # a tie across blocks: the lower index wins, as torch.argmax
    logits[3, [4096, 4097]] = 60.0  # a tie inside one block
    tokens, logprobs = greedy(logits)
    assert tokens.tolist() == logits.argmax(-1).tolist() == [tokens[0].item(), 8500, 10, 4096, tokens[4].item()]
    expect = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, expect, atol=1e-5, rtol=0)
