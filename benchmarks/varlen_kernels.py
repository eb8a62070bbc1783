"""The training forward's varlen attention kernels on the packed rows the train-step benchmark trains (samples of
200-2,000 tokens in rows of 8,192): flash attention's (`agentrl.train.varlen_attention`), cuDNN's through NVIDIA's
cudnn-frontend ops (`agentrl.train.cudnn_attention`, "cudnn-fe"), FlashAttention-4's
the `flash-attn-4` package), and cuDNN's through
PyTorch's own ragged aten op ("cudnn"), kept as a row for a later torch: on one H200 (torch 2.11, cuDNN 9.19) that
path failed the per-segment reference test, gave non-finite gradients in the train step and broke graph capture
(BENCHMARKS.md, 2026-12-02); PyTorch's nested-tensor attention, the op's one caller with sequence offsets, refuses
causal masks, so that causal ragged path is one PyTorch does not use itself.

Prints, per kernel: forward and forward+backward milliseconds over all rows (median of `--reps`, launched eagerly:
host time counts, which the trainer's CUDA graphs do not pay), their TFLOP/s (causal pairs only), the largest
difference from flash attention (output and the three gradients), each kernel's largest error against an fp32
per-sample reference on the first row (what bounds a bf16 tolerance); the same error on a bucket's boundaries
(empty segments, a padding tail) and on a prefix-shared row (more keys than queries); then whether a CUDA graph of
its forward and backward replays to the eager result within bf16 rounding (flash's backward adds with atomics, so
not bit for bit). GPU only.

usage: python benchmarks/varlen_kernels.py [--model-shape qwen3-0.6b|smollm2] [--tokens 25000] [--reps 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qwen3-0.6b": (16, 8, 128), "smollm2": (9, 3, 64)}  # query heads, kv heads, head dim


def rows_of(tokens: int, row_tokens: int = 8192, seed: int = 0) -> list[list[int]]:
    """Sample lengths (200-2,000) packed first-fit decreasing into rows, as the trainer packs them."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < tokens:
        lengths.append(rng.randint(200, 2000))
    rows: list[list[int]] = []
    for n in sorted(lengths, reverse=True):
        row = next((r for r in rows if sum(r) + n <= row_tokens), None)
        rows.append([n]) if row is None else row.append(n)
    return rows


def inputs(lengths, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu, max(lengths)


def run(kernel, q, k, v, cu, max_len, grad=None):
    """Output and, with `grad`, the three gradients of <out, grad>."""
    q, k, v = (t.detach().requires_grad_(grad is not None) for t in (q, k, v))
    out = kernel(q, k, v, cu, cu, max_len, max_len, q.shape[-1] ** -0.5, True, 0.0)
    if grad is None:
        return (out,)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out, dq, dk, dv


def cudnn_kernel(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool, dropout: float):
    """cuDNN's fused attention on the flat layout (its ragged-offset path, differentiable through
    `_cudnn_attention_backward`). Its causal mask is aligned to the start of the keys: equal to flash's only where
    every sequence has as many keys as queries, as here."""
    out = torch.ops.aten._cudnn_attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), None, cu_q, cu_k, max_q, max_k, True, dropout, causal,
        False, scale=scale)
    return out[0]


