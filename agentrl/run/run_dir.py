"""A run directory's life: start fresh, resume, or refuse, decided before any model loads; and the files a run
writes there, each atomically (config.yaml, metrics.jsonl cut back to the checkpoint on resume, final/)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agentrl.config import ConfigError

# Keys a resumed run may change without asking: how long it runs and how it logs and saves.
FREE_TO_CHANGE = ("steps", "time_limit_s", "checkpoint.save_every", "checkpoint.keep_last", "metrics.")
# Keys no resume can change: the checkpoint could not be loaded into what they describe.
IDENTITY = ("model.name", "env.name")


@dataclass
class Plan:
    action: Literal["fresh", "resume", "finished"]
    step: int = 0  # the checkpoint's step when resuming
    message: str = ""  # one line for the user, or "" for a fresh start


def plan_run(cfg, mode: Literal["auto", "resume", "overwrite"] = "auto") -> Plan:
    """What `agentrl train` does with `cfg.checkpoint.run_dir`. `auto` resumes a run whose saved config matches
    (apart from FREE_TO_CHANGE) and refuses one that differs, naming the keys; `resume` resumes despite differences
    (the identity keys excepted); `overwrite` starts fresh, clearing the directory's checkpoints and metrics."""
    from agentrl.train.checkpoint import latest_checkpoint, step_of

    run_dir = Path(cfg.checkpoint.run_dir)
    checkpoint = latest_checkpoint(run_dir)
    if mode == "overwrite" or not cfg.checkpoint.resume:
        if checkpoint is not None or (run_dir / "metrics.jsonl").exists():
            return Plan("fresh", message=f"agentrl: starting {run_dir} afresh (its earlier checkpoints are replaced)")
        return Plan("fresh")
    if checkpoint is None:
        return Plan("fresh")
    step = step_of(checkpoint)
    saved = _saved_config(run_dir)
    if saved is not None:
        differing = _differences(saved, cfg)
        fixed = [k for k in differing if k in IDENTITY]
        if fixed:
            raise ConfigError(f"{run_dir} holds a run of another {' and '.join(fixed)} "
                              f"({', '.join(f'{k}: {differing[k][0]!r} there, {differing[k][1]!r} asked' for k in fixed)});"
                              f" pass --run-dir for a new run, or --overwrite to replace it")
        if differing and mode != "resume":
            listed = ", ".join(f"{k} ({a!r} -> {b!r})" for k, (a, b) in sorted(differing.items()))
            raise ConfigError(f"{run_dir} was run with another config: {listed}; pass --resume to continue it with "
                              f"the new values, --overwrite to start it afresh, or --run-dir for a new run")
    if step >= cfg.steps:
        return Plan("finished", step, f"agentrl: {run_dir} already finished {step} steps; pass --max-steps N (N > "
                                      f"{step}) to train further, or --overwrite to start again")
    return Plan("resume", step, f"agentrl: resuming {run_dir} from step {step} of {cfg.steps} "
                                f"(--overwrite starts afresh)")


def clear_run(run_dir: Path) -> None:
    """Remove what a previous run left (checkpoints, metrics, final model); other files stay."""
    from agentrl.train.checkpoint import list_checkpoints

    for checkpoint in list_checkpoints(run_dir):
        shutil.rmtree(checkpoint, ignore_errors=True)
    for name in ("metrics.jsonl", "final"):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cut_metrics(path: Path, step: int) -> None:
    """Drop the lines past `step` (written after the checkpoint a run resumes from), so no step appears twice."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the crash
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
    write_atomic(path, "".join(f"{line}\n" for line in kept))


def write_directory_atomic(target: Path, write) -> None:
    """`write(tmp_dir)` fills a temporary directory beside `target`, which then replaces `target` in one rename, so a
    kill mid-write leaves the previous directory (or none), never a half-written one."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".old-{target.name}-", dir=target.parent))
            os.replace(target, old / target.name)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _saved_config(run_dir: Path) -> dict | None:
    import yaml

    path = run_dir / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def _differences(saved: dict, cfg) -> dict[str, tuple]:
    import yaml

    from agentrl.config import to_yaml

    before, after = _flatten(saved), _flatten(yaml.safe_load(to_yaml(cfg)))
    out = {}
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a != b and not any(key == k or (k.endswith(".") and key.startswith(k)) for k in FREE_TO_CHANGE):
            out[key] = (a, b)
    return out


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "args":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
