"""Which trainer steps compile, and why: the default trainer over steps of changing shapes, one line a step.

A compile after the first step makes that step many times slower than the rest (the 200-step GPU test's bound).
This runs the trainer `agentrl train` builds with default options (`benchmarks.train_step.default_trainer`: varlen
attention, compiled layers, CUDA graphs per shape bucket, compiled lm_head chunks) on gsm8k_math-shaped steps whose
token counts change every step, and prints for each step its seconds, the frames dynamo compiled, and the graph
buckets run eagerly or captured; dynamo's recompile reasons go to stderr (`TORCH_LOGS=recompiles` is set here).
No rollouts and no engine: the trainer alone, so a compile in a later step is the trainer's own.

On the CPU (no CUDA), `--like-gpu` builds the GPU's path instead of the CPU default: the flat layout through the
per-segment reference kernel, compiled layers, compiled lm_head chunks, and the graph buckets through the stand-in
capture, all compiled with aot_eager (dynamo's guards, no C++ toolchain). That is how two recompiles after the
first step were found and fixed on 2026-12-01 (a capture's static copies at storage offset 0, a one-row lm_head
chunk). Its seconds mean nothing; the frames do.

usage: python benchmarks/trainer_recompiles.py [--steps 15] [--tokens 28000] [--model-shape smollm2|qwen3-0.6b]
                                              [--scored-groups 0.125]
       python benchmarks/trainer_recompiles.py --like-gpu --model-shape tiny --tokens 2600   # on the CPU
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_LOGS", "recompiles")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `benchmarks` and `agentrl`

import torch  # noqa: E402


def like_gpu_trainer(row_tokens: int):
    """The GPU default's trainer path on the CPU, around tiny-qwen3."""
    from agentrl.engine.model_view import compile_decoder_layers
    from agentrl.models import load_model
    from agentrl.run.build import TRAINER_COMPILE
    from agentrl.train import lm_head, logprobs, varlen_attention as va
    from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig
    from agentrl.train.flat_graphs import FlatGraphs, stand_in_capture
    from agentrl.train.trainer import Trainer

    model, _ = load_model("tiny-qwen3")
    model.set_attn_implementation(va.register("agentrl_varlen_reference", va.reference_kernel))
    model.train()
    # aot_eager: dynamo's guards (what recompiles on every backend) without inductor's C++ codegen, whose own
    # size-range guards exist on the CPU only
    compile_decoder_layers(model, **TRAINER_COMPILE, backend="aot_eager")
    lm_head._COMPILED["steps"] = lm_head.compile_chunk_steps(backend="aot_eager")
    head, fused = lm_head.ChunkedLMHead.apply, lm_head.ChunkedHeadLoss.apply  # compiled chunk steps, as on CUDA
    lm_head.ChunkedLMHead.apply = lambda hidden, weight, targets, temp, chunk, _: head(hidden, weight, targets,
                                                                                       temp, chunk, True)
    lm_head.ChunkedHeadLoss.apply = lambda hidden, weight, targets, temp, chunk, _, loss: fused(
        hidden, weight, targets, temp, chunk, True, loss)
    config = TrainerConfig(row_tokens=row_tokens)
    trainer = Trainer(model, config, LossConfig(), OptimConfig(lr=1e-6), total_steps=100)
    trainer.pad_multiple = config.row_pad_multiple
    trainer.graphs = FlatGraphs(logprobs._decoder(model), pad_multiple=trainer.pad_multiple, row_tokens=row_tokens,
                                capture=stand_in_capture)
    return trainer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=28000, help="tokens a step, about (gsm8k_math's shape)")
    ap.add_argument("--model-shape", choices=("smollm2", "qwen3-0.6b", "tiny"), default="smollm2")
    ap.add_argument("--like-gpu", action="store_true", help="on the CPU: the GPU default's path (see the docstring)")
    ap.add_argument("--scored-groups", type=float, default=1.0,
                    help="share of groups whose members scored differently; the rest get advantage 0, which the "
                         "trainer leaves out (the untrained SmolLM2 on gsm8k_math, mean reward ≈ 0.015 a rollout in "
                         "vs_trl.py: at most about 1 group in 8)")
    args = ap.parse_args()

    from torch._dynamo.utils import counters

    from benchmarks.train_step import default_trainer, device, make_gsm8k_samples, shaped_model

    if args.like_gpu:
        trainer = like_gpu_trainer(row_tokens=2048)
        prompt_tokens = 60
    else:
        trainer, line = default_trainer(shaped_model(args.model_shape, device()))
        print(line)
        prompt_tokens = 320
    vocab = trainer.model.config.vocab_size
    print(f"{'step':>4} {'seconds':>8} {'frames':>6} {'eager':>5} {'captured':>8} {'computed tokens':>15}")
    late = []
    for step in range(1, args.steps + 1):
        samples = make_gsm8k_samples(args.tokens, vocab, seed=step, prompt_tokens=prompt_tokens)
        scored = random.Random(step)
        alike = {g for g in {s.group_id for s in samples} if scored.random() >= args.scored_groups}
        for s in samples:
            if s.group_id in alike:
                s.advantage = 0.0
        before = counters["frames"]["ok"]
        start = time.perf_counter()
        m = trainer.step(samples, policy_version=0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        frames = counters["frames"]["ok"] - before
        if step > 1 and frames:
            late.append(step)
        print(f"{step:>4} {time.perf_counter() - start:>8.3f} {frames:>6} {m.get('flat_graphs_eager', '-'):>5} "
              f"{m.get('flat_graphs_captured', '-'):>8} {m['computed_tokens']:>15,}", flush=True)
    print(f"steps after the first that compiled: {late or 'none'}")


if __name__ == "__main__":
    main()
