"""`agentrl train` on one rank of a launch by `python -m torch.distributed.run`, with what the tests need around it.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/parallel/train_worker.py OUT \
        [--late-rank R] -- gsm8k_math --model tiny-qwen3 ...

- the GSM8K reward becomes a function of the answer's characters, so a tiny random model's rollouts differ in
  reward and the steps move the weights (the real reward is 0 for all of them);
- `--late-rank R`: rank R starts each rollout 0.2 s late, so its replica finishes its part of a step last;
- after the run each rank writes `OUT/rank<R>.json`: its exit code, replica, tp rank and a SHA-256 of its local
  parameter bytes (its tp slice), which replicas must share.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `environments`

import environments.gsm8k_math as gsm8k  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from agentrl import cli  # noqa: E402
from agentrl.parallel.process_exit import exit_process  # noqa: E402
from agentrl.run import train  # noqa: E402


def character_reward(self, episode):
    return {"correct": (sum(map(ord, gsm8k.final_answer_text(episode))) % 7) / 6, "format": 0.0}


def weights_sha256(model) -> str:
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        local = p.detach().to_local() if isinstance(p, DTensor) else p.detach()
        digest.update(name.encode())
        digest.update(local.contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--late-rank", type=int, default=None)
    args, rest = parser.parse_known_args()
    argv = rest[1:] if rest[:1] == ["--"] else rest
    rank = int(os.environ["RANK"])

    gsm8k.GSM8KMathEnv.reward = character_reward
    if args.late_rank == rank:
        start = gsm8k.GSM8KMathEnv.start

        def late_start(self, sample):
            time.sleep(0.2)
            return start(self, sample)

        gsm8k.GSM8KMathEnv.start = late_start
    runs = []
    build_run = train.build_run

    def keep(*a, **k):
        runs.append(build_run(*a, **k))
        return runs[-1]

    train.build_run = keep
    try:
        code = cli.main(["train", *argv])
    except BaseException as exc:  # recorded, then raised: the launcher's exit code says a rank failed
        record(args.out, rank, runs, error=f"{type(exc).__name__}: {exc}")
        raise
    record(args.out, rank, runs, code=code)
    return code


def record(out: Path, rank: int, runs: list, *, code: int | None = None, error: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result = {"rank": rank, "code": code, "error": error}
    if runs:
        run = runs[-1]
        mesh = run.parallel.mesh if run.parallel is not None else None
        result.update(replica=mesh.replica if mesh else 0, tp_rank=mesh.tp_rank if mesh else 0,
                      sha256=weights_sha256(run.model), steps_done=run.steps_done,
                      engine_steps=run.engine.stats.steps)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    exit_process(main())
