"""Replicas and tensor parallelism on one 2-GPU host, in one launch: agentrl's own training steps (generation of
the step's GSM8K rollouts, then the pooled update) under four layouts, one Markdown table per comparison.

1. replicas=2 against one GPU, same model and same global batch: s/step, trained tokens/s (world, over the
   training part of the step), generated tokens/s (world, over the whole step), the load imbalance across
   replicas (largest Σ L² over the mean), whether the replicas end with bit-identical weights, peak memory per GPU;
2. tp=2 with a model one GPU cannot train (default the Qwen3-14B shape: its public config, random bf16 weights,
   built on the device from the config, nothing downloaded): the same numbers, then one GPU trying the same run,
   which is expected to run out of memory (the table says where). Training keeps bf16 weights, gradients and Adam
   moments, 8 bytes a parameter: `--tp-layers` deepens the shape if one GPU turns out to hold it.

Weights are random, so the GSM8K reward is replaced by a function of the answer's characters: rollouts differ in
reward, advantages are not zero, and each step is a real update. Prompts are read through agentrl's offline byte
tokenizer (ids below 263; the model's vocabulary keeps its real size, so the embeddings weigh what they do).

usage (2 GPUs, NCCL):  torchrun --nproc-per-node 2 benchmarks/parallel.py [--steps 3] [--warmup 1] [--groups 8]
                           [--group-size 8] [--new-tokens 256] [--replica-model qwen3-1.7b] [--tp-model qwen3-14b]
                           [--tp-layers N] [--kv-gib 8] [--out results.md]
smoke test (CPU, gloo): python -m torch.distributed.run --nproc-per-node 2 benchmarks/parallel.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `environments`

# Public configs (Hugging Face Qwen/Qwen3-*/config.json), decoder shapes only: weights are drawn at random.
QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000, rms_norm_eps=1e-6,
             hidden_act="silu", attention_bias=False, head_dim=128, initializer_range=0.02)
SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, tie_word_embeddings=False),
}
GIB = 1 << 30


def random_model(name: str, *, dtype=None, device=None, seed: int = 0, layers: dict[str, int] | None = None):
    """`agentrl.models.load_model` for the names in SHAPES: the model built from its config on `device`, with
    random weights (the same on every rank: one seed), and the byte tokenizer. `layers`: depths overriding a
    shape's own."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from agentrl.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    shape = {**SHAPES[name], **({"num_hidden_layers": layers[name]} if layers and name in layers else {})}
    config = Qwen3Config(**QWEN3, **shape, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
        torch.manual_seed(seed)
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.bfloat16)
    return model, tok


def install_test_doubles(layers: dict[str, int]) -> None:
    """Random models by name, and a reward random weights can earn (see the module docstring)."""
    import environments.gsm8k_math as gsm8k
    from agentrl import models

    load = models.load_model

    def load_model(name, **kwargs):
        return random_model(name, layers=layers, **kwargs) if name in SHAPES else load(name, **kwargs)

    models.load_model = load_model

    def character_reward(self, episode):
        return {"correct": (sum(map(ord, gsm8k.final_answer_text(episode))) % 7) / 6, "format": 0.0}

    gsm8k.GSM8KMathEnv.reward = character_reward


# ------------------------------------------------------------------------------------------------ one layout


@dataclass
class Result:
    name: str
    replicas: int
    steps: list[dict] = field(default_factory=list)
    peak_gib: list[float] = field(default_factory=list)  # this rank's GPU
    identical: bool | None = None
    params: int = 0
    dtype: str = ""
    error: str | None = None

    def mean(self, key: str) -> float:
        values = [s[key] for s in self.steps if key in s]
        return sum(values) / len(values) if values else float("nan")


def single_process_mesh(device: torch.device):
    """A mesh of this process alone (the others wait): `ParallelRun` over it never communicates."""
    from agentrl.parallel.mesh import Mesh

    return Mesh(rank=0, world_size=1, local_rank=device.index or 0, tp_size=1, n_replicas=1, tp_rank=0, replica=0,
                device=device)


