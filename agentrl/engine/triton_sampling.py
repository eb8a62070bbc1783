"""Greedy choice and its logprob in one pass over the logits (CUDA; imported by the sampler on CUDA only).

The eager version (`logits.float()`, `max`, then `exp(x - max).sum().log()`) makes five passes over `[rows,
vocab]` and writes an fp32 copy of it, a visible share of a decode step at a large vocabulary. This kernel reads each logit once (one program per row, online max and sum of exponentials
in fp32) and writes two numbers per row. Ties go to the lowest index, as `torch.argmax` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG_BIG = tl.constexpr(-1.0e30)  # finite: exp(m_old - m_new) never sees inf - inf


@triton.jit
def _greedy_kernel(logits, stride_row, tokens, logprobs, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits + row.to(tl.int64) * stride_row
    m = tl.full([], _NEG_BIG, tl.float32)
    total = tl.zeros([], tl.float32)
    best = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        block_arg = tl.min(tl.where(x == block_max, offs, vocab), 0)
        new_m = tl.maximum(m, block_max)
        total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
        best = tl.where(block_max > m, block_arg, best)  # strictly greater: an earlier block keeps a tie
        m = new_m
    tl.store(tokens + row, best.to(tl.int64))
    tl.store(logprobs + row, -tl.log(total))


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(argmax [N] int64, log_softmax at the argmax [N] float32)` of `logits` `[N, V]` (last dim contiguous)."""
    n, vocab = logits.shape
    assert logits.stride(-1) == 1
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _greedy_kernel[(n,)](logits, logits.stride(0), tokens, logprobs, vocab, BLOCK=4096, num_warps=8)
    return tokens, logprobs
