"""Replicas training one pooled batch: what each takes, when they start, and how their gradients meet.

Every rank runs the same pure functions over the same pool, so no rank has to be told what another decided:
- `SharedPool` holds every replica's finished items (samples or groups), exchanged over the replica group, so the
  pool is identical everywhere.
- What a step takes is decided by age (`select_oldest`): a rollout is either decoding or waiting in the pool, and a
  growing backlog of short ones left behind would mean fewer sequences decoding at once.
- Where each taken sample goes is decided by length (`assign`): longest first, to the replica carrying the least
  Σ L² (attention is quadratic, so that is what predicts both the step time and the activation peak). Nothing ties
  a sample to the replica that generated it.
- `ReadinessGate` answers "do the replicas have enough ready between them" with one all-reduce every k calls, on a
  schedule identical on every rank (a rank skipping a collective the others wait on would hang them all).
- Under tensor parallelism tp rank 0 speaks for its replica, in the pool and at the gate: its tp peers decode its
  requests in lockstep (`agentrl.engine.tensor_parallel`) and need not run rollouts of their own, and what a peer
  would report (finished when its tools happened to return) could differ from tp rank 0's at any moment. The tp
  ranks 0 exchange over their replica group and pass the result to their tp peers, so every rank of every replica
  holds the same pool and gets the same answer.
- `reduce_gradients` sums gradients over the replica group. With every replica's loss divided by the *pooled*
  batch's denominator (`pooled_loss_denominator`), the sum is the gradient one process computes on the union (up
  to the order of the additions).

A replica assigned nothing still takes part in every collective (zero gradients), so it never deadlocks the rest.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from agentrl.parallel.mesh import Mesh

BUCKET_BYTES = 256 << 20  # one flat copy per collective: large enough to amortise launches, small beside a model


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------------------------------- pure decisions


def select_oldest(ages: Sequence[float], n: int) -> list[int]:
    """Indices of the `n` oldest items (smallest age key: a finish time or a sequence number), oldest first;
    equal ages keep their order in the pool."""
    return sorted(range(len(ages)), key=lambda i: (ages[i], i))[:max(n, 0)]


def assign(lengths: Sequence[int], n_replicas: int) -> list[list[int]]:
    """Items to replicas: longest first, each to the replica whose Σ L² is least so far (ties: fewest items, then
    lowest replica index; equal lengths go in index order). Returns each replica's item indices, in placement
    order. A pure function of its arguments, so every rank computes the same answer."""
    if n_replicas < 1:
        raise ValueError(f"n_replicas must be >= 1, got {n_replicas}")
    shares: list[list[int]] = [[] for _ in range(n_replicas)]
    heap = [(0, 0, r) for r in range(n_replicas)]  # (Σ L², items, replica)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, count, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (load + lengths[i] ** 2, count + 1, r))
    return shares


def imbalance(lengths: Sequence[int], shares: Sequence[Sequence[int]]) -> float:
    """Largest replica's Σ L² over the mean (1.0 is perfect balance): a metric worth logging each step."""
    loads = [sum(lengths[i] ** 2 for i in share) for share in shares]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


# ------------------------------------------------------------------------------------------------ the pool


@dataclass(frozen=True)
class _Entry:
    age: float
    replica: int  # where it was generated: part of the tie-break only
    seq: int
    item: Any


class SharedPool:
    """The finished items of every replica (tp rank 0's under tensor parallelism), identical on every rank once
    `exchange` has run on all of them.

    Items travel by pickle (`all_gather_object`), so a sample's token lists go to every rank: integers per token,
    small next to the gradients the same step all-reduces.
    """

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self._entries: list[_Entry] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def exchange(self, new_items: Sequence[Any], ages: Sequence[float]) -> None:
        """Add this replica's newly finished `new_items` (with their age keys) and every other replica's to the
        pool. A collective: every rank calls it, with an empty list if it has nothing; under tensor parallelism only
        tp rank 0's items count (its peers' are dropped)."""
        if len(new_items) != len(ages):
            raise ValueError(f"{len(new_items)} items but {len(ages)} ages")
        mesh = self.mesh
        gathered = None
        if mesh.tp_rank == 0:
            mine = [(float(a), x) for a, x in zip(ages, new_items)]
            gathered = [mine]
            if mesh.n_replicas > 1:
                gathered = [None] * mesh.n_replicas
                dist.all_gather_object(gathered, mine, group=mesh.replica_group)
        gathered = _from_tp_rank_0(gathered, mesh)
        for replica, items in enumerate(gathered):
            for age, item in items:
                self._entries.append(_Entry(age, replica, next(self._seq), item))

    def take_oldest(self, n: int) -> list[Any]:
        """Remove and return the `n` oldest items (age, then generating replica, then arrival), oldest first."""
        keys = [(e.age, e.replica, e.seq) for e in self._entries]
        chosen = select_oldest(keys, n)
        taken = [self._entries[i].item for i in chosen]
        drop = set(chosen)
        self._entries = [e for i, e in enumerate(self._entries) if i not in drop]
        return taken