def train_config(args, model: str, tp_size: int, big: bool):
    """The run every layout takes (nothing is written to its run dir: the layouts step it, never `train`)."""
    from agentrl.run.config import TrainConfig

    kv = args.kv_gib * GIB if torch.cuda.is_available() else 64 << 20
    return TrainConfig.from_dict({
        "steps": args.warmup + args.steps, "seed": 0,
        "env": {"name": "gsm8k_math"},
        "model": {"name": model, "gradient_checkpointing": big},
        "rollout": {"group_size": args.group_size, "groups_per_step": args.groups, "max_turns": 1,
                    "max_new_tokens": args.new_tokens, "max_sample_tokens": 2048,
                    "rollouts_in_flight": args.groups * args.group_size},
        "engine": {"kv_memory_bytes": kv},
        "checkpoint": {"run_dir": "runs/benchmark-parallel", "save_every": 0},
        "parallel": {"tp_size": tp_size, "weight_check_every": 0},
    })


def run_layout(name: str, cfg, parallel, args) -> Result:
    """Build the run, take `warmup + steps` steps, measure the last `steps`; on this rank's share of the world."""
    from agentrl.run.build import build_run, start, step, stop

    result = Result(name, parallel.mesh.n_replicas)
    cuda = torch.cuda.is_available()
    run = None
    try:
        run = build_run(cfg, None, parallel)
        result.params = sum(p.numel() for p in run.model.parameters())  # a DTensor counts its whole tensor
        result.dtype = str(next(run.model.parameters()).dtype).removeprefix("torch.")
        start(run)
        for index in range(args.warmup + args.steps):
            if cuda and index == args.warmup:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()  # the steady state, not building the model
            metrics = step(run)
            if index >= args.warmup:
                result.steps.append(metrics)
        if parallel.mesh.n_replicas > 1:
            parallel.check_weights(run.model, run.steps_done, force=True)  # raises on a mismatch
            result.identical = True
        if cuda:
            result.peak_gib = [torch.cuda.max_memory_allocated() / GIB]
    except torch.cuda.OutOfMemoryError as exc:
        result.error = "out of memory " + where(run) + ": " + str(exc).splitlines()[0]
    finally:
        if run is not None:
            stop(run)
        del run
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return result


def where(run) -> str:
    if run is None:
        return "building the run"
    return f"in step {run.steps_done + 1}"


# ------------------------------------------------------------------------------------------------- the world


def world_barrier() -> None:
    flag = torch.zeros(1)  # on the host: gloo, beside NCCL, whatever a phase takes
    dist.all_reduce(flag)


def gather_peaks(result: Result | None, world: int) -> list:
    """Every rank's peak memory (None where a rank sat a phase out), on every rank."""
    out = [None] * world
    dist.all_gather_object(out, result.peak_gib[0] if result is not None and result.peak_gib else None)
    return out


def alone(name: str, cfg, args) -> Result | None:
    """Rank 0 runs the layout by itself; the others wait."""
    from agentrl.run.distributed import ParallelRun

    result = None
    if dist.get_rank() == 0:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        result = run_layout(name, cfg, ParallelRun(single_process_mesh(device), cfg), args)
    world_barrier()
    return result


def together(name: str, cfg, args) -> Result:
    from agentrl.parallel import init_mesh
    from agentrl.run.distributed import ParallelRun

    return run_layout(name, cfg, ParallelRun(init_mesh(cfg.parallel), cfg), args)


# ---------------------------------------------------------------------------------------------------- tables


def fmt(value: float, digits: int = 0) -> str:
    return "–" if value != value else f"{value:,.{digits}f}"


def peaks(values: list) -> str:
    shown = [f"{v:.1f}" for v in values if v is not None]
    return ", ".join(shown) if shown else "–"


