"""Are the replicas still one model? A cheap hash of every local parameter, compared over the replica group.

Replicas apply the same update to the same weights, so their parameters must stay bit-identical; a divergence (a
missed broadcast, a nondeterministic kernel, a rank that skipped a step) would otherwise go on training several
slightly different models without a sign. The hash runs on the device, over the raw bytes viewed as integers
and weighted by position (so a permutation changes it), one int64 per parameter; only those numbers cross the
network.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from agentrl.parallel.mesh import Mesh

_CHUNK = 1 << 24  # words hashed at once: bounds the int64 temporaries to a few hundred MiB


_WEYL = 0x9E3779B97F4A7C15 - (1 << 64)  # the golden-ratio constant as a signed int64


class ReplicaDivergence(RuntimeError):
    """Replicas hold different weights."""


@torch.no_grad()
def parameter_hashes(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """(names, int64 hash per parameter) of this rank's local parameter bytes."""
    names, hashes = [], []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        names.append(name)
        hashes.append(_hash(local.detach().contiguous()))
    return names, torch.stack(hashes) if hashes else torch.zeros(0, dtype=torch.long)


def _hash(t: torch.Tensor) -> torch.Tensor:
    raw = t.reshape(-1).view(torch.uint8)
    for dtype in (torch.int32, torch.int16):  # the widest integer view the byte count allows
        size = torch.empty((), dtype=dtype).element_size()
        if raw.numel() % size == 0:
            words = raw.view(dtype)
            break
    else:
        words = raw
    total = torch.zeros((), dtype=torch.long, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].long()
        # An odd multiplier per position (a Weyl sequence, wrapping in int64): moving a value changes the sum.
        pos = torch.arange(start, start + w.numel(), device=t.device, dtype=torch.long)
        total += (w * (pos * _WEYL + 1 | 1)).sum()
    return total + words.numel()


def check_replica_weights(model: torch.nn.Module, mesh: Mesh) -> None:
    """Raise `ReplicaDivergence` naming the first parameter whose bytes differ between replicas (compared among
    the ranks holding the same tp slice). A collective over the replica group; a no-op with one replica."""
    if mesh.n_replicas == 1:
        return
    names, hashes = parameter_hashes(model)
    hashes = hashes.to(mesh.host_device)
    gathered = [torch.empty_like(hashes) for _ in range(mesh.n_replicas)]
    dist.all_gather(gathered, hashes, group=mesh.replica_group)
    reference = gathered[0]
    for replica, other in enumerate(gathered[1:], start=1):
        differ = (other != reference).nonzero()
        if differ.numel():
            first = names[int(differ[0, 0])]
            raise ReplicaDivergence(
                f"replica {replica} holds different weights from replica 0 (tp rank {mesh.tp_rank}): first differing "
                f"parameter {first!r}, {differ.numel()} of {len(names)} differ")
