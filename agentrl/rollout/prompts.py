"""One iterator over the dataset, shared by everything that reads prompts.

Rollouts start whenever a slot frees up, so the reader runs ahead of the trainer. A second iterator over the
same dataset would hand out the opening prompts of an epoch twice (the zero-sync design trained the first
batches of every epoch twice that way), so there is exactly one, it is thread-safe, and its
position is part of every checkpoint: each prompt is read exactly once per epoch, none twice, none skipped,
across epochs and restarts.

Prompts drawn but not yet consumed (their rollouts in flight when a checkpoint is taken) are saved with the
position and handed out first after a restore: in-flight work is regenerated, never lost.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Prompt:
    epoch: int
    index: int  # position in the dataset (not in the shuffled order)
    sample: dict[str, Any]


class PromptIterator:
    def __init__(self, dataset: Sequence[dict], *, shuffle: bool = True, seed: int = 0, max_epochs: int | None = None):
        if len(dataset) == 0:
            raise ValueError("the dataset is empty: nothing to roll out")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.max_epochs = max_epochs
        self.epoch = 0
        self.position = 0  # prompts already handed out in this epoch
        self._order = self._epoch_order(0)
        self._outstanding: dict[tuple[int, int], None] = {}  # drawn, not yet consumed; dict keeps draw order
        self._replay: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)  # a pure function of (seed, epoch)
        return order

    def __iter__(self):
        return self

    def __next__(self) -> Prompt:
        with self._lock:
            if self._replay:
                epoch, index = self._replay.popleft()
                self._outstanding[(epoch, index)] = None
                return Prompt(epoch, index, self.dataset[index])
            if self.position == len(self._order):
                if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
                    raise StopIteration
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            index = self._order[self.position]
            self.position += 1
            self._outstanding[(self.epoch, index)] = None
            return Prompt(self.epoch, index, self.dataset[index])

    def consumed(self, prompt: Prompt) -> None:
        """Mark a prompt's work finished (its group trained on, or its evaluation written)."""
        with self._lock:
            self._outstanding.pop((prompt.epoch, prompt.index), None)

    def exhausted(self) -> bool:
        with self._lock:
            last_epoch = self.max_epochs is not None and self.epoch + 1 >= self.max_epochs
            return not self._replay and last_epoch and self.position == len(self._order)

    def state_dict(self) -> dict:
        with self._lock:
            return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                    "size": len(self.dataset),
                    "outstanding": [list(k) for k in [*self._replay, *self._outstanding]]}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.dataset):
            raise ValueError(f"checkpointed iterator covered {state['size']} prompts, this dataset has {len(self.dataset)}")
        with self._lock:
            self.seed, self.shuffle = state["seed"], state["shuffle"]
            self.epoch, self.position = state["epoch"], state["position"]
            self._order = self._epoch_order(self.epoch)
            self._outstanding = {}
            self._replay = deque(tuple(k) for k in state.get("outstanding", []))