def edge_case_errors(kernel, hq, hkv, d) -> tuple[float, float]:
    """Largest error against the fp32 per-sample reference (output and gradients) on the two layouts the trainer
    also hands the kernel: a bucket's boundaries (empty segments, a padding tail) and a prefix-shared row (each
    suffix's keys are the shared prefix's then its own, more keys than queries, the causal mask aligned to the end
    of the keys)."""
    from agentrl.train.varlen_attention import reference_kernel

    errors = []
    g = torch.Generator(device="cuda").manual_seed(1)
    # bucket: segments 300, 0, 700, a tail of 24, then empty segments up to a capacity of 8
    cu = torch.tensor([0, 300, 300, 1000, 1024, 1024, 1024, 1024, 1024], dtype=torch.int32, device="cuda")
    # prefix-shared: a 500-token prefix, suffixes of 200 and 120 tokens; queries are the suffixes, keys gathered
    cu_q = torch.tensor([0, 500, 700, 820], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 500, 1200, 1820], dtype=torch.int32, device="cuda")
    for cq, ck, nq, nk, mq, mk in ((cu, cu, 1024, 1024, 700, 700), (cu_q, cu_k, 820, 1820, 500, 700)):
        q = torch.randn(nq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        grad = torch.randn_like(q)
        outs = []
        for kern, cast in ((kernel, lambda t: t), (reference_kernel, lambda t: t.float())):
            leaves = [cast(t).detach().requires_grad_() for t in (q, k, v)]
            out = kern(*leaves, cq, ck, mq, mk, d ** -0.5, True, 0.0)
            outs.append([out, *torch.autograd.grad(out, leaves, cast(grad))])
        errors.append(max((a.float() - b).abs().max().item() for a, b in zip(*outs)))
    return errors[0], errors[1]


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def graph_replays_equal(kernel, q, k, v, cu, max_len) -> bool:
    grad = torch.randn_like(q)
    static = [t.clone() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(kernel, *static, cu, max_len, grad)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(kernel, *static, cu, max_len, grad)
    fresh = [torch.randn_like(t) for t in (q, k, v)]
    for s, f in zip(static, fresh):
        s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    want = run(kernel, *fresh, cu, max_len, grad)
    return all(torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2) for a, b in zip(outs, want))


def graphed_ms(kernel, batches, grads, reps: int) -> float:
    """Forward and backward over every row replayed from one CUDA graph, as the trainer runs them: the kernels'
    own time, without the host's launch work."""
    static = [[t.clone() for t in b[:3]] + list(b[3:]) for b in batches]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        [run(kernel, *b, grad=g) for b, g in zip(static, grads)]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        [run(kernel, *b, grad=g) for b, g in zip(static, grads)]
    return timed(graph.replay, reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=25000)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    from agentrl.train.cudnn_attention import cudnn_kernel as frontend_kernel
    from agentrl.train.fa4_attention import fa4_kernel
    from agentrl.train.varlen_attention import flash_kernel, reference_kernel

    hq, hkv, d = SHAPES[args.model_shape]
    rows = rows_of(args.tokens)
    batches = [inputs(r, hq, hkv, d, seed=i) for i, r in enumerate(rows)]
    grads = [torch.randn_like(b[0]) for b in batches]
    pairs = sum(n * n / 2 for r in rows for n in r)
    fwd_flops = 4 * hq * d * pairs
    print(f"{args.model_shape}: {hq} query heads, {hkv} kv heads, head dim {d}; {sum(map(sum, rows))} tokens in "
          f"{len(rows)} rows, {sum(map(len, rows))} samples; torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    want = [run(flash_kernel, *b, grad=g) for b, g in zip(batches, grads)]
    first = batches[0]
    exact = run(reference_kernel, *(t.float() for t in first[:3]), first[3], first[4], grad=grads[0].float())
    print(f"{'kernel':<8} {'fwd ms':>8} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8} {'max |diff| vs flash':>20} "
          f"{'max |err| vs fp32':>18} {'graphed fwd+bwd ms':>19}")
    kernels = (("flash", flash_kernel), ("cudnn-fe", frontend_kernel), ("fa4", fa4_kernel), ("cudnn", cudnn_kernel))
    for name, kernel in kernels:
        try:
            got = [run(kernel, *b, grad=g) for b, g in zip(batches, grads)]
            diff = max((a.float() - b.float()).abs().max().item() for w, g in zip(want, got) for a, b in zip(w, g))
            err = max((a.float() - b).abs().max().item() for a, b in zip(got[0], exact))
            with torch.no_grad():
                fwd = timed(lambda: [run(kernel, *b) for b in batches], args.reps)
            both = timed(lambda: [run(kernel, *b, grad=g) for b, g in zip(batches, grads)], args.reps)
            graphed = graphed_ms(kernel, batches, grads, args.reps) if name != "cudnn" else float("nan")
        except Exception as exc:  # a kernel this build or device cannot run: say so, keep the other row
            print(f"{name:<8} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        print(f"{name:<8} {fwd:>8.2f} {fwd_flops / fwd / 1e9:>8.0f} {both:>11.2f} {3.5 * fwd_flops / both / 1e9:>8.0f} "
              f"{diff:>20.2e} {err:>18.2e} {graphed:>19.2f}")
    for name, kernel in kernels[:3]:
        try:
            bucket, shared = edge_case_errors(kernel, hq, hkv, d)
            print(f"{name}: max |err| vs fp32 with empty segments and a tail {bucket:.2e}, prefix-shared {shared:.2e}")
        except Exception as exc:
            print(f"{name}: edge cases failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    for name, kernel in kernels:  # last: a failed capture can leave the device unusable for what follows
        try:
            same = graph_replays_equal(kernel, *first)
            print(f"{name}: a CUDA graph of forward and backward replays to eager: {same}")
        except Exception as exc:
            print(f"{name}: graph capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
