"""Host cost of resubmitting long conversations, on the CPU: the engine's own bookkeeping, not the model's.

A one-layer, 32-wide Qwen3 (vocab 1000) makes the forward nearly free, so what is timed is admission (page keys,
prefix-cache matching), scheduling, registration of full pages and the collector's pauses. 256 requests of 1,024
tokens → 8, then each resubmitted with its output + 64 new tokens → 8 (turn 2), then once more (turn 3). Prints
each turn's seconds and the garbage collector's pauses by generation during it.

usage: python benchmarks/engine_host_cpu.py [--requests 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch


def collector_pauses():
    """A gc callback recording (generation, seconds) of every collection; returns it and the list it fills."""
    pauses, started = [], [0.0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(callback)
    return callback, pauses


def run(n: int, seed: int) -> list[tuple[str, float, dict]]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from agentrl.engine import Engine, EngineConfig, SamplingParams

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=1000, max_position_embeddings=4096)
    model = Qwen3ForCausalLM(cfg).eval()
    plen, gen, tool = 1024, 8, 64
    rng = random.Random(seed)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(plen)] for _ in range(n)]
    tools = [[rng.randrange(cfg.vocab_size) for _ in range(tool)] for _ in range(n)]
    sampling = SamplingParams(max_new_tokens=gen, temperature=0.0, ignore_eos=True)
    engine = Engine(model, EngineConfig(max_num_seqs=n, max_model_len=plen + 3 * gen + 2 * tool + 64,
                                        max_tokens_per_step=8192, num_pages=n * 90))
    callback, pauses = collector_pauses()
    rows, history = [], prompts
    for turn in (1, 2, 3):
        pauses.clear()
        t = time.perf_counter()
        outs = engine.generate(history, sampling)
        seconds = time.perf_counter() - t
        by_gen: dict = {}
        for g, s in pauses:
            by_gen[g] = by_gen.get(g, 0.0) + s
        rows.append((f"turn {turn}", seconds, by_gen))
        history = [h + o.token_ids + new for h, o, new in zip(history, outs, tools)]
    gc.callbacks.remove(callback)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{'repeat':<7} {'turn':<7} {'seconds':>8} {'gc gen0 s':>10} {'gc gen1 s':>10} {'gc gen2 s':>10}")
    for r in range(args.repeats):
        for name, seconds, by_gen in run(args.requests, seed=r):
            print(f"{r:<7} {name:<7} {seconds:>8.3f} " + " ".join(f"{by_gen.get(g, 0.0):>10.3f}" for g in range(3)))


if __name__ == "__main__":
    main()
