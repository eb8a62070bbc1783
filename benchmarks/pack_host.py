"""Host cost of packing a step's samples, alone and beside a thread that holds the GIL (CPU).

In a training run the trainer packs a step's rollouts on the host while the engine's thread steps beside it in the
same process. A packing loop that calls torch on small slices lets go of the GIL at every call and must win it back
from that thread, which can hold it for a whole switch interval (5 ms). On the H200 `vs_trl.py` measured a median
of 72 ms to pack 64 SmolLM2 rollouts in the run, against single-digit milliseconds for the same work alone.

Shapes: `gsm8k` (the vs_trl configuration: 8 groups x 8 members, prompts of 200-320 tokens, completions of 40-128)
and `hotpotqa` (8 x 8, prompts of ~1.1k tokens, completions of ~400 with tool results). Rows: `pack_samples` and
`pack_shared` (prefix-shared, the default for dense models), each alone and beside a busy thread: a pure-Python loop
with a small torch call now and then, the worst case of an engine thread that never waits on the GPU. Prints the
median ms of `--repeats` packs per row.

usage: python benchmarks/pack_host.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import torch

from agentrl.sample import TrainingSample
from agentrl.train.pack import pack_samples
from agentrl.train.prefix_pack import pack_shared, plan_units

SHAPES = {"gsm8k": ((200, 320), (40, 129)), "hotpotqa": ((1000, 1200), (300, 500))}


def make_samples(shape: str, seed: int = 0) -> list[TrainingSample]:
    (p_lo, p_hi), (c_lo, c_hi) = SHAPES[shape]
    rng, out = random.Random(seed), []
    for group in range(8):
        prompt = [rng.randrange(49_000) for _ in range(rng.randrange(p_lo, p_hi))]
        for _ in range(8):
            n = rng.randrange(c_lo, c_hi)
            out.append(TrainingSample(prompt + [rng.randrange(49_000) for _ in range(n)],
                                      [0] * len(prompt) + [1] * n, [0.0] * len(prompt) + [-1.0] * n,
                                      [-1] * len(prompt) + [3] * n, advantage=rng.random() - 0.5, group_id=group))
    return out


class BusyThread:
    """Python work between small torch calls, never waiting: holds the GIL but for the forced switches."""

    def __enter__(self):
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        x = torch.zeros(64)
        while not self._stop:
            for _ in range(50):
                sum(range(200))
            x.add_(1)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; median ms of {args.repeats} packs\n")
    print("| shape | packing | tokens | alone, ms | beside a busy thread, ms |")
    print("|---|---|---:|---:|---:|")
    for shape in SHAPES:
        samples = make_samples(shape)
        tokens = sum(len(s) for s in samples)
        rows = {"pack_samples": lambda: pack_samples(samples, 8192, pad_to_multiple=64),
                "pack_shared": lambda: pack_shared(samples, 8192, pad_to_multiple=64,
                                                   units=plan_units(samples, 8192))}
        for name, fn in rows.items():
            alone = median_ms(fn, args.repeats)
            with BusyThread():
                beside = median_ms(fn, args.repeats)
            print(f"| {shape} | {name} | {tokens:,} | {alone:.1f} | {beside:.1f} |", flush=True)


if __name__ == "__main__":
    main()
