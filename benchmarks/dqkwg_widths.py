"""fla's gated dq/dk/dw/dg kernel (`chunk_bwd_kernel_dqkwg`) at each K block width, against agentrl's PyTorch version
of it, on one GPU: how far each launch lands from the PyTorch results, and its time a call. On Hopper under Triton
3.4-3.7.0 fla refuses the kernel (its issue #640: a miscompile at one block width); agentrl launches it at a width
the miscompile spares (`delta_rule_backward.spared_block_width`). Shapes: one 8k packed row of Qwen3.5-0.8B's delta
nets (16 heads of 128), samples of mixed lengths, bf16.

    python benchmarks/dqkwg_widths.py
"""

from __future__ import annotations

import argparse

import torch


def inputs(K: int, lengths: list[int], heads: int = 16, V: int = 128, seed: int = 0) -> dict:
    """fla's layout: tokens [1, T, heads, D] in bf16, a chunk-local cumulative base-2 gate in fp32, one state and
    state gradient per 64-token chunk."""
    from agentrl.train.linear_conv import chunk_indices

    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    chunks = chunk_indices(lengths, size=64)
    g = torch.empty(T, heads)
    step = -torch.rand(T, heads, generator=gen) * 0.3
    for seq, c in chunks:
        start = int(cu[seq]) + 64 * c
        end = min(start + 64, int(cu[seq + 1]))
        g[start:end] = step[start:end].cumsum(0)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).cuda().bfloat16()

    return dict(q=rand(1, T, heads, K, s=0.1), k=rand(1, T, heads, K, s=0.1), v=rand(1, T, heads, V),
                do=rand(1, T, heads, V), dv=rand(1, T, heads, V), w=rand(1, T, heads, K, s=0.1),
                h=rand(1, len(chunks), heads, K, V, s=0.5), dh=rand(1, len(chunks), heads, K, V, s=0.5),
                g=g.reshape(1, T, heads).cuda(), cu_seqlens=cu.cuda(),
                chunk_indices=torch.tensor(chunks, dtype=torch.int32).cuda(), chunk_size=64)


def ms_a_call(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def relative(got, want) -> str:
    worst = {n: float((a.float() - b.float()).norm() / b.float().norm()) for n, a, b in
             zip(("dq", "dk", "dw", "dg"), got, want)}
    return ", ".join(f"{n} {e:.1e}" for n, e in worst.items())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1500,300,2200,900,64,1700,1528", help="the packed row's samples")
    args = ap.parse_args()
    from agentrl.train import delta_rule_backward as drb
    from fla.utils import TRITON_ABOVE_3_7_1, IS_NVIDIA_HOPPER
    import triton

    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"Hopper {IS_NVIDIA_HOPPER}, Triton >= 3.7.1 {TRITON_ABOVE_3_7_1}; one row of {sum(lengths):,} tokens, "
          f"{len(lengths)} samples, 16 heads, V 128, bf16")
    print("| K | launch | relative difference from the PyTorch version (norm-wise) | ms a call |")
    print("|---|---|---|---|")
    for K in (128, 64):
        t = inputs(K, lengths)
        want = drb.chunk_bwd_dqkwg(**t)
        print(f"| {K} | PyTorch version, eager | – | {ms_a_call(lambda: drb.chunk_bwd_dqkwg(**t)):.3f} |", flush=True)
        compiled = torch.compile(drb.chunk_bwd_dqkwg, dynamic=True, fullgraph=True)
        got = compiled(**t)
        print(f"| {K} | PyTorch version, compiled | {relative(got, want)} | {ms_a_call(lambda: compiled(**t)):.3f} |",
              flush=True)
        for width in (32, 64, 128):
            if width > K:
                continue
            mark = " (spared width)" if width == drb.spared_block_width(K) else ""
            try:
                got = drb.fla_kernel(**t, block_k=width)
                print(f"| {K} | fla's kernel, K blocks of {width}{mark} | {relative(got, want)} | "
                      f"{ms_a_call(lambda w=width: drb.fla_kernel(**t, block_k=w)):.3f} |", flush=True)
            except Exception as exc:  # a width this kernel cannot take here
                print(f"| {K} | fla's kernel, K blocks of {width}{mark} | failed: {str(exc)[:80]} | – |", flush=True)


if __name__ == "__main__":
    main()
