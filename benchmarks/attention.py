"""Paged attention on the GPU: correctness against the torch reference, then speed against SDPA.

    python benchmarks/attention.py            # checks + the table (well under a minute on one H200)
    python benchmarks/attention.py --sweep    # also tries tile configs and split counts (a few minutes)
    python benchmarks/attention.py --sweep --sweep-contexts 288,1024   # the decode sweep at those contexts

Decode: 512 sequences, 16 query / 8 kv heads, head_dim 128, bf16, page 16, pages handed out shuffled, at
context 384 / 1024 / 4096; SDPA runs the same shapes over contiguous KV. Prefill: 64 prompts x 256 tokens.
GB/s counts bytes that must move: the KV read, plus q read and the output written. The device copy figure on
the H200 is ~4.25 TB/s counting read + write, so a reader should reach ~3.4 TB/s (80%) or more.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, HKV, D, PAGE, DTYPE = 16, 8, 128, 16, torch.bfloat16
SDPA_ANCHOR_MS = {384: 0.186, 1024: 0.473, 4096: 1.848}  # measured on the GPU host (docs/anchors.md)


def paged_batch(seq_lens, q_lens, device, seed=0):
    """Random paged cache, pages shuffled so sequences are not contiguous in memory."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = [math.ceil(n / PAGE) for n in seq_lens]
    num_pages = sum(pages)
    k_cache = torch.randn(num_pages, PAGE, HKV, D, device=device, dtype=DTYPE, generator=g)
    v_cache = torch.randn(num_pages, PAGE, HKV, D, device=device, dtype=DTYPE, generator=g)
    order = torch.randperm(num_pages, device=device, generator=g).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=device)
    starts = [0] + list(itertools.accumulate(pages))
    for s, n in enumerate(pages):
        block_tables[s, :n] = order[starts[s]:starts[s] + n]
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=device)
    qsl[1:] = torch.tensor(q_lens, device=device).cumsum(0)
    q = torch.randn(sum(q_lens), H, D, device=device, dtype=DTYPE, generator=g)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, seq_lens_t, qsl


def contiguous_kv(k_cache, v_cache, block_tables, length):
    """[B, Hkv, L, D] copies of the paged cache, for SDPA."""
    b = block_tables.shape[0]
    k = k_cache[block_tables.long()].reshape(b, -1, HKV, D)[:, :length].transpose(1, 2).contiguous()
    v = v_cache[block_tables.long()].reshape(b, -1, HKV, D)[:, :length].transpose(1, 2).contiguous()
    return k, v


def check_correctness(ta, device):
    torch.manual_seed(0)
    print("correctness vs reference_paged_attention (bf16, max abs error)")
    worst = 0.0
    cases = {
        "decode, mixed lengths": ([1, 15, 16, 17, 300, 1024, 4099, 5000], [1] * 8, {}),
        "decode, forced 16 splits": ([1, 15, 333, 4099], [1] * 4, {"num_splits": 16}),
        "prefill, no prefix": ([256, 100, 7], [256, 100, 7], {}),
        "chunked prefill + decode": ([700, 300, 1, 50], [200, 1, 1, 50], {}),
    }
    for name, (lens, q_lens, kw) in cases.items():
        batch = paged_batch(lens, q_lens, device)
        got = ta.paged_attention(*batch, None, max_q_len=max(q_lens), **kw)
        ref = ta.reference_paged_attention(*batch, None)
        err = (got.float() - ref.float()).abs().max().item()
        worst = max(worst, err)
        print(f"  {name:28s} {err:.2e}")
    # write_kv against index_copy_, with skipped slots
    q, k_cache, v_cache, *_ = paged_batch([64, 64], [1, 1], device)
    k_new = torch.randn(6, HKV, D, device=device, dtype=DTYPE)
    slots = torch.tensor([0, -1, 17, 100, -1, 127], device=device)
    kc, vc = k_cache.clone(), v_cache.clone()
    ta.write_kv(k_new, k_new * 2, kc, vc, slots)
    keep = slots >= 0
    want = k_cache.clone().view(-1, HKV, D).index_copy_(0, slots[keep], k_new[keep]).view_as(k_cache)
    ok = torch.equal(kc, want) and torch.equal(vc.view(-1, HKV, D)[slots[keep]], k_new[keep] * 2)
    print(f"  write_kv with skipped slots   {'exact' if ok else 'MISMATCH'}")
    if worst > 5e-2 or not ok:
        raise SystemExit("correctness check failed")


