"""The chunked lm_head's softmax statistics over one chunk of fp32 logits (`[1024, vocab]`): the compiled
`_chunk_stats` the trainer runs, against two ways of reading the logits once, each checked against fp64.

Rows: `compiled` (`lm_head._chunk_stats` under torch.compile, as the trainer runs it), `compiled-online`
(`online_stats`: max, then sums of exp(z - max) and exp(z - max) * z, the form inductor's online softmax fuses),
`triton-online` (`online_stats_triton`: one pass per row, a running max and rescaled sums). Prints milliseconds
(median of `--reps`), GB/s over one read of the logits, and the largest error of logprob, entropy and logsumexp
against fp64. Also the gradient step (`_chunk_grad`, compiled) for scale. GPU only.

usage: python benchmarks/head_stats.py [--rows 1024] [--vocab 151936] [--reps 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.varlen_kernels import timed  # noqa: E402


def online_stats(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float):
    z = logits * inv_temp
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - m)
    s = e.sum(-1)
    t = (e * z).sum(-1)
    lse = m.squeeze(1) + torch.log(s)
    return z.gather(1, targets[:, None]).squeeze(1) - lse, lse - t / s, lse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from agentrl.train.head_kernels import online_stats_triton
    from agentrl.train.lm_head import _chunk_stats, compile_chunk_steps

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, device="cuda", generator=g) * 4
    targets = torch.randint(0, args.vocab, (args.rows,), device="cuda", generator=g)
    inv_temp = 1 / 0.7
    ref = _chunk_stats(logits.double(), targets, inv_temp)
    stats, grad = compile_chunk_steps()
    rows = {"compiled": stats, "compiled-online": torch.compile(online_stats, dynamic=True),
            "triton-online": online_stats_triton}
    nbytes = logits.numel() * 4
    print(f"logits [{args.rows}, {args.vocab}] fp32, {nbytes / 1e9:.2f} GB")
    print(f"{'row':<18}{'ms':>8}{'GB/s':>8}{'|lp err|':>11}{'|ent err|':>11}{'|lse err|':>11}")
    for name, fn in rows.items():
        out = fn(logits, targets, inv_temp)
        errs = [float((o.double() - r).abs().max()) for o, r in zip(out, ref)]
        ms = timed(lambda: fn(logits, targets, inv_temp), args.reps)
        print(f"{name:<18}{ms:8.3f}{nbytes / ms / 1e6:8.0f}" + "".join(f"{e:11.2e}" for e in errs))
    lp, ent, lse = stats(logits, targets, inv_temp)
    g_lp = torch.randn(args.rows, device="cuda", generator=g)
    ms = timed(lambda: grad(logits, targets, lse, ent, g_lp, None, inv_temp, torch.bfloat16), args.reps)
    print(f"{'grad step':<18}{ms:8.3f}{nbytes * 1.5 / ms / 1e6:8.0f}  (reads fp32, writes bf16)")


if __name__ == "__main__":
    main()
