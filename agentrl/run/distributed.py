"""A run on several processes: replicas × tensor parallelism, wired into `build_run`, `step` and `train`.

`agentrl train` launched by torchrun, `accelerate launch` or plain torch.distributed variables (`WORLD_SIZE`,
`RANK`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) splits the world into `WORLD_SIZE // parallel.tp_size` replicas
of `parallel.tp_size` ranks each (`agentrl.parallel.mesh`). A single process never gets here and runs as before.

Each step, on every rank:
- generation, then training, in the main thread: each replica generates its part of the step's groups from its
  own prompts (`ShardedPromptIterator`: every prompt is read once across the world), with the engine stepped by the
  rollout driver's pump only once every live rollout waits on it, taking requests in (group, member) order. Under
  tensor parallelism that is what makes every tp rank step its engine identically and keeps the engine's
  collectives from ever running beside the training step's; replicas without tp alternate the same way;
- the finished groups are exchanged, so every rank holds the same pool; the step takes the oldest and hands the
  samples out longest first to the replica with the least Σ L² (`agentrl.parallel.replicas`);
- each replica trains its share with the loss divided by the pooled batch's denominator, and `ReplicaStepper`
  sums the gradients over the replicas (a replica with no sample contributes zeros) before the clip, the skip
  decision and the `ShardedAdamW` step, which run as one process would, under the engine's pause and version bump;
- every `parallel.weight_check_every` steps and after the last one the replicas compare weight hashes; a mismatch
  stops every rank with `ReplicaDivergence`.

Checkpoints are written together (`agentrl.train.checkpoint.Writers`): rank 0 writes the whole model (gathered
from its tp shards) and the rollout state of every replica, every rank its optimizer shard. A run resumed on the
same mesh continues exactly; on another mesh (or one process) the model and schedule load, the optimizer starts
afresh, and the prompt iterators continue from where the whole world had got to.

Ctrl-C / SIGTERM: the ranks hold a signal until the end of the step, then agree to stop together and save.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from agentrl.parallel import (ReplicaDivergence, SharedPool, ShardedAdamW, apply_tensor_parallel, assign,
                              broadcast_parameters, check_replica_weights, full_state_dict, imbalance, init_mesh,
                              load_full_state_dict, pooled_loss_denominator, reduce_gradients, sum_over_replicas)
from agentrl.parallel.mesh import Mesh, close_mesh
from agentrl.parallel.sharded_adam import shard_filename
from agentrl.rollout import PromptIterator
from agentrl.train.checkpoint import Writers
from agentrl.train.optim import Stepper, build_scheduler
from agentrl.train.trainer import merge_metrics, sample_counts

# Replica r numbers its groups from r * GROUP_IDS: ids (and the turn seeds derived from them) differ across replicas.
GROUP_IDS = 10**9


def launched(cfg) -> bool:
    """Whether this process is one of several (or asked for a split that needs several)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or cfg.parallel.tp_size > 1


def main_process() -> bool:
    """Rank 0 (or a single process): the one that writes files and prints; readable before any process group."""
    return int(os.environ.get("RANK", "0")) == 0


# ------------------------------------------------------------------------------------------------- prompts


class ShardedPromptIterator(PromptIterator):
    """Replica `replica`'s share of every epoch: positions replica, replica + n, ... of the epoch's shuffled order
    (the order one process would read), so each prompt is read by exactly one replica."""

    def __init__(self, dataset, *, replica: int, n_replicas: int, **kwargs):
        if len(dataset) < n_replicas:
            raise ValueError(f"{len(dataset)} prompts for {n_replicas} replicas: each replica needs one at least")
        self.replica, self.n_replicas = replica, n_replicas
        super().__init__(dataset, **kwargs)

    def _epoch_order(self, epoch: int) -> list[int]:
        return super()._epoch_order(epoch)[self.replica::self.n_replicas]


