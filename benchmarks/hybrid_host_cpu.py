"""Host cost of a pure-decode step of the hybrid engine, on the CPU, against the dense engine on the same sequences.

On the GPU a pure-decode step's forward is one CUDA-graph replay, so what the host spends per step is everything
around it: scheduling, the linear-attention plan and snapshot bookkeeping (hybrid), the step's layout and upload,
the copies into the graph's static buffers, sampling, and resolving the step's tokens. Here the engine's decode
steps replay stand-in graphs (the captured function, called again), as in tests/engine/test_engine_graphs.py, and
each call of that function is timed apart: `host ms` is a step's wall time less its forward, i.e. the Python a
step costs outside what the GPU would replay. Widths are tiny (the forward is cheap on the CPU); the layer count
and layout follow Qwen3.5-0.8B (24 layers, 3 gated delta nets then 1 attention layer, x6) and the dense model
has as many layers, so per-layer host work (none outside the graph) would show.

64 sequences of 256 prompt tokens -> 64, greedy, eos ignored, prefix cache (and, hybrid, state snapshots) on,
page size 16; every sequence is prefilled first, then `--steps` pure-decode steps are timed. Prints one row
per model: ms a step of wall, of forward (what the graph replays) and of host, then the host phases.

`--device cuda` runs the same on the GPU with real CUDA graphs, the Qwen3-0.6B (dense, benchmarks/engine.py) and
Qwen3.5-0.8B (hybrid, benchmarks/hybrid.py) shapes in bf16, and no profiler: there the forward is the replay's
launch (and the copies into the graph's buffers), `wait for the device` is the time `step()` blocks on the
previous step's results, and `host` is the wall less that wait: if it is below the GPU's time a step, the step
is bound by the device, not by Python.

usage: python benchmarks/hybrid_host_cpu.py [--seqs 64] [--steps 48] [--layers 24] [--profile] [--device cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `agentrl`


def build(kind: str, layers: int, device: str):
    if device == "cuda":  # the real shapes
        if kind == "dense":
            from benchmarks.engine import qwen3_shaped

            return qwen3_shaped()
        from benchmarks.hybrid import build_model

        return build_model(smoke=False)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True, num_hidden_layers=layers,
                  eos_token_id=0, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    if kind == "dense":
        return Qwen3ForCausalLM(Qwen3Config(**common)).float().eval()
    pattern = (["linear_attention"] * 3 + ["full_attention"]) * (-(-layers // 4))
    cfg = Qwen3_5TextConfig(layer_types=pattern[:layers], linear_num_key_heads=2, linear_num_value_heads=2,
                            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, **common)
    return Qwen3_5ForCausalLM(cfg).float().eval()


class Timer:
    def __init__(self):
        self.total = defaultdict(float)
        self.on = False

    def wrap(self, obj, name: str, label: str | None = None):
        fn = getattr(obj, name)
        label = label or name

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t

        timed.__wrapped__ = fn
        setattr(obj, name, timed)


def standin_graphs(engine, timer: Timer):
    """Decode steps through DecodeGraphs with a capture that replays by calling the captured forward (timed)."""
    from agentrl.engine.cuda_graphs import DecodeGraphs

    def capture(fn, pool):
        fn()

        def replay():
            if not timer.on:
                return fn()
            t = time.perf_counter()
            out = fn()
            timer.total["forward (graph replay on GPU)"] += time.perf_counter() - t
            return out

        return replay

    engine.graphs = DecodeGraphs(engine.forward_parts, engine.config.max_num_seqs, capture=capture)


def measure(kind: str, args) -> tuple[dict, cProfile.Profile | None]:
    import random

    from agentrl.engine import Engine, EngineConfig, SamplingParams
    from agentrl.engine import cuda_graphs

    model = build(kind, args.layers, args.device)
    cuda = args.device == "cuda"
    n, plen, new = args.seqs, 256, args.steps + 16
    engine = Engine(model, EngineConfig(max_num_seqs=n, max_model_len=plen + new + 64, max_tokens_per_step=8192,
                                        page_size=16, enable_prefix_cache=True))
    timer = Timer()
    if cuda:
        timer.wrap(engine.graphs, "_replay", "forward (graph replay on GPU)")
        timer.wrap(torch.cuda.Event, "synchronize", "wait for the device")
    else:
        standin_graphs(engine, timer)
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "register", "register full pages")
    timer.wrap(engine, "_complete_in_flight", "complete in flight (incl. register)")
    timer.wrap(engine, "sampler", "sample")
    timer.wrap(cuda_graphs, "layout_step", "layout_step")
    timer.wrap(cuda_graphs, "upload", "upload")
    timer.wrap(engine.graphs, "run", "graphs.run (incl. layout, upload, forward)")
    if engine.linear is not None:
        timer.wrap(engine.linear, "plan", "linear plan (incl. snapshots)")
        timer.wrap(engine.linear, "after", "linear after (snapshot copies)")
    rng = random.Random(1)
    sampling = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    for _ in range(n):
        engine.submit([rng.randrange(1, model.config.vocab_size) for _ in range(plen)], sampling)
    while not all(s.logprobs for s in engine._live.values()) or len(engine._live) < n:
        engine.step()
    for _ in range(2):
        engine.step()
    graph_steps, captures = engine.stats.graph_steps, engine.stats.graph_captures
    prof = cProfile.Profile() if args.profile else None
    timer.on = True
    start = time.perf_counter()
    if prof is not None:
        prof.enable()
    for _ in range(args.steps):
        engine.step()
    if prof is not None:
        prof.disable()
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    timer.on = False
    if cuda:
        torch.cuda.Event.synchronize = torch.cuda.Event.synchronize.__wrapped__
    assert engine.stats.graph_steps - graph_steps == args.steps, "a timed step did not replay a decode graph"
    row = {"wall": wall, **timer.total}
    print(f"{kind}: {engine.stats.graph_captures - captures} graph captures during the timed steps")
    if engine.snapshots is not None:
        row["snapshots taken"] = engine.snapshots.taken
    return row, prof


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions of the timed steps")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    rows = {}
    for kind in ("dense", "hybrid"):
        rows[kind], prof = measure(kind, args)
        if prof is not None:
            print(f"\n#### cProfile, {kind}: {args.steps} decode steps\n")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    s = args.steps
    layers = "real shapes" if args.device == "cuda" else f"{args.layers} layers"
    print(f"\n{args.device}, {args.seqs} sequences, {layers}, {s} pure-decode steps (ms a step)\n")
    names = sorted({k for r in rows.values() for k in r if k not in ("wall", "snapshots taken")})
    print(f"| {'':<45} | {'dense':>8} | {'hybrid':>8} |")
    print(f"|{'-' * 47}|{'-' * 10}|{'-' * 10}|")
    fwd, wait = "forward (graph replay on GPU)", "wait for the device"
    for label, get in [("wall", lambda r: r["wall"]),
                       ("host (wall - forward - wait)", lambda r: r["wall"] - r.get(fwd, 0.0) - r.get(wait, 0.0))] + \
            [(k, (lambda k: lambda r: r.get(k, 0.0))(k)) for k in names]:
        print(f"| {label:<45} | " + " | ".join(f"{get(rows[k]) / s * 1e3:>8.3f}" for k in ("dense", "hybrid")) + " |")


if __name__ == "__main__":
    main()
