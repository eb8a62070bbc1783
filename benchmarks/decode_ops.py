"""How many aten ops one pure-decode step of the engine's view runs, by op, for a model shape (CPU, no GPU needed).

With eager layers (`engine.compile=false`; compiled is the default on CUDA), replayed from CUDA graphs, a small
model's decode step is bound by the kernels inside the graph, a few microseconds each whatever their size. This counts the ops a decode step dispatches (views and metadata ops launch no kernel; the rest roughly one
each), so the kernel count of a shape can be read without a GPU.

Each shape is counted twice, with the engine's fused projections (the default: gate + up, and a delta net's four
input projections, one GEMM each) and without them (`engine.fuse_projections=false`).

usage: python benchmarks/decode_ops.py [--model-shape smollm2|qwen3-0.6b|qwen3.5-0.8b] [--seqs 8]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Ops that only reshape or alias: no kernel on a GPU.
NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "select", "slice", "unsqueeze", "squeeze", "expand",
             "permute", "reshape", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind",
             "lift_fresh", "_reshape_alias", "contiguous", "empty", "empty_like", "empty_strided"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_step(model, seqs: int, fuse: bool) -> Counter:
    """The aten ops of one pure-decode step of an eager engine over `model`, `seqs` sequences."""
    from agentrl.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(model, EngineConfig(max_num_seqs=seqs, max_model_len=64, seed=0, compile=False,
                                        fuse_projections=fuse))
    for i in range(seqs):
        engine.submit([5 + i] * 20, SamplingParams(max_new_tokens=8, temperature=0.0))
    for _ in range(3):  # prefill, then decode steps
        engine.step()
    count = Count()
    with count:
        engine.step()
    return count.ops


def shape_model(shape: str):
    if shape == "qwen3.5-0.8b":
        import torch
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        from benchmarks.hybrid import QWEN35_08B

        torch.manual_seed(0)
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35_08B)).eval()
    from benchmarks.train_step import shaped_model

    return shaped_model(shape, "cpu")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-shape", choices=("smollm2", "qwen3-0.6b", "qwen3.5-0.8b"), default="smollm2")
    ap.add_argument("--seqs", type=int, default=8)
    args = ap.parse_args(argv)
    model = shape_model(args.model_shape)
    layers = model.config.num_hidden_layers
    print(f"{args.model_shape} shape, {args.seqs} sequences, one pure-decode step of the eager view (CPU), "
          f"{layers} layers:\n")
    print("| projections | aten ops | launching a kernel | a layer | GEMMs (mm, addmm, bmm) | top ops |")
    print("|---|---:|---:|---:|---:|---|")
    for fuse in (False, True):  # unfused first: the fused engine re-points the parameters for good
        ops = count_step(model, args.seqs, fuse)
        kernels = {op: n for op, n in ops.items() if op not in NO_KERNEL}
        launching = sum(kernels.values())
        gemms = sum(kernels.get(op, 0) for op in ("mm", "addmm", "bmm"))
        top = ", ".join(f"{op} {n}" for op, n in sorted(kernels.items(), key=lambda kv: -kv[1])[:8])
        print(f"| {'fused' if fuse else 'one by one'} | {sum(ops.values())} | {launching} | {launching / layers:.0f} "
              f"| {gemms} | {top} |")


if __name__ == "__main__":
    main()