def check_cuda_graph(ta, device):
    """Capture one decode step (split-K on, so the partial buffers and combine kernel are inside the graph),
    change seq_lens in place, replay: the output must follow the new lengths without a re-capture."""
    batch = paged_batch([2048] * 4, [1] * 4, device)
    q, k_cache, v_cache, block_tables, seq_lens, qsl = batch
    out = torch.empty_like(q)
    ta.paged_attention(*batch, None, max_q_len=1, out=out, num_splits=16)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.paged_attention(*batch, None, max_q_len=1, out=out, num_splits=16)
    seq_lens.copy_(torch.tensor([5, 2048, 1, 999], dtype=torch.int32, device=device))
    graph.replay()
    err = (out.float() - ta.reference_paged_attention(*batch, None).float()).abs().max().item()
    print(f"  CUDA graph replay, new lengths {err:.2e}")


def bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def decode_bytes(num_seqs, ctx):
    return (num_seqs * ctx * HKV * D * 2 + 2 * num_seqs * H * D) * 2  # K+V read, q read + out written


def run_decode(ta, device, ctx, num_seqs=512, config=None, num_splits=None):
    batch = paged_batch([ctx] * num_seqs, [1] * num_seqs, device)
    out = torch.empty_like(batch[0])
    fn = lambda: ta.paged_attention(*batch, None, max_q_len=1, out=out, max_seq_len=ctx, config=config,  # noqa: E731
                                    num_splits=num_splits)
    return bench(fn), batch


def sdpa_decode_ms(batch, ctx):
    q, k_cache, v_cache, block_tables, *_ = batch
    k, v = contiguous_kv(k_cache, v_cache, block_tables, ctx)
    qb = q.unsqueeze(2)  # [B, H, 1, D]
    ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qb, k, v, enable_gqa=True))
    del k, v
    return ms


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also try tile configs (a few minutes more)")
    parser.add_argument("--sweep-contexts", default="1024",
                        help="comma list of decode contexts the sweep tries (288: the engine profile's decode steps)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA (the kernels are tested on CPU by tests/test_triton_attention.py)")
        return 1
    from agentrl.engine import triton_attention as ta

    device = torch.device("cuda")
    started = time.time()
    print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| config", ta.decode_config(D),
          ta.prefill_config(D))
    check_correctness(ta, device)
    check_cuda_graph(ta, device)

    print(f"\n{'case':36s} {'ms':>8s} {'GB/s':>8s} {'SDPA ms':>8s} {'SDPA GB/s':>9s} {'vs SDPA':>8s}")
    for ctx in (384, 1024, 4096):
        ms, batch = run_decode(ta, device, ctx)
        sdpa = sdpa_decode_ms(batch, ctx)
        nbytes = decode_bytes(512, ctx)
        splits = ta.choose_num_splits(512, HKV, ctx, ta.decode_config(D)["block_n"], torch.cuda.get_device_properties(
            0).multi_processor_count)
        print(f"{f'decode 512 x {ctx} (splits {splits})':36s} {ms:8.3f} {nbytes / ms / 1e6:8.0f} {sdpa:8.3f} "
              f"{nbytes / sdpa / 1e6:9.0f} {sdpa / ms:7.2f}x   (anchor SDPA {SDPA_ANCHOR_MS[ctx]} ms)")
        del batch
    for seqs, ctx in ((8, 32768), (2, 131072)):  # few long sequences: where split-K matters
        ms1, _ = run_decode(ta, device, ctx, seqs, num_splits=1)
        ms, batch = run_decode(ta, device, ctx, seqs)
        sdpa = sdpa_decode_ms(batch, ctx)
        nbytes = decode_bytes(seqs, ctx)
        print(f"{f'decode {seqs} x {ctx} (1 split: {ms1:.3f})':36s} {ms:8.3f} {nbytes / ms / 1e6:8.0f} "
              f"{sdpa:8.3f} {nbytes / sdpa / 1e6:9.0f} {sdpa / ms:7.2f}x")
        del batch
    prefill_case(ta, device)
    print(f"({time.time() - started:.0f} s including kernel compiles)")
    if args.sweep:
        sweep(ta, device, tuple(int(c) for c in args.sweep_contexts.split(",")))
    return 0


