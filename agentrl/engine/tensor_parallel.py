"""The engine on a tensor-parallel model: what its tp ranks must agree on, and how they do.

A model split by `agentrl.parallel.apply_tensor_parallel` holds DTensor parameters on its replica's 1-D tp mesh.
The engine decodes from them in place: each rank's attention runs its own heads (`local_head_counts`), so its KV
pool holds only those; o_proj and down_proj all-reduce inside their modules, the lm_head and the linear-attention
state are whole on every rank. Every rank therefore samples the same tokens from the same logits, and the
scheduler, a pure function of what was submitted and what was sampled, decides the same everywhere, so every rank
runs forwards of the same shapes, whose collectives pair up.

What the ranks must agree on, and how:
- the pages: the smallest free memory of the group sizes every rank's pool (`agree_at_construction`), and the
  configs must be equal (the seed included: request seeds are drawn from it);
- the requests: each rank's submissions arrive on their own schedule (from a rollout loop on another thread, tools
  finishing at their own pace), so a step takes in only the prefix of submissions (and of cancels) that every rank
  had received when the previous step compared notes. Given the same submissions in the same order, the ranks take
  them in at the same step whatever their timing;
- each step, before its forward (`agree_step`, one small all-gather on the host): the step's layout and a running
  digest of everything taken in and sampled so far. A rank that drifted raises here, on every rank, instead of
  deadlocking in or silently corrupting a collective.

So every tp rank must call `step()` the same number of times: whatever decides to stop stepping (enough rollouts
ready, the end of a phase) must be a decision every rank shares. NCCL needs every rank to issue the operations on a
communicator in the same host order, so the engine is stepped by its owner, never on a thread of its own beside the
training step's collectives.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from hashlib import blake2b

import torch
import torch.distributed as dist
from torch import nn


def _digest(data: bytes, key: bytes = b"") -> bytes:
    return blake2b(data, digest_size=8, key=key).digest()


def _as_int(digest: bytes) -> int:
    return int.from_bytes(digest, "little", signed=True)


@dataclass
class TensorParallel:
    """This rank's place in the tp group its model is split over, and what it has told the others."""

    size: int
    rank: int
    group: object  # the ProcessGroup of the model's tp mesh
    host: torch.device  # where the group's small host-side collectives run (gloo's CPU when present)
    history: bytes = b""  # requests taken in, cancels and sampled tokens so far, folded into one digest
    steps_agreed: int = 0

    @classmethod
    def of(cls, model: nn.Module) -> "TensorParallel | None":
        """The tp group `model`'s DTensor parameters live on; None for a model that is not split."""
        from torch.distributed.tensor import DTensor

        mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
        if mesh is None or mesh.size() == 1:
            return None
        if mesh.ndim != 1:
            raise NotImplementedError(f"the engine serves models split over a 1-D tp mesh, not {mesh}")
        group = mesh.get_group()
        gloo = "gloo" in str(dist.get_backend(group))
        host = torch.device("cpu") if gloo else torch.device("cuda", torch.cuda.current_device())
        return cls(mesh.size(), mesh.get_local_rank(), group, host)

    def _gather(self, values: list[int]) -> torch.Tensor:
        """`[size, len(values)]`: every rank's `values`, in rank order."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.host)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return torch.stack(out).cpu()

    def agree_at_construction(self, config, free_device_bytes: int | None) -> int | None:
        """Raise unless every rank built its engine with the same config; return the smallest free device memory
        of the group (None on CPU, where the configured bytes decide), so that every rank gets as many pages."""
        gathered = self._gather([_as_int(_digest(repr(config).encode())),
                                 -1 if free_device_bytes is None else int(free_device_bytes)])
        if not bool((gathered[:, 0] == gathered[0, 0]).all()):
            raise ValueError(f"the engines of the tp group were built with different configs (this is tp rank "
                             f"{self.rank}: {config}); every tp rank needs the same one, seed included")
        frees = [int(f) for f in gathered[:, 1] if f >= 0]
        return min(frees) if frees else None

    # -- what each rank folds into its history ----------------------------------------------------------
    def fold_arrivals(self, seqs, cancels) -> None:
        """Requests taken in (id, prompt, sampling, seed) and cancels, in the order they were taken in."""
        for seq in seqs:
            data = array("q", [seq.request_id, seq.seed, *seq.tokens]).tobytes() + repr(seq.params).encode()
            self.history = _digest(data, key=self.history)
        if cancels:
            self.history = _digest(array("q", [-1, *cancels]).tobytes(), key=self.history)

    def fold_tokens(self, tokens) -> None:
        """One step's sampled tokens."""
        self.history = _digest(array("q", map(int, tokens)).tobytes(), key=self.history)

    # -- once per step -----------------------------------------------------------------------------------
    def agree_step(self, batch, version: int, received: tuple[int, int]) -> tuple[int, int]:
        """Compare this step with every rank's before its forward; raise if they differ. `received`: the
        submissions and cancels this rank holds but has not taken in. Returns how many of each every rank holds:
        what the next step takes in."""
        layout = array("q", [version])
        for item in batch:
            layout.extend((item.seq.request_id, item.start, item.length))
        gathered = self._gather([_as_int(_digest(layout.tobytes())), _as_int(self.history), *received])
        self.steps_agreed += 1
        if not bool((gathered[:, :2] == gathered[0, :2]).all()):
            what = "scheduled different steps" if bool((gathered[:, 1] == gathered[0, 1]).all()) else \
                "took in different requests or sampled different tokens"
            raise RuntimeError(
                f"the tp ranks {what} (tp rank {self.rank}, step {self.steps_agreed}): every tp rank's engine must "
                "get the same submissions and cancels in the same order, and be stepped as many times")
        return int(gathered[:, 2].min()), int(gathered[:, 3].min())
