"""Every execution plan cuDNN offers for the trainer's varlen attention (the cudnn-frontend ops of
`agentrl.train.cudnn_attention`), timed on the Qwen3-0.6B rows of `varlen_kernels.py`: whether the plan the
frontend's heuristic picks is the fastest.

The frontend builds one graph per shape and runs its first buildable plan. Here, after a first call builds the
forward and backward graphs of each row, each graph's plans are selected one at a time (`build_plan_at_index`, the
frontend's autotuning idiom; the cached workspace size updated with it) and the rows' forward+backward timed, with
the output and gradients compared to the heuristic plan's. GPU only.

usage: python benchmarks/cudnn_plans.py [--tokens 25000] [--reps 10]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.varlen_kernels import SHAPES, inputs, rows_of, run, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=25000)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from agentrl.train.cudnn_attention import _package_ops, cudnn_kernel

    _package_ops()
    from cudnn.sdpa.fwd import torch_op

    hq, hkv, d = SHAPES[args.model_shape]
    rows = rows_of(args.tokens)
    batches = [inputs(r, hq, hkv, d, seed=i) for i, r in enumerate(rows)]
    grads = [torch.randn_like(b[0]) for b in batches]
    pairs = sum(n * n / 2 for r in rows for n in r)
    flops = 3.5 * 4 * hq * d * pairs
    want = [run(cudnn_kernel, *b, grad=g) for b, g in zip(batches, grads)]
    cache = torch_op._graph_cache
    for kind in ("sdpa_fwd", "sdpa_bwd"):
        keys = [k for k in cache if k[0] == kind]
        counts = {cache[k][0].get_execution_plan_count() for k in keys}
        print(f"{kind}: {len(keys)} graphs, plans per graph {sorted(counts)}")
        graph0 = cache[keys[0]][0]
        for i in range(max(counts)):
            name = "?"
            try:
                for key in keys:
                    g, _, uids = cache[key]
                    g.build_plan_at_index(i)
                    cache[key] = (g, g.get_workspace_size(), uids)
                name = graph0.get_plan_name_at_index(i)
                got = [run(cudnn_kernel, *b, grad=gr) for b, gr in zip(batches, grads)]
                diff = max((a.float() - b.float()).abs().max().item() for w, o in zip(want, got) for a, b in zip(w, o))
                ms = timed(lambda: [run(cudnn_kernel, *b, grad=gr) for b, gr in zip(batches, grads)], args.reps)
                print(f"  plan {i} {name[:90]}: fwd+bwd {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s, "
                      f"max |diff| vs the heuristic's {diff:.2e}")
            except Exception as exc:  # a plan this shape cannot build or run
                print(f"  plan {i} {name[:90]}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        for key in keys:  # back to the heuristic's plan before the other kind's plans are timed
            g, _, uids = cache[key]
            g.build_plan_at_index(0)
            cache[key] = (g, g.get_workspace_size(), uids)


if __name__ == "__main__":
    main()
