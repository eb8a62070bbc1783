"""Optional experiment trackers beside `metrics.jsonl`, which is always written: TensorBoard event files under
`run_dir/tensorboard`, and a trackio project. Both are optional dependencies, so the config names them
(`metrics.report_to`) and a missing package is a config error before any model loads, not a crash after the
first step. Trackers receive each step's numbers (flags and strings stay in the JSONL)."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

TRACKERS = ("tensorboard", "trackio")


def missing(names) -> list[str]:
    """The trackers among `names` whose package is not installed (tensorboard writes through torch's writer,
    which needs the tensorboard package)."""
    return [name for name in names if find_spec(name) is None]


def numbers(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _TensorBoard:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # as the JSONL: a crashed run keeps its curve

    def close(self) -> None:
        self.writer.close()


class _Trackio:
    def __init__(self, run_dir: Path, project: str, config: dict, resume: bool):
        import trackio

        self.trackio = trackio
        # The run is named after its directory, so a resumed run continues the same trackio run.
        trackio.init(project=project, name=run_dir.name, config=config, resume="allow" if resume else "never")

    def log(self, values: dict[str, float], step: int) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


class Trackers:
    """Every configured tracker, fed one step record at a time."""

    def __init__(self, names, run_dir: Path, project: str, config: dict, resume: bool):
        self._trackers = []
        for name in names:
            if name == "tensorboard":
                self._trackers.append(_TensorBoard(run_dir))
            elif name == "trackio":
                self._trackers.append(_Trackio(run_dir, project, config, resume))
            else:
                raise ValueError(f"unknown tracker {name!r}: one of {TRACKERS}")

    def log(self, record: dict) -> None:
        values = numbers(record)
        for tracker in self._trackers:
            tracker.log(values, record["step"])

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()


class MetricsLog:
    """One JSON line per step in `metrics.jsonl`, flushed at once so a crashed run keeps its curve; the same record
    goes to the configured trackers."""

    def __init__(self, path: Path, resume: bool, trackers: Trackers | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a" if resume else "w")
        self._trackers = trackers

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._trackers is not None:
            self._trackers.log(record)

    def close(self) -> None:
        self._file.close()
        if self._trackers is not None:
            self._trackers.close()
