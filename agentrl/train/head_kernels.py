"""The chunked lm_head's softmax statistics in one read of the logits (CUDA; Triton).

Per row of fp32 logits `z` (times the inverse temperature): the log-sum-exp, the entropy `lse - sum(p * z)` and
the target's logprob. Compiled from PyTorch (`lm_head._chunk_stats`) the three come from several passes over the
`[chunk, vocab]` logits, the largest memory-bound kernel of a Qwen3-0.6B training step; here each program reads
its row once, keeping per-lane running maxima and sums of `exp(z - max)` and `exp(z - max) * z` rescaled as the
maximum moves, and combines the lanes at the end. Time against the compiled version: BENCHMARKS.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG_BIG = tl.constexpr(-1.0e30)  # finite: exp(m_old - m_new) never sees inf - inf


@triton.jit
def _stats_kernel(logits, stride_row, targets, logprobs, entropy, lse_out, vocab, inv_temp, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits + row.to(tl.int64) * stride_row
    m = tl.full([BLOCK], _NEG_BIG, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        z = tl.load(base + offs, mask=inside, other=_NEG_BIG).to(tl.float32) * inv_temp
        new_m = tl.maximum(m, z)
        scale = tl.exp(m - new_m)
        e = tl.exp(z - new_m)  # 0 outside the row (z there is -1e30 / T)
        s = s * scale + e
        t = t * scale + tl.where(inside, e * z, 0.0)
        m = new_m
    top = tl.max(m, 0)
    w = tl.exp(m - top)
    total = tl.sum(s * w, 0)
    lse = top + tl.log(total)
    target = tl.load(targets + row)
    z_target = tl.load(base + target).to(tl.float32) * inv_temp
    tl.store(logprobs + row, z_target - lse)
    tl.store(entropy + row, lse - tl.sum(t * w, 0) / total)
    tl.store(lse_out + row, lse)


def online_stats_triton(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float):
    """`(logprob of targets, entropy, logsumexp)`, each `[N]` fp32, of `softmax(logits * inv_temp)` for `logits`
    `[N, V]` (last dimension contiguous): `lm_head._chunk_stats` in one read."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(3, n, dtype=torch.float32, device=logits.device)
    if n:
        _stats_kernel[(n,)](logits, logits.stride(0), targets, out[0], out[1], out[2], vocab, float(inv_temp),
                            BLOCK=2048, num_warps=8)
    return out[0], out[1], out[2]