def my_share(samples: Sequence[Any], mesh: Mesh) -> list[Any]:
    """This replica's samples of a pooled batch (`assign` by `len(sample)`), longest first."""
    shares = assign([len(s) for s in samples], mesh.n_replicas)
    return [samples[i] for i in shares[mesh.replica]]


def pooled_loss_denominator(samples: Sequence[Any], loss_cfg, current_version: int) -> float:
    """The loss denominator `D` of the whole pooled batch (`agentrl.train.loss.loss_denominator` over the union),
    which every replica divides its part of the loss by so that the summed gradients equal one process's."""
    from agentrl.train.loss import samples_loss_denominator

    return samples_loss_denominator(samples, loss_cfg, current_version)


# ------------------------------------------------------------------------------------------- collectives


class ReadinessGate:
    """`poll(local_ready, needed)`: True once the replicas hold at least `needed` ready items between them.

    Call it once per iteration of the generation loop on every rank, whether or not that rank decoded anything:
    the all-reduce (over the world, counting tp rank 0's `local_ready` for each replica) happens on calls k, 2k,
    3k, ... of every rank alike, and between them the answer is False (the count only grows, so asking late only
    leaves more ready). Every rank gets the same answer, so it can decide when every rank stops stepping its engine.
    """

    def __init__(self, mesh: Mesh, every: int = 8):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.mesh, self.every = mesh, every
        self.calls = 0
        self.collectives = 0

    def poll(self, local_ready: int, needed: int) -> bool:
        self.calls += 1
        mesh = self.mesh
        if mesh.world_size == 1:
            return local_ready >= needed
        if self.calls % self.every:
            return False
        self.collectives += 1
        count = None
        if mesh.tp_rank == 0:
            count = int(local_ready)
            if mesh.n_replicas > 1:
                total = torch.tensor([count], dtype=torch.long, device=mesh.host_device)
                dist.all_reduce(total, group=mesh.replica_group)
                count = int(total.item())
        return _from_tp_rank_0(count, mesh) >= needed


def _from_tp_rank_0(value, mesh: Mesh):
    """`value` as this replica's tp rank 0 holds it, on each of its tp ranks (a collective over the tp group)."""
    if mesh.tp_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=mesh.rank_of(mesh.replica, 0), group=mesh.tp_group)
    return box[0]


def sum_over_replicas(values: Sequence[float], mesh: Mesh) -> list[float]:
    """Host numbers summed over the replica group (a step's loss and token counts for logging and the skip
    decision, which must be the same on every rank)."""
    if mesh.n_replicas == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=mesh.host_device)
    dist.all_reduce(t, group=mesh.replica_group)
    return t.tolist()


def reduce_gradients(params, mesh: Mesh, op: str = "sum", bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum (or average) every parameter's gradient over the replica group, in place, in flat buckets.

    `sum` matches a loss divided by the pooled batch's denominator (`pooled_loss_denominator`); `mean` one divided
    by each replica's own. A parameter without a gradient (a replica that trained on nothing, or a module its
    samples never reached) contributes zeros and receives the sum, so every rank runs the same collectives.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    params = [p for p in params if p.requires_grad]
    if mesh.n_replicas == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in flat_buckets([_local(p.grad) for p in params], bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=mesh.replica_group)
        if op == "mean":
            flat.div_(mesh.n_replicas)
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def flat_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES):
    """Consecutive runs of same-dtype, same-device tensors of at most `bucket_bytes` (a lone larger one alone)."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0].dtype or t.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module, mesh: Mesh, src_replica: int = 0) -> None:
    """Copy replica `src_replica`'s weights to every other replica (at setup: replicas that loaded or initialised
    differently start from one model)."""
    if mesh.n_replicas == 1:
        return
    src = mesh.rank_of(src_replica)
    for bucket in flat_buckets([_local(p.data) for p in model.parameters()]):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, src=src, group=mesh.replica_group)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))
