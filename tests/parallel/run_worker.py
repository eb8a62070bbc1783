"""The run's replica update (`agentrl.run.distributed.ParallelRun`) on one rank of a launch by
`python -m torch.distributed.run` (gloo, CPU), beside the single-process reference every rank also computes.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/parallel/run_worker.py OUT

Writes `OUT/rank<R>.json`:
- three steps through `ParallelRun.train` (the first with one sample for two replicas, so replica 1 trains nothing
  and still joins the gradient sum; the second with several, one of advantage 0; the third with nothing but
  advantage 0) against one `Trainer` on the same samples: the largest parameter difference, both grad norms and
  losses, the samples left out;
- a replica nudged off the others: the message `check_weights` raised on this rank (every rank must raise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `tests.*` imports

from agentrl.models import load_model  # noqa: E402
from agentrl.parallel import ParallelConfig, ReplicaDivergence, exit_process, init_mesh  # noqa: E402
from agentrl.run.config import TrainConfig  # noqa: E402
from agentrl.run.distributed import ParallelRun  # noqa: E402
from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig  # noqa: E402
from agentrl.train.trainer import Trainer  # noqa: E402
from tests.helpers import train_samples  # noqa: E402

TRAINER = TrainerConfig(row_tokens=64)
LOSS = LossConfig(type="grpo", tis_cap=None)
# eps large enough that the last bits of a gradient summed in another order do not move Adam's first update by
# a visible fraction of lr (see tests/parallel/worker.py).
OPTIM = OptimConfig(lr=1e-3, eps=1e-4, warmup_steps=0, max_grad_norm=1.0)
# One sample (advantage 1) for two replicas, then five (advantages 0..4) of mixed lengths, the one of advantage 0
# left out of the forward, then three that all scored alike (advantage 0): no forward anywhere, an update all the same.
STEPS = [train_samples(320, [5, 20], seed=1)[1:], train_samples(320, [9, 30, 14, 22, 7], seed=2),
         [dataclasses.replace(s, advantage=0.0) for s in train_samples(320, [12, 8, 17], seed=3)]]


def trainer_for(model) -> Trainer:
    return Trainer(model, TRAINER, LOSS, OPTIM, total_steps=len(STEPS))


def pooled_steps(parallel: ParallelRun) -> dict:
    model = load_model("tiny-qwen3", seed=parallel.mesh.replica)[0].train()  # replica 1 starts elsewhere: broadcast
    parallel.prepare_model(model)
    trainer = trainer_for(model)
    parallel.prepare_trainer(trainer, OPTIM, len(STEPS))
    reference = load_model("tiny-qwen3", seed=0)[0].train()
    single = trainer_for(reference)
    out = {"steps": []}
    for version, samples in enumerate(STEPS):
        got = parallel.train(trainer, samples, version, contextlib.nullcontext)
        want = single.step(samples, version)
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        out["steps"].append({"param_diff": diff, "grad_norm": [got["grad_norm"], want["grad_norm"]],
                             "loss": [got["loss"], want["loss"]], "trained_tokens": [got["trained_tokens"],
                                                                                     want["trained_tokens"]],
                             "imbalance": got["parallel/imbalance"],
                             "zero_advantage_samples": [got["zero_advantage_samples"], want["zero_advantage_samples"]]})
    out["changed"] = max((a - b).abs().max().item()
                         for a, b in zip(model.parameters(), load_model("tiny-qwen3", seed=0)[0].parameters()))
    return out


def divergence(parallel: ParallelRun) -> dict:
    model = load_model("tiny-qwen3", seed=0)[0]
    parallel.check_weights(model, 1, force=True)  # the same weights everywhere: passes
    if parallel.mesh.replica == 1:
        with torch.no_grad():
            model.model.norm.weight[0] += 1e-6
    try:
        parallel.check_weights(model, 7, force=True)
        return {"divergence": None}
    except ReplicaDivergence as exc:
        return {"divergence": str(exc)}


def main() -> None:
    out = Path(sys.argv[1])
    cfg = TrainConfig(parallel=ParallelConfig(weight_check_every=1))
    parallel = ParallelRun(init_mesh(cfg.parallel), cfg)
    result = {"replica": parallel.mesh.replica, **pooled_steps(parallel), **divergence(parallel)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{parallel.mesh.rank}.json").write_text(json.dumps(result))
    parallel.close(finished=True)


if __name__ == "__main__":
    main()
    exit_process(0)
