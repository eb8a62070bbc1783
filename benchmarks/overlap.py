"""The RL step's two threads on one GPU: the engine decoding in the background while the trainer steps, as in
`agentrl train`, without an environment or files (random weights, random prompts), so the contention between them
is measured on its own.

Model: SmolLM2-135M's shape (`benchmarks/train_step.py`), bf16 on CUDA (fp32 on the CPU), trainer built as
`agentrl train` builds it with default options (compiled decoder layers and their CUDA graphs on CUDA, captured
with the engine paused). Each step takes 8 groups of 8
completions (a 320-token prompt per group, <= 128 new tokens, temperature 1.0), as `benchmarks/vs_trl.py`'s step,
while the engine keeps `--in-flight` rollouts decoding (whole groups are resubmitted as soon as a step takes its
groups); the update runs under `Engine.pause()` and bumps the policy version, as a run's does.

Rows (`--rows`), each a question about why a trainer step beside the engine is slower than alone:
- `alone`: the trainer step on such samples, the engine stopped;
- `generate`: the engine alone, each step's groups taken and not trained on: the floor generation sets;
- `shared`: the loop as a run has it, one CUDA stream for both threads;
- `separate`: the engine on its own stream (`engine.separate_stream`): does their GPU queue serialise them?
- `switch`: one stream, Python's thread switch interval at 0.5 ms instead of 5: does the trainer thread wait for the
  GIL after each blocking call while the engine thread holds it?
- `paused`: the engine held in `pause()` through every trainer step: the trainer alone again, with generation no
  longer overlapping it (what a step costs when nothing runs beside the trainer);
- `plain`: one stream, the engine's step lock without its queue (as before `agentrl/engine/step_lock.py`): does the
  trainer wait for the lock (its optimizer step's `pause()`, the stats it reads) while the engine re-takes it?
Per row: s/step (median after `--warmup` steps), the median wait for a step's groups, the median trainer step, the
median time the trainer's thread waited for the engine's lock in a step, the engine steps run during the measured
trainer steps per trainer step, and generated tokens/s.

usage: python benchmarks/overlap.py [--steps 10] [--warmup 3] [--in-flight 128] [--rows-per-micro-batch 1]
                                   [--rows shared,generate,plain,separate,alone,switch,paused]
CPU smoke: python benchmarks/overlap.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import queue
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `benchmarks` and `agentrl`

from agentrl.engine.step_lock import StepLock  # noqa: E402
from benchmarks.train_step import default_trainer, device, shaped_model, synchronize  # noqa: E402

GROUP, GROUPS_PER_STEP, PROMPT, NEW = 8, 8, 320, 128


def tiny_model(on: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=512, max_position_embeddings=2048, eos_token_id=2,
                      pad_token_id=2, bos_token_id=1)
    with torch.device(on):
        return LlamaForCausalLM(cfg)


def sample_of(prompt: list[int], completion, advantage: float, group: int):
    from agentrl.sample import TrainingSample

    n = len(completion.token_ids)
    context = len(prompt)
    return TrainingSample(prompt + completion.token_ids, [0] * context + [1] * n,
                          [0.0] * context + list(completion.logprobs), [-1] * context + list(completion.versions),
                          advantage=advantage, group_id=group)


class Rollouts:
    """Whole groups kept decoding in the background engine; `take()` returns a step's finished groups as samples."""

    def __init__(self, engine, in_flight: int, vocab: int, new_tokens: int, prompt_tokens: int):
        self.engine, self.vocab, self.new, self.prompt_tokens = engine, vocab, new_tokens, prompt_tokens
        self.rng = random.Random(0)
        self.done: queue.Queue = queue.Queue()
        self.pending: dict[int, list] = {}  # group -> finished completions
        self.prompts: dict[int, list[int]] = {}
        self.next_group = 0
        for _ in range(max(1, in_flight // GROUP)):
            self.submit_group()

    def submit_group(self) -> None:
        from agentrl.engine import SamplingParams

        g, self.next_group = self.next_group, self.next_group + 1
        prompt = [self.rng.randrange(3, self.vocab) for _ in range(self.prompt_tokens)]
        self.prompts[g], self.pending[g] = prompt, []
        for i in range(GROUP):
            params = SamplingParams(max_new_tokens=self.new, temperature=1.0, seed=g * GROUP + i)
            self.engine.submit(prompt, params, callback=lambda c, g=g: self.done.put((g, c)))

    def take(self, groups: int) -> list:
        ready: list[int] = []
        while len(ready) < groups:
            self.engine.check()
            try:
                g, completion = self.done.get(timeout=1.0)
            except queue.Empty:
                continue
            self.pending[g].append(completion)
            if len(self.pending[g]) == GROUP:
                ready.append(g)
        samples = []
        for g in ready:
            for c in self.pending.pop(g):
                samples.append(sample_of(self.prompts[g], c, self.rng.choice([-1.0, 1.0]), g))
            del self.prompts[g]
            self.submit_group()
        return samples


class PlainStepLock(StepLock):
    """The engine's lock as it was: waiters from outside get no turn ahead of the engine thread's next step."""

    def yield_to_outside(self, timeout: float = 1.0) -> None:
        pass


def run_loop(model, trainer, separate: bool, args, pause_engine: bool = False, plain_lock: bool = False,
             train: bool = True) -> dict:
    from agentrl.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(max_num_seqs=max(args.in_flight, 1), max_model_len=args.prompt + args.new + 16,
                                        separate_stream=separate, compile=False, seed=0))
    if plain_lock:
        engine._lock = PlainStepLock()
    engine.start()
    if trainer.graphs is not None:  # as the run wires it: the engine paused while the trainer captures a graph
        trainer.graphs.guard = engine.pause
    rollouts = Rollouts(engine, args.in_flight, model.config.vocab_size, args.new, args.prompt)

    @contextlib.contextmanager
    def guard():  # the run's update guard (`agentrl.run.build.step`): no decode step sees half an update
        with engine.pause():
            yield
            engine.bump_version()

    seconds, waits, trains, generated, beside, lock_waits = [], [], [], [], [], []
    try:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            samples = rollouts.take(GROUPS_PER_STEP)
            before = engine.stats
            t1 = time.perf_counter()
            if train:
                with engine.pause() if pause_engine else engine.beside():
                    trainer.step(samples, engine.policy_version, guard=guard)
                    synchronize()
            t2 = time.perf_counter()
            after = engine.stats
            seconds.append(t2 - t0)
            waits.append(t1 - t0)
            trains.append(t2 - t1)
            beside.append(after.steps - before.steps)
            lock_waits.append(after.pause_wait_seconds - before.pause_wait_seconds)
            generated.append(sum(sum(s.trainable) for s in samples))
    finally:
        engine.stop()
    return {**summary(seconds, waits, trains, generated, args.warmup),
            "beside": statistics.median(beside[args.warmup:] or beside),
            "lock wait": statistics.median(lock_waits[args.warmup:] or lock_waits)}


def trainer_alone(model, trainer, args) -> dict:
    """The trainer step on one step's worth of samples from an engine that is then stopped: nothing beside it."""
    from agentrl.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(max_num_seqs=GROUP * GROUPS_PER_STEP, max_model_len=args.prompt + args.new + 16,
                                        compile=False, seed=0))
    engine.start()
    rollouts = Rollouts(engine, GROUP * GROUPS_PER_STEP, model.config.vocab_size, args.new, args.prompt)
    samples = rollouts.take(GROUPS_PER_STEP)
    engine.stop()
    seconds = []
    for _ in range(args.steps):
        t = time.perf_counter()
        trainer.step(samples, 0)
        synchronize()
        seconds.append(time.perf_counter() - t)
    generated = sum(sum(s.trainable) for s in samples)
    return {**summary(seconds, [0.0] * len(seconds), seconds, [generated] * len(seconds), args.warmup),
            "beside": 0, "lock wait": 0.0}