def row(result: Result, peak: list) -> str:
    if result.error:
        return f"| {result.name} | {result.error} | | | | | {peaks(peak)} |"
    identical = {None: "–", True: "yes", False: "no"}[result.identical]
    imbalance = fmt(result.mean("parallel/imbalance"), 3) if result.replicas > 1 else "–"
    return (f"| {result.name} | {fmt(result.mean('seconds'), 2)} | {fmt(result.mean('trained_tokens_per_s'))} | "
            f"{fmt(result.mean('generated_tokens_per_s'))} | {imbalance} | {identical} | {peaks(peak)} |")


HEADER = ("| layout | s/step | trained tok/s | generated tok/s | imbalance | weights identical | peak GiB per GPU |\n"
          "|---|---|---|---|---|---|---|")


def describe(args, model: str, result: Result) -> str:
    size = f"{result.params / 1e9:.2f}B" if result.params >= 1e8 else f"{result.params / 1e6:.2f}M"
    layers = f", {args.layers[model]} layers" if model in args.layers else ""
    return (f"{model}{layers} ({size} params, random {result.dtype or '?'} weights), gsm8k_math, {args.groups} "
            f"groups x {args.group_size} per step, {args.new_tokens} new tokens, mean of {args.steps} steps after "
            f"{args.warmup} warm-up")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--kv-gib", type=float, default=8.0, help="KV pool per GPU")
    parser.add_argument("--replica-model", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--tp-model", default="qwen3-14b", choices=sorted(SHAPES))
    parser.add_argument("--tp-layers", type=int, default=None, help="decoder layers of the tp model (its own: 40)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here (Markdown)")
    parser.add_argument("--smoke", action="store_true", help="CPU/gloo: tiny-qwen3 and a few tokens, every phase")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        parser.error("launch on two processes: torchrun --nproc-per-node 2 benchmarks/parallel.py ...")
    if args.smoke:
        args.steps, args.warmup, args.groups, args.group_size, args.new_tokens = 1, 1, 2, 2, 8
        args.replica_model = args.tp_model = "tiny-qwen3"
    args.layers = {args.tp_model: args.tp_layers} if args.tp_layers else {}
    torch.set_num_threads(max(1, torch.get_num_threads() // 2) if not torch.cuda.is_available() else 1)
    install_test_doubles(args.layers)
    from agentrl.parallel import init_mesh
    from agentrl.parallel.config import ParallelConfig

    init_mesh(ParallelConfig())  # the process group every phase's mesh is built over
    rank, world = dist.get_rank(), dist.get_world_size()

    single = "one GPU" if torch.cuda.is_available() else "one process"
    tables = []
    one = alone(single, train_config(args, args.replica_model, 1, big=False), args)
    one_peak = gather_peaks(one, world)
    replicas = together("replicas=2", train_config(args, args.replica_model, 1, big=False), args)
    replicas_peak = gather_peaks(replicas, world)
    if rank == 0:
        tables.append(f"### replicas=2 vs {single}: {describe(args, args.replica_model, replicas)}\n\n{HEADER}\n"
                      f"{row(one, one_peak)}\n{row(replicas, replicas_peak)}")

    big = not args.smoke  # activation checkpointing for the large model
    tp = together("tp=2", train_config(args, args.tp_model, 2, big=big), args)
    tp_peak = gather_peaks(tp, world)
    one_big = alone(single, train_config(args, args.tp_model, 1, big=big), args)
    one_big_peak = gather_peaks(one_big, world)
    if rank == 0:
        tables.append(f"### tp=2 vs {single}: {describe(args, args.tp_model, tp)}\n\n{HEADER}\n"
                      f"{row(tp, tp_peak)}\n{row(one_big, one_big_peak)}")
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
        text = f"## benchmarks/parallel.py on 2 x {device}, {time.strftime('%Y-%m-%d')}\n\n" + "\n\n".join(tables)
        print(text, flush=True)
        if args.out is not None:
            args.out.write_text(text + "\n")
    world_barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
