"""The `parallel` config section: how the world is split into tensor-parallel groups and replicas.

Imports no torch, so a config naming an impossible split fails before anything loads. The number of replicas is
not a setting: it is `WORLD_SIZE // tp_size`, fixed by how many processes the launcher started.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentrl.config import check_types, require


@dataclass
class ParallelConfig:
    # Ranks that split each weight matrix between them (one replica). 1: every rank holds whole weights.
    tp_size: int = 1
    # Steps between comparisons of the replicas' weights (a hash of every local parameter); 0 turns it off.
    # Replicas that drift apart silently train different models, so the check is cheap insurance.
    weight_check_every: int = 50
    # Calls of the readiness gate between two of its all-reduces. A collective before every decode step slows
    # decoding (it queues beside the engine's own); overshooting by a few decode steps only leaves more ready.
    ready_check_every: int = 8

    def __post_init__(self):
        check_types(self, "parallel")
        require(self.tp_size >= 1, "parallel.tp_size", "must be >= 1")
        require(self.weight_check_every >= 0, "parallel.weight_check_every", "must be >= 0 (0: off)")
        require(self.ready_check_every >= 1, "parallel.ready_check_every", "must be >= 1")
