"""Checkpoints: model, optimizer, scheduler, every RNG, and the caller's own state, written atomically.

A checkpoint is a directory `run_dir/step_XXXXXXXX/`. It is written under a temporary name beside its target,
every file fsynced, and renamed into place in one `os.replace`: a crash or an exception mid-write leaves the
previous checkpoints exactly as they were and no half-written directory that `latest_checkpoint` could pick.

Nothing here knows about the engine: its KV cache and in-flight rollouts are rebuilt on resume, and the prompt
iterator's position travels in `extra`. One writer per run directory (rank 0).

Several processes of one run (`Writers`) save one checkpoint together: the writer saves the model (whole, as one
process would), the scheduler and the trainer state, every process saves its own optimizer shard into the same
temporary directory, and only once all of them have is it renamed into place. `optimizer.pt` then lists the shards
and the layout they were split by; a shard loads only under that layout, and anywhere else the model and schedule
load and the optimizer starts afresh (`load_checkpoint` says so).

Files are torch.save pickles, loaded back with `weights_only=True`, so `extra` may hold tensors, numbers,
strings, lists, tuples and dicts, but no arbitrary objects.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_FILES = ("model.pt", "optimizer.pt", "scheduler.pt", "trainer_state.pt")
SHARDED = "sharded optimizer"  # optimizer.pt of a checkpoint whose optimizer state is one file per process


@dataclass(frozen=True)
class Writers:
    """This process's part in saving and loading checkpoints with the other processes of its run."""

    writer: bool  # writes the shared files and renames the directory into place (rank 0)
    shard: str  # this process's optimizer file
    shards: tuple[str, ...]  # every process's optimizer file
    layout: str  # how the optimizer state is split (e.g. "replicas=2 tp=2"): a shard loads only under the same
    barrier: Callable[[], None]  # returns once every process has called it


def rng_state() -> dict:
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        # plain lists: weights_only loading refuses numpy arrays
        "numpy": (name, keys.tolist(), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    import numpy as np

    random.setstate(_as_tuples(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(x):
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"step_{step:08d}"


def _write(path: Path, obj):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer=None, scheduler=None,
                    extra: dict | None = None, keep_last: int | None = None, *, model_state: dict | None = None,
                    writers: Writers | None = None) -> Path:
    """Write checkpoint `step` under `run_dir` atomically and return its path; keep only the newest `keep_last`.

    `model_state`: what to save as the model instead of `model.state_dict()` (a split model's gathered state; only
    the writer's is used). `writers`: every process of the run calls this together (see the module docstring).
    """
    run_dir = Path(run_dir)
    target = step_dir(run_dir, step)
    writer = writers is None or writers.writer
    if writer:
        run_dir.mkdir(parents=True, exist_ok=True)
        for leftover in run_dir.glob(".tmp-step_*"):  # from a writer that died mid-save
            shutil.rmtree(leftover, ignore_errors=True)
    if writers is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=run_dir))
    else:  # one name every process can find
        tmp = run_dir / f".tmp-{target.name}-shared"
        if writer:
            tmp.mkdir()
        writers.barrier()
    try:
        if writers is not None:
            _write(tmp / writers.shard, optimizer.state_dict())
        if writer:
            _write(tmp / "model.pt", model_state if model_state is not None else model.state_dict())
            if writers is not None:
                _write(tmp / "optimizer.pt", {"format": SHARDED, "layout": writers.layout,
                                              "shards": list(writers.shards)})
            else:
                _write(tmp / "optimizer.pt", optimizer.state_dict() if optimizer is not None else None)
            _write(tmp / "scheduler.pt", scheduler.state_dict() if scheduler is not None else None)
            _write(tmp / "trainer_state.pt", {"step": step, "extra": extra or {}, "rng": rng_state()})
        if writers is not None:
            writers.barrier()  # every shard is in place
        if writer:
            _commit(tmp, target, run_dir)
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if writer and keep_last is not None:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    if writers is not None:
        writers.barrier()  # nobody looks for the checkpoint before it is there
    return target


def _commit(tmp: Path, target: Path, run_dir: Path) -> None:
    """Rename the finished temporary directory `tmp` into place as `target`, durably."""
    _fsync_dir(tmp)
    if target.exists():  # saving a step again: move the old one aside, then swap the new one in
        old = Path(tempfile.mkdtemp(prefix=f".old-{target.name}-", dir=run_dir))
        os.replace(target, old / target.name)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    _fsync_dir(run_dir)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints under `run_dir`, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and all((p / f).is_file() for f in _FILES):
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def step_of(checkpoint: str | Path) -> int:
    """The step a checkpoint directory was saved at (from its name)."""
    return int(_STEP_DIR.match(Path(checkpoint).name).group(1))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer=None, scheduler=None, *,
                    restore_rng: bool = True, map_location: str | torch.device = "cpu",
                    load_model_state: Callable[[dict], None] | None = None, writers: Writers | None = None) -> dict:
    """Restore what `save_checkpoint` wrote into the given objects; returns `{"step": int, "extra": dict}`, and
    `"optimizer_afresh"`: why, when the optimizer state was not loaded.

    Load the optimizer after building it over the model's own parameters (its state is keyed by position), and
    restore the RNG last thing before training resumes, as it is here, so nothing draws from it in between.
    `map_location` applies to model, optimizer and scheduler; `extra` always comes back on the CPU.
    `load_model_state(state)` loads the saved (whole) model state instead of `model.load_state_dict` (a split
    model). `writers`: this process's part in a run of several; its own optimizer shard is loaded when the
    checkpoint was saved under the same layout, and otherwise (another layout, or a single process's checkpoint
    in a run of several, or the reverse) the optimizer is left as it is.
    """
    path = Path(path)

    def read(name, where=map_location):
        return torch.load(path / name, map_location=where, weights_only=True)

    state = read("model.pt")
    (load_model_state or model.load_state_dict)(state)
    del state
    afresh = None
    if optimizer is not None:
        state = read("optimizer.pt")
        if state is None:
            raise ValueError(f"{path} holds no optimizer state")
        saved = state.get("layout") if state.get("format") == SHARDED else None
        here = writers.layout if writers is not None else None
        if saved != here:
            afresh = f"saved by {saved or 'one process'}, loaded by {here or 'one process'}"
        elif writers is not None:
            optimizer.load_state_dict(read(writers.shard))
        else:
            optimizer.load_state_dict(state)
    if scheduler is not None:
        state = read("scheduler.pt")
        if state is None:
            raise ValueError(f"{path} holds no scheduler state")
        scheduler.load_state_dict(state)
    trainer_state = read("trainer_state.pt", "cpu")  # RNG states are CPU byte tensors, CUDA generators' too
    if restore_rng:
        set_rng_state(trainer_state["rng"])
    out = {"step": int(trainer_state["step"]), "extra": trainer_state["extra"]}
    return out if afresh is None else {**out, "optimizer_afresh": afresh}
