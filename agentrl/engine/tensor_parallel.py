"""The engine on a tensor-parallel model: what its tp ranks must agree on, and how they do.

A model split by `agentrl.parallel.apply_tensor_parallel` holds DTensor parameters on its replica's 1-D tp mesh.
The engine decodes from them in place: each rank's attention runs its own heads (`local_head_counts`), so its KV
pool holds only those; o_proj and down_proj all-reduce inside their modules, the lm_head and the linear-attention
state are whole on every rank. Every rank therefore samples the same tokens from the same logits, and the
scheduler, a pure function of the requests taken in and the tokens sampled, decides the same everywhere: every
rank runs forwards of the same shapes, whose collectives pair up.

What the ranks agree on, and how:
- at construction, the pages (the smallest free memory of the group sizes every rank's pool) and the config;
- at every step, before anything is scheduled (`agree`, one small all-gather on the host, and a broadcast when
  requests arrived): the requests are tp rank 0's. The requests and cancels it received since the last step are
  sent to the other ranks, which take in exactly those, with tp rank 0's ids and sampling seeds. The others need
  not submit anything: their engines follow. A rank that does submit (every rank calling `generate` with the same
  prompts) makes mirrors, matched to tp rank 0's requests by id, which lend their callbacks; their content is
  checked. The same all-gather compares the policy versions and a digest of everything each rank took in and
  sampled so far, so a rank that drifted raises on every rank instead of deadlocking in, or silently corrupting,
  a collective.

So every tp rank must call `step()` the same number of times, and whatever decides to stop stepping (enough
rollouts ready, the end of a phase) must be a decision every rank shares. NCCL needs every rank to issue the
operations on a communicator in the same host order, so the engine is stepped by its owner, never on a thread of
its own beside the training step's collectives.
"""

from __future__ import annotations

import pickle
from array import array
from collections import deque
from dataclasses import dataclass, field
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
    """This rank's place in the tp group its model is split over, and the digest it compares with the others."""

    size: int
    rank: int
    group: object  # the ProcessGroup of the model's tp mesh
    leader_rank: int  # global rank of tp rank 0, whose requests every rank takes in
    host: torch.device  # where the group's small host-side collectives run (gloo's CPU when present)
    history: bytes = b""  # requests taken in and tokens sampled so far, folded into one digest
    steps_agreed: int = 0
    mirrors: deque = field(default_factory=deque)  # off tp rank 0: submissions awaiting tp rank 0's request
    taken_up_to: int = 0  # request ids below this were taken in

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
        return cls(mesh.size(), mesh.get_local_rank(), group, dist.get_global_rank(group, 0), host)

    @property
    def leader(self) -> bool:
        return self.rank == 0

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
                             f"{self.rank}: {config}); every tp rank needs the same one")
        frees = [int(f) for f in gathered[:, 1] if f >= 0]
        return min(frees) if frees else None

    def agree(self, version: int, arrivals: list[tuple] | None = None,
              cancels: list[int] | None = None) -> tuple[list, list]:
        """Once per step, on every rank: raise unless every rank's history and policy `version` are the leader's;
        return the leader's `arrivals` (request id, prompt ids, SamplingParams, seed) and `cancels`, which only the
        leader passes."""
        payload = pickle.dumps((arrivals, cancels)) if self.leader and (arrivals or cancels) else b""
        gathered = self._gather([_as_int(self.history), int(version), len(payload)])
        self.steps_agreed += 1
        if not bool((gathered[:, 0] == gathered[0, 0]).all()):
            raise RuntimeError(
                f"the tp ranks took in different requests or sampled different tokens (tp rank {self.rank}, step "
                f"{self.steps_agreed}): a rank that submits must submit what tp rank 0 does, in the same order, "
                "before the step that takes it in, and every tp rank must be stepped as many times")
        if not bool((gathered[:, 1] == gathered[0, 1]).all()):
            raise RuntimeError(f"the tp ranks step under different policy versions {gathered[:, 1].tolist()}: "
                               "every tp rank must bump the version between the same two steps")
        size = int(gathered[0, 2])
        if size == 0:
            return [], []
        buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.leader else
                  torch.empty(size, dtype=torch.uint8)).to(self.host)
        dist.broadcast(buffer, src=self.leader_rank, group=self.group)
        return pickle.loads(buffer.cpu().numpy().tobytes())

    def take_in(self, new: list, cancels: list[int], version: int, make_sequence) -> tuple[list, list[int]]:
        """The requests and cancels every rank takes in this step: tp rank 0's. On tp rank 0, `new` and `cancels`
        are its own; elsewhere `new` are mirrors, each lending its callback to tp rank 0's request of its id (the
        sequence is built from tp rank 0's copy, so every rank computes the same), and a mirror whose content
        differs, or that came after its id was taken in, makes the next agreement fail on every rank.
        `version`: this rank's policy version, compared too. `make_sequence(request_id, prompt ids, params, callback,
        seed)` builds a sequence."""
        if self.leader:
            self.agree(version, [(s.request_id, s.tokens, s.params, s.seed) for s in new], cancels)
            for seq in new:
                self.fold_request(seq.request_id, seq.tokens, seq.params)
            return new, cancels
        arrivals, cancels = self.agree(version)
        mirrors = self.mirrors
        mirrors.extend(new)
        taken = []
        for request_id, ids, params, seed in arrivals:
            while mirrors and mirrors[0].request_id < request_id:
                mirrors.popleft()
                self.fold_mismatch()
            mirror = mirrors.popleft() if mirrors and mirrors[0].request_id == request_id else None
            taken.append(make_sequence(request_id, ids, params, mirror.callback if mirror else None, seed))
            self.fold_request(request_id, *((mirror.tokens, mirror.params) if mirror else (ids, params)))
            self.taken_up_to = request_id + 1
        while mirrors and mirrors[0].request_id < self.taken_up_to:
            mirrors.popleft()
            self.fold_mismatch()
        return taken, cancels

    # -- what each rank folds into its history ----------------------------------------------------------
    def fold_request(self, request_id: int, prompt, params) -> None:
        """A request taken in: its id, prompt and sampling (a follower folds its mirror's, when it has one)."""
        self.history = _digest(array("q", [request_id, *prompt]).tobytes() + repr(params).encode(), self.history)

    def fold_mismatch(self) -> None:
        """A follower's mirror that no request of the leader matches: the next agreement fails on every rank."""
        self.history = _digest(b"unmatched mirror", self.history)

    def fold_tokens(self, tokens) -> None:
        """One step's sampled tokens."""
        self.history = _digest(array("q", map(int, tokens)).tobytes(), self.history)