def regroup_prompt_states(states: Sequence[dict], replica: int, n_replicas: int) -> dict:
    """The prompt iterator state of `replica` of `n_replicas` from the states of a run saved with `len(states)`
    replicas (one: a single process): its share starts at the first position of the epoch's order that some old
    replica had not read yet (a few prompts the faster replicas had read beyond it are read again), and the
    prompts drawn but not trained on are shared out round-robin."""
    n_old = len(states)
    epoch = min(s["epoch"] for s in states)
    # Old replica r had read positions r, r + n_old, ... below r + position * n_old of the epoch's order.
    start = min(r + s["position"] * n_old for r, s in enumerate(states) if s["epoch"] == epoch)
    share = len(range(replica, states[0]["size"], n_replicas))
    position = min(max(0, -(-(start - replica) // n_replicas)), share)
    outstanding = [k for s in states for k in s.get("outstanding", [])]
    return {**states[0], "epoch": epoch, "position": position, "outstanding": outstanding[replica::n_replicas]}


def restore_rollout_state(extra: dict, prompts: PromptIterator, driver, replica: int = 0, n_replicas: int = 1) -> None:
    """Put the prompt iterator and the driver where checkpoint `extra` left this replica: exactly, when it was saved
    by as many replicas; else as `regroup_prompt_states` says, with group ids past every old replica's."""
    states = extra.get("replicas") or [{"prompts": extra["prompts"], "driver": extra.get("driver")}]
    if len(states) == n_replicas:
        prompts.load_state_dict(states[replica]["prompts"])
        if states[replica].get("driver") is not None:
            driver.load_state_dict(states[replica]["driver"])
        return
    prompts.load_state_dict(regroup_prompt_states([s["prompts"] for s in states], replica, n_replicas))
    used = [s["driver"]["next_group_id"] - (r * GROUP_IDS if len(states) > 1 else 0)
            for r, s in enumerate(states) if s.get("driver") is not None]
    driver.load_state_dict({"next_group_id": (replica * GROUP_IDS if n_replicas > 1 else 0) + max(used, default=0)})


# --------------------------------------------------------------------------------------------- the update


class ReplicaStepper(Stepper):
    """The end of a step on one replica: this replica's gradients rescaled from its own loss denominator to the
    pooled batch's (`scale`, set before each step), summed over the replicas, then clipped, checked and applied as
    one process would (the gradients, the norm and the loss are the same on every replica, so is the decision)."""

    def __init__(self, model, optimizer, scheduler, cfg, mesh: Mesh):
        super().__init__(model, optimizer, scheduler, cfg)
        self.mesh = mesh
        self.scale = 1.0
        self.pooled_loss = 0.0

    def launch(self, loss: torch.Tensor):
        # Every update goes through here (`Stepper.step` and the trainer's own launch alike), so every rank joins the
        # same collectives in the same order, whether it ran a forward or not.
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scale != 1.0:
            for p in params:
                if p.grad is not None:
                    _local(p.grad).mul_(self.scale)
        reduce_gradients(params, self.mesh)
        self.pooled_loss = sum_over_replicas([float(loss) * self.scale], self.mesh)[0]
        return super().launch(torch.tensor(self.pooled_loss))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def combine_train_metrics(rows: Sequence[dict], pooled_loss: float) -> dict:
    """Every replica's trainer metrics as one step's: counts summed, loss diagnostics token-weighted (extremes
    kept, histograms added), tokens/s over the slowest replica's time."""
    out = dict(rows[0])  # grad_norm, lr, skipped: the same on every replica
    out["loss"] = pooled_loss
    for key in ("trained_tokens", "generated_tokens", "rows", "tokens", "computed_tokens", "prefix_shared_tokens",
                "prefix_tree_shared_tokens"):
        if not any(key in r for r in rows):
            continue
        out[key] = sum(r.get(key, 0) for r in rows)
    out["train_seconds"] = max(r["train_seconds"] for r in rows)
    out["pack_seconds"] = max(r.get("pack_seconds", 0.0) for r in rows)
    out["trained_tokens_per_s"] = out["trained_tokens"] / max(out["train_seconds"], 1e-9)
    for key in [k for k in out if k.startswith("loss/")]:
        del out[key]
    diagnostics = [{**{k[len("loss/"):]: v for k, v in r.items() if k.startswith("loss/")},
                    "tokens": r.get("tokens", 0)} for r in rows]
    out.update({k: v for k, v in merge_metrics(diagnostics).items() if k != "tokens"})
    return out


# ------------------------------------------------------------------------------------------------ the run


class ParallelRun:
    """This process's place in a run of several, and what the run does differently there."""

    def __init__(self, mesh: Mesh, cfg):
        self.mesh, self.cfg = mesh, cfg
        self.pool = SharedPool(mesh)
        self.rounds = 0  # generation rounds so far: the pool's age key, the same on every rank

    @classmethod
    def setup(cls, cfg) -> "ParallelRun | None":
        """The process group and mesh of a launched run; None for a single process."""
        if not launched(cfg):
            return None
        return cls(init_mesh(cfg.parallel), cfg)

    @property
    def is_main(self) -> bool:
        return self.mesh.is_main

    @property
    def device(self) -> str:
        return self.mesh.device.type

    def describe(self) -> str:
        return f"replicas={self.mesh.n_replicas} tp={self.mesh.tp_size}"

    def barrier(self) -> None:
        """Every rank gets here before any goes on (on the host: nothing queues behind the device's work)."""
        flag = torch.zeros(1, device=self.mesh.host_device)
        dist.all_reduce(flag)

    def close(self, finished: bool) -> None:
        """Destroy the process group. A run that `finished` waits for every rank first, so none tears its group
        down while another still talks to it; one leaving on an error cannot wait for ranks that may be gone."""
        if finished:
            self.barrier()
        close_mesh(self.mesh)

    def _gather(self, value) -> list:
        """`value` of every replica (from the ranks holding this rank's tp slice), in replica order."""
        if self.mesh.n_replicas == 1:
            return [value]
        out = [None] * self.mesh.n_replicas
        dist.all_gather_object(out, value, group=self.mesh.replica_group)
        return out

    # -- building -------------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Split the model over the replica's tp ranks and give every replica replica 0's weights: before the
        engine's view, the optimizer or compiled layers see it."""
        apply_tensor_parallel(model, self.mesh)
        broadcast_parameters(model, self.mesh)
        return model

    def prepare_engine(self, engine) -> None:
        """Step the engine on this rank's GPU from whatever thread steps it: the rollout driver's pump runs
        `engine.step` on a thread of its own, whose current CUDA device is 0, and the engine's Triton kernels launch
        on the current device (rank 1's would read its memory from GPU 0)."""
        if self.mesh.device.type != "cuda":
            return
        step, device = engine.step, self.mesh.device

        def step_on_this_device():
            with torch.cuda.device(device):
                return step()

        engine.step = step_on_this_device

    def prompt_iterator(self, dataset, seed: int) -> ShardedPromptIterator:
        return ShardedPromptIterator(dataset, replica=self.mesh.replica, n_replicas=self.mesh.n_replicas, seed=seed)

    def prepare_driver(self, driver) -> None:
        driver.load_state_dict({"next_group_id": self.mesh.replica * GROUP_IDS})

    def prepare_trainer(self, trainer, optim_cfg, total_steps: int) -> None:
        """AdamW with its moments divided between the replicas, and the stepper that sums gradients first."""
        trainer.optimizer = ShardedAdamW.from_adamw(trainer.optimizer, self.mesh)
        trainer.scheduler = build_scheduler(trainer.optimizer, optim_cfg, total_steps)
        trainer.stepper = ReplicaStepper(trainer.model, trainer.optimizer, trainer.scheduler, optim_cfg, self.mesh)

    # -- one step ----------------------------------------------------------------------------------------------
    def groups_to_generate(self, groups_per_step: int) -> int:
        """This replica's part of the step's groups (the first `groups_per_step % replicas` replicas one more)."""
        n, r = self.mesh.n_replicas, self.mesh.replica
        return groups_per_step // n + (r < groups_per_step % n)

    def pool_groups(self, local_groups: Sequence, groups_per_step: int) -> list:
        """Exchange this replica's finished groups for everyone's and take the step's, oldest first: the same
        groups in the same order on every rank."""
        self.pool.exchange(list(local_groups), [float(self.rounds)] * len(local_groups))
        self.rounds += 1
        return self.pool.take_oldest(groups_per_step)

    def train(self, trainer, samples: Sequence, policy_version: int,
              guard: Callable[[], ContextManager]) -> dict:
        """Train this replica's share of the pooled `samples`; returns the whole step's metrics. Only the samples the
        trainer would run are shared out (`Trainer.samples_to_train`), so no replica's share is mostly ones it would
        leave out; the denominator is the whole batch's all the same."""
        if not samples:  # nothing anywhere: fail as one process does, on every rank alike
            return trainer.step(samples, policy_version, guard=guard)
        trained = trainer.samples_to_train(samples)
        lengths = [len(s) for s in trained]
        shares = self._share_out(trained, lengths, trainer)
        mine = [trained[i] for i in shares[self.mesh.replica]]
        pooled = pooled_loss_denominator(samples, trainer.loss_config, policy_version)
        own = pooled_loss_denominator(mine, trainer.loss_config, policy_version) if mine else 0.0
        stepper: ReplicaStepper = trainer.stepper
        stepper.scale = max(own, 1.0) / max(pooled, 1.0)  # the loss clamps its denominator at 1 alike
        if mine:
            metrics = trainer.step(mine, policy_version, guard=guard)
        else:  # no forward, but this replica's (zero) gradients still join the sum and the update
            started = time.perf_counter()
            with guard():
                result = stepper.step(torch.zeros(()))
            metrics = {"loss": 0.0, "grad_norm": result.grad_norm, "lr": result.lr, "skipped": result.skipped,
                       "train_seconds": time.perf_counter() - started, "pack_seconds": 0.0, "trained_tokens": 0,
                       "trained_tokens_per_s": 0.0, "generated_tokens": 0, "rows": 0}
        combined = combine_train_metrics(self._gather(metrics), stepper.pooled_loss)
        combined.update(sample_counts(samples, trained, combined["train_seconds"]))  # the whole batch's counts
        if not trained:
            del combined["trained_tokens_per_s"]  # no sample ran anywhere (sample_counts)
        return {**combined, "parallel/imbalance": imbalance(lengths, shares),
                "parallel/largest_share": max(len(s) for s in shares)}

    def _share_out(self, samples: Sequence, lengths: list[int], trainer) -> list[list[int]]:
        """Each replica's sample indices. A trainer that computes a group's common prefix once gets whole groups
        (placed by their members' Σ L²), so a group split over replicas does not lose its sharing."""
        if not getattr(trainer, "share_prefix", False):
            return assign(lengths, self.mesh.n_replicas)
        groups: dict = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.group_id if s.group_id is not None else ("sample", i), []).append(i)
        members = list(groups.values())
        # assign() balances Σ L²; a group's cost is its members' Σ L², passed as the length whose square it is.
        units = assign([round(sum(lengths[i] ** 2 for i in m) ** 0.5) for m in members], self.mesh.n_replicas)
        return [[i for u in share for i in members[u]] for share in units]

    def reduce_generation_metrics(self, metrics: dict) -> dict:
        """The engines' numbers over every replica: tokens/s and counters summed, the idle and paused shares
        averaged."""
        keys = [k for k, v in metrics.items()
                if (k.startswith("engine/") or k in ("generated_tokens_per_s", "engine_idle_share",
                                                     "engine_paused_share"))
                and isinstance(v, (int, float)) and not isinstance(v, bool)]
        sums = sum_over_replicas([metrics[k] for k in keys], self.mesh)
        out = dict(metrics)
        for key, total in zip(keys, sums):
            if key.endswith("_share"):
                out[key] = total / self.mesh.n_replicas
            else:
                out[key] = int(total) if isinstance(metrics[key], int) else total
        return out

    def check_weights(self, model: torch.nn.Module, step: int, *, force: bool = False) -> None:
        """Every `parallel.weight_check_every` steps (and whenever `force`, e.g. the last step): the replicas'
        weight hashes compared; a mismatch anywhere raises `ReplicaDivergence` on every rank."""
        every = self.cfg.parallel.weight_check_every
        if self.mesh.n_replicas == 1 or not (force or (every and step % every == 0)):
            return
        try:
            check_replica_weights(model, self.mesh)
            error = ""
        except ReplicaDivergence as exc:
            error = str(exc)
        errors = [None] * self.mesh.world_size
        dist.all_gather_object(errors, error)
        first = next((e for e in errors if e), None)
        if first:
            raise ReplicaDivergence(f"after step {step}: {first}; stopping the run")

    def stop_together(self, out_of_time: bool) -> bool:
        """At the end of a step, every rank: raise `Interrupted` if any rank received a signal; else whether any
        ran out of time. A rank stopping alone would leave the others waiting in a collective."""
        from agentrl.run import interrupt

        pending = interrupt.held()  # held by the `critical()` section the whole loop runs in, or lost where raised
        flags = torch.tensor([int(out_of_time), pending[0] if pending else 0], dtype=torch.long,
                             device=self.mesh.host_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        out_of_time, signum = (int(x) for x in flags.tolist())
        if signum:
            pending.clear()  # acted on here: the critical section must not raise it a second time
            raise interrupt.Interrupted(signum)
        return bool(out_of_time)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def writers(self) -> Writers:
        names = tuple(shard_filename(dataclasses.replace(self.mesh, replica=r, tp_rank=t))
                      for r in range(self.mesh.n_replicas) for t in range(self.mesh.tp_size))
        return Writers(writer=self.is_main, shard=shard_filename(self.mesh), shards=names, layout=self.describe(),
                       barrier=self.barrier)

    def model_state(self, model: torch.nn.Module) -> dict | None:
        """The whole model's state for rank 0 to write (gathered over replica 0's tp ranks; None elsewhere, and
        without tp, where rank 0's own state dict is whole)."""
        if self.mesh.tp_size == 1 or self.mesh.replica != 0:
            return None
        state = full_state_dict(model)
        return state if self.is_main else None

    def save_options(self, model: torch.nn.Module) -> dict:
        return {"model_state": self.model_state(model), "writers": self.writers()}

    def load_options(self, model: torch.nn.Module) -> dict:
        load = (lambda state: load_full_state_dict(model, state)) if self.mesh.tp_size > 1 else None
        return {"load_model_state": load, "writers": self.writers()}

    def checkpoint_extra(self, prompts, driver, trainer) -> dict:
        """What a checkpoint keeps beside the weights: every replica's prompt and driver state (gathered here; each
        tp rank of a replica holds the same) and the stepper's counters."""
        replicas = self._gather({"prompts": prompts.state_dict(), "driver": driver.state_dict()})
        return {"replicas": replicas, "parallel": self.describe(), **trainer.state_dict()}


def warn(message: str) -> None:
    if main_process():
        print(f"agentrl: {message}", file=sys.stderr, flush=True)


def interrupt_hold(parallel: ParallelRun | None) -> ContextManager:
    """Around a distributed run's loop: a signal is held until the end of the step (`stop_together`)."""
    import contextlib

    from agentrl.run.interrupt import critical

    return critical() if parallel is not None else contextlib.nullcontext()


__all__ = ["GROUP_IDS", "ParallelRun", "ReplicaStepper", "ShardedPromptIterator", "combine_train_metrics",
           "interrupt_hold", "launched", "main_process", "regroup_prompt_states", "restore_rollout_state", "warn"]
