"""Stand-ins for the optional tracker packages (trackio, tensorboard), installed into `sys.modules` so the
wiring can be checked without them: every call they receive is recorded."""

from __future__ import annotations

import importlib.machinery
import sys
import types


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() reports it installed
    return module


def install(monkeypatch) -> dict:
    calls = {"init": [], "log": [], "finish": 0, "scalars": [], "writers": [], "closed": 0}
    trackio = _module("trackio")
    trackio.init = lambda **kwargs: calls["init"].append(kwargs)
    trackio.log = lambda values, step=None: calls["log"].append((step, dict(values)))

    def finish():
        calls["finish"] += 1

    trackio.finish = finish

    class SummaryWriter:
        def __init__(self, log_dir):
            calls["writers"].append(log_dir)

        def add_scalar(self, key, value, step):
            calls["scalars"].append((key, value, step))

        def flush(self):
            pass

        def close(self):
            calls["closed"] += 1

    writer = _module("torch.utils.tensorboard")
    writer.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    monkeypatch.setitem(sys.modules, "tensorboard", _module("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", writer)
    return calls