def summary(seconds, waits, trains, generated, warmup: int) -> dict:
    skip = warmup if len(seconds) > warmup else 0
    return {"s/step": statistics.median(seconds[skip:]), "wait": statistics.median(waits[skip:]),
            "train": statistics.median(trains[skip:]),
            "gen tok/s": sum(generated[skip:]) / max(sum(seconds[skip:]), 1e-9)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=128)
    ap.add_argument("--rows-per-micro-batch", type=int, default=None)
    ap.add_argument("--rows", default="shared,generate,plain,separate,alone,switch,paused",
                    help="comma list of alone, generate, shared, plain, separate, switch, paused")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, few tokens: checks the script runs")
    args = ap.parse_args(argv)
    on = device()
    args.prompt, args.new = (16, 8) if args.smoke else (PROMPT, NEW)
    model = tiny_model(on) if args.smoke else shaped_model("smollm2", on)
    trainer, line = default_trainer(model)
    if args.rows_per_micro_batch:
        trainer.config = dataclasses.replace(trainer.config, rows_per_micro_batch=args.rows_per_micro_batch)
    name = torch.cuda.get_device_name() if on == "cuda" else "CPU"
    print(f"{'tiny' if args.smoke else 'SmolLM2-135M'}-shaped model on {name}; {line}", flush=True)
    rows = []
    for row in [r.strip() for r in args.rows.split(",") if r.strip()]:
        if row == "alone":
            rows.append(("trainer alone (engine stopped)", trainer_alone(model, trainer, args)))
        elif row in ("shared", "separate", "paused"):
            label = {"shared": "engine + trainer, one stream", "separate": "engine + trainer, the engine's own stream",
                     "paused": "engine + trainer, the engine paused during each trainer step"}[row]
            rows.append((label, run_loop(model, trainer, row == "separate", args, pause_engine=row == "paused")))
        elif row == "generate":
            rows.append(("the engine alone, a step's groups taken and not trained on (generation's floor)",
                         run_loop(model, trainer, False, args, train=False)))
        elif row == "plain":
            rows.append(("engine + trainer, one stream, the engine's lock without its queue (before)",
                         run_loop(model, trainer, False, args, plain_lock=True)))
        elif row == "switch":
            interval = sys.getswitchinterval()
            sys.setswitchinterval(0.0005)
            try:
                rows.append(("engine + trainer, one stream, thread switch interval 0.5 ms",
                             run_loop(model, trainer, False, args)))
            finally:
                sys.setswitchinterval(interval)
        else:
            raise SystemExit(f"--rows: unknown {row!r}; choose from alone, generate, shared, plain, separate, switch, "
                             "paused")
        m = rows[-1][1]
        print(f"  {rows[-1][0]}: {m['s/step']:.3f} s/step, wait {m['wait']:.3f}, train {m['train']:.3f}", flush=True)
    print(f"\n{GROUPS_PER_STEP} groups x {GROUP} a step, prompt {args.prompt}, <= {args.new} new tokens, "
          f"{args.in_flight} in flight; medians over steps {args.warmup + 1}-{args.steps}\n")
    print("| row | s/step | wait for groups s | trainer step s | its wait for the engine's lock s "
          "| engine steps beside it | generated tok/s |\n|---|---|---|---|---|---|---|")
    for label, m in rows:
        print(f"| {label} | {m['s/step']:.3f} | {m['wait']:.3f} | {m['train']:.3f} | {m['lock wait']:.3f} "
              f"| {m['beside']:.0f} | {m['gen tok/s']:,.0f} |")


if __name__ == "__main__":
    main()
