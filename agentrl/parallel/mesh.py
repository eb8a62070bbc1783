"""The process layout: a 2-D device mesh of replicas × tensor-parallel ranks, from the launcher's environment.

Ranks `r * tp_size .. (r + 1) * tp_size - 1` form replica `r` and split every weight matrix between them
(tensor parallelism); the ranks holding the same shard in different replicas (same `tp_rank`) form a replica
group, over which gradients are summed, optimizer shares are passed around and weights are compared. Keeping a
replica's ranks contiguous puts them on one host, where the per-layer all-reduces of tensor parallelism belong.

`WORLD_SIZE`, `RANK` and `LOCAL_RANK` come from torchrun, `accelerate launch`, or are set by hand (with
`MASTER_ADDR` / `MASTER_PORT`). A single process without them gets a trivial mesh and no process group at all,
so single-device runs pay nothing for this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agentrl.parallel.config import ParallelConfig

REPLICA, TP = "replica", "tp"


@dataclass(frozen=True)
class Mesh:
    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    n_replicas: int
    tp_rank: int
    replica: int
    device: torch.device
    device_mesh: object | None = None  # DeviceMesh (REPLICA, TP); None for a single process

    @property
    def is_main(self) -> bool:
        """The one rank that writes files and logs for the whole run."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def tp_mesh(self):
        """The 1-D mesh of this replica's tensor-parallel ranks (what DTensor parameters live on)."""
        return None if self.device_mesh is None else self.device_mesh[TP]

    @property
    def tp_group(self):
        return None if self.device_mesh is None else self.device_mesh.get_group(TP)

    @property
    def replica_group(self):
        """The ranks with this rank's `tp_rank`, one per replica."""
        return None if self.device_mesh is None else self.device_mesh.get_group(REPLICA)

    @property
    def host_device(self) -> torch.device:
        """Where small host-side values (counts, hashes) go for a collective: the CPU when the process group has
        gloo, else this rank's device (a process group initialised elsewhere with nccl alone)."""
        if self.device_mesh is None or "gloo" in str(dist.get_backend()):
            return torch.device("cpu")
        return self.device

    def rank_of(self, replica: int, tp_rank: int | None = None) -> int:
        """Global rank of `replica`'s member holding shard `tp_rank` (default: this rank's own shard)."""
        return replica * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)


def init_mesh(cfg: ParallelConfig | None = None) -> Mesh:
    """Initialise the process group (nccl on CUDA with gloo beside it for host-side values, gloo on CPU) and
    build the (replica, tp) mesh. Each process uses the CUDA device of its `LOCAL_RANK` when CUDA is present."""
    cfg = cfg or ParallelConfig()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if world % cfg.tp_size:
        raise ValueError(f"parallel.tp_size={cfg.tp_size} does not divide the {world} processes launched "
                         f"(WORLD_SIZE); launch a multiple of {cfg.tp_size} processes or change tp_size")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if world == 1 and not dist.is_initialized():
        return Mesh(rank=0, world_size=1, local_rank=0, tp_size=1, n_replicas=1, tp_rank=0, replica=0,
                    device=device)

    if not dist.is_initialized():
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"WORLD_SIZE={world} but {' and '.join(missing)} unset: start the processes with "
                               f"torchrun (or accelerate launch), or set them by hand")
        # gloo beside nccl: object exchange and the readiness count stay on the host, off the GPU streams the
        # engine and the training step issue their collectives on.
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    n_replicas = world // cfg.tp_size
    device_mesh = init_device_mesh(device.type, (n_replicas, cfg.tp_size), mesh_dim_names=(REPLICA, TP))
    replica, tp_rank = device_mesh.get_coordinate()
    return Mesh(rank=rank, world_size=world, local_rank=local_rank, tp_size=cfg.tp_size, n_replicas=n_replicas,
                tp_rank=tp_rank, replica=replica, device=device, device_mesh=device_mesh)


def close_mesh(mesh: Mesh) -> None:
    """Tear the process group down (the end of a run; a no-op for a single process)."""
    if mesh.device_mesh is not None and dist.is_initialized():
        dist.destroy_process_group()
