"""AdamW whose moments are divided between the replicas: each updates its share and passes the result around.

Adam carries two fp32 moments per parameter, four times bf16 weights, and in a replicated model that is the
term deciding whether a model fits. Here each replica owns a share of the parameters (largest first to the
least-loaded replica, by element count: deterministic, so every rank computes the same ownership), keeps moments
for that share only, updates it, and broadcasts the updated values over the replica group, so every replica holds
whole weights again, which is what generation reads. Adam is elementwise, so which replica holds a parameter's
moments cannot change the arithmetic: the updates are bit-identical to one `torch.optim.AdamW` on the same
gradients (the owner runs that very optimizer on its share).

The optimizer's `param_groups` hold *every* parameter, so a learning-rate scheduler sets the rate for all of them
and `zero_grad` clears the whole model's gradients: a replica's inner optimizer only knows its own share, and
clearing just that would leave the rest accumulating into the next step.

Checkpoints: `state_dict()` is this rank's shard (its replica's moments for its tp slice), so every rank writes its
own file (`shard_filename`) and loads it back into the same layout.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from agentrl.parallel.mesh import Mesh
from agentrl.parallel.replicas import flat_buckets

_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def partition_by_numel(numels: Sequence[int], n_replicas: int) -> list[int]:
    """Owner replica of each parameter: largest first, each to the replica owning the fewest elements so far
    (ties: lowest replica; equal sizes in index order)."""
    owners = [0] * len(numels)
    heap = [(0, r) for r in range(n_replicas)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + numels[i], r))
    return owners


def shard_filename(mesh: Mesh) -> str:
    return f"optimizer-replica{mesh.replica:03d}-tp{mesh.tp_rank:03d}.pt"


class ShardedAdamW(torch.optim.Optimizer):
    """Drop-in for `torch.optim.AdamW` (same hyperparameters and groups) across the replicas of `mesh`."""

    def __init__(self, params, mesh: Mesh, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, foreach: bool | None = None, fused: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                                      maximize=False))
        self.mesh = mesh
        every = self._all_params()
        self.owners = partition_by_numel([p.numel() for p in every], mesh.n_replicas)
        mine = {id(p) for p, owner in zip(every, self.owners) if owner == mesh.replica}
        inner_groups = [{**{k: g[k] for k in _HYPERPARAMETERS},
                         "params": [p for p in g["params"] if id(p) in mine]} for g in self.param_groups]
        self.inner = torch.optim.AdamW(inner_groups, lr=lr, foreach=foreach, fused=fused)

    @classmethod
    def from_adamw(cls, optimizer: torch.optim.AdamW, mesh: Mesh) -> "ShardedAdamW":
        """The sharded version of an AdamW built elsewhere (`agentrl.train.optim.build_optimizer`): its groups,
        hyperparameters and kernel choice (fused / foreach). Build it before its first step (it holds no state)."""
        if optimizer.state:
            raise ValueError("wrap the AdamW before its first step: its moments would be dropped")
        d = optimizer.defaults
        groups = [{k: v for k, v in g.items() if k in _HYPERPARAMETERS or k == "params"} for g in optimizer.param_groups]
        return cls(groups, mesh, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                   foreach=d.get("foreach"), fused=d.get("fused"))

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "inner"):
            raise NotImplementedError("ShardedAdamW's ownership is fixed at construction; build a new one")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for key in _HYPERPARAMETERS:  # the scheduler writes the outer groups
                inner[key] = outer[key]
        self.inner.step()
        self._share_updates()
        return loss

    def _share_updates(self) -> None:
        """Every owner broadcasts its updated parameters (this rank's tp slice) to the other replicas."""
        if self.mesh.n_replicas == 1:
            return
        every = self._all_params()
        for owner in range(self.mesh.n_replicas):
            owned = [_local(p) for p, o in zip(every, self.owners) if o == owner]
            src = self.mesh.rank_of(owner)
            for bucket in flat_buckets(owned):
                flat = torch.cat([t.reshape(-1) for t in bucket])
                dist.broadcast(flat, src=src, group=self.mesh.replica_group)
                if owner != self.mesh.replica:
                    for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                        t.copy_(part.view_as(t))

    # ------------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        inner = self.inner.state_dict()
        state = {}
        for index, entry in inner["state"].items():
            state[index] = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in entry.items()}
        return {
            "format": "sharded_adamw", "replica": self.mesh.replica, "n_replicas": self.mesh.n_replicas,
            "tp_rank": self.mesh.tp_rank, "tp_size": self.mesh.tp_size, "owners": list(self.owners),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "inner": {"state": state, "param_groups": inner["param_groups"]},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("format") != "sharded_adamw":
            raise ValueError("not a ShardedAdamW state dict (a plain AdamW's state covers every parameter)")
        here = (self.mesh.replica, self.mesh.n_replicas, self.mesh.tp_rank, self.mesh.tp_size)
        saved = (state_dict["replica"], state_dict["n_replicas"], state_dict["tp_rank"], state_dict["tp_size"])
        if saved != here:
            raise ValueError(f"optimizer shard of (replica, replicas, tp rank, tp size) {saved} loaded into {here}: "
                             f"each rank loads its own shard, under the same layout it was saved with")
        if list(state_dict["owners"]) != list(self.owners):
            raise ValueError("the saved parameter ownership differs: the model's parameters changed")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError("the saved optimizer has a different number of parameter groups")
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved_group)
        inner_params = [p for g in self.inner.param_groups for p in g["params"]]
        state = {}
        for index, entry in state_dict["inner"]["state"].items():
            param = inner_params[int(index)]
            state[index] = {k: _like(v, param) for k, v in entry.items()}
        self.inner.load_state_dict({"state": state, "param_groups": state_dict["inner"]["param_groups"]})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(value, param):
    """A saved local moment back as a DTensor laid out like its parameter (scalars such as `step` stay plain)."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.to_local().shape \
            and value.dim() > 0:
        return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False)
    return value