def prefill_case(ta, device, config=None, quiet=False):
    n, length = 64, 256
    batch = paged_batch([length] * n, [length] * n, device)
    q, k_cache, v_cache, block_tables, *_ = batch
    out = torch.empty_like(q)
    ms = bench(lambda: ta.paged_attention(*batch, None, max_q_len=length, out=out, config=config))
    if quiet:
        return ms
    k, v = contiguous_kv(k_cache, v_cache, block_tables, length)
    qb = q.view(n, length, H, D).transpose(1, 2)
    sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qb, k, v, is_causal=True,
                                                                           enable_gqa=True))
    nbytes = (n * length * HKV * D * 2 + 2 * n * length * H * D) * 2
    flops = 4 * n * H * D * length * (length + 1) / 2  # causal: QK^T and PV over the visible half
    print(f"{f'prefill {n} x {length}':36s} {ms:8.3f} {nbytes / ms / 1e6:8.0f} {sdpa:8.3f} {nbytes / sdpa / 1e6:9.0f} "
          f"{sdpa / ms:7.2f}x   ({flops / ms / 1e9:.0f} vs {flops / sdpa / 1e9:.0f} TFLOP/s)")


def sweep(ta, device, contexts=(1024,)):
    """Tile configs for decode at 512 x each of `contexts` and for prefill, then split counts for few long
    sequences."""
    for ctx in contexts:
        print(f"\nsweep: decode 512 x {ctx} (ms, GB/s; the default config {ta.decode_config(D)})")
        batch = paged_batch([ctx] * 512, [1] * 512, device)
        out = torch.empty_like(batch[0])
        results = []
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 3, 5)):
            cfg = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
            try:
                ms = bench(lambda: ta.paged_attention(*batch, None, max_q_len=1, out=out, max_seq_len=ctx,
                                                      config=cfg))
            except Exception as e:  # a config may not fit in shared memory
                print(f"  {cfg} failed: {type(e).__name__}")
                continue
            results.append((ms, cfg))
            print(f"  {cfg}  {ms:.3f}  {decode_bytes(512, ctx) / ms / 1e6:.0f}")
        print("  best:", min(results, key=lambda r: r[0]))
        del batch, out
    print("sweep: prefill 64 x 256 (ms)")
    results = []
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
        cfg = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}
        try:
            ms = prefill_case(ta, device, cfg, quiet=True)
        except Exception as e:
            print(f"  {cfg} failed: {type(e).__name__}")
            continue
        results.append((ms, cfg))
        print(f"  {cfg}  {ms:.3f}")
    print("  best:", min(results, key=lambda r: r[0]))
    print("sweep: decode 8 x 32768, num_splits (heuristic picks "
          f"{ta.choose_num_splits(8, HKV, 32768, ta.decode_config(D)['block_n'], ta._num_sms(device))})")
    for splits in (1, 4, 8, 16, 32):
        ms, _ = run_decode(ta, device, 32768, 8, num_splits=splits)
        print(f"  {splits:2d} splits  {ms:.3f} ms  {decode_bytes(8, 32768) / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
