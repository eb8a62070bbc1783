"""How many aten ops one pure-decode step of the engine's view runs, by op, for a model shape (CPU, no GPU needed).

With eager layers (`engine.compile=false`; compiled is the default on CUDA), replayed from CUDA graphs, a small
model's decode step is bound by the kernels inside the graph, a few microseconds each whatever their size. This counts the ops a decode step dispatches (views and metadata ops launch no kernel; the rest roughly one
each), so the kernel count of a shape can be read without a GPU.

usage: python benchmarks/decode_ops.py [--model-shape smollm2|qwen3-0.6b] [--seqs 8]
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-shape", choices=("smollm2", "qwen3-0.6b"), default="smollm2")
    ap.add_argument("--seqs", type=int, default=8)
    args = ap.parse_args(argv)
    from agentrl.engine import Engine, EngineConfig, SamplingParams
    from benchmarks.train_step import shaped_model

    model = shaped_model(args.model_shape, "cpu")
    engine = Engine(model, EngineConfig(max_num_seqs=args.seqs, max_model_len=64, seed=0, compile=False))
    for i in range(args.seqs):
        engine.submit([5 + i] * 20, SamplingParams(max_new_tokens=8, temperature=0.0))
    for _ in range(3):  # prefill, then decode steps
        engine.step()
    count = Count()
    with count:
        engine.step()
    layers = model.config.num_hidden_layers
    kernels = {op: n for op, n in count.ops.items() if op not in NO_KERNEL}
    total, launching = sum(count.ops.values()), sum(kernels.values())
    print(f"{args.model_shape} shape, {args.seqs} sequences, one pure-decode step of the eager view (CPU):")
    print(f"  aten ops {total} ({total / layers:.0f} a layer); of them launching a kernel {launching} "
          f"({launching / layers:.0f} a layer, {layers} layers)")
    print("  " + ", ".join(f"{op} {n}" for op, n in sorted(kernels.items(), key=lambda kv: -kv[1])[:16]))


if __name__ == "__main__":
    main()
