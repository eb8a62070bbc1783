"""The layout's promises, checked from the source: the import graph has no circle and points one way, the wiring
module is the only place that imports every part, each knob is defined once, and every key of the shipped example
configs reaches the component that owns it."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "agentrl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module → the agentrl modules it imports anywhere in its file (lazy imports inside functions included)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def _part(module: str) -> str:
    """The top-level part of agentrl a module belongs to: env, chat, engine, rollout, train, run, ..."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "agentrl"


def test_the_import_graph_has_no_circle():
    graph = _import_graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


# What each part may not import: arrows point one way (environments → env → chat → rollout → engine; the trainer
# consumes finished samples; the run module wires them).
FORBIDDEN = {
    "train": {"engine", "rollout", "env", "chat", "run", "cli", "view"},
    "engine": {"env", "chat", "rollout", "train", "run", "cli"},
    "env": {"engine", "rollout", "train", "run", "cli"},
    "chat": {"engine", "rollout", "train", "run", "cli"},
    "rollout": {"train", "run", "cli"},
    "sample": {"engine", "rollout", "env", "chat", "train", "run"},
    "config": {"engine", "rollout", "env", "chat", "train", "run"},
}


def test_each_part_imports_only_what_the_flow_allows():
    graph = _import_graph()
    wrong = [f"{module} imports {target}" for module, targets in graph.items() for target in targets
             if _part(target) in FORBIDDEN.get(_part(module), set())]
    assert not wrong, "\n".join(sorted(wrong))


def test_only_the_run_module_imports_every_part():
    graph = _import_graph()
    every = {"env", "chat", "engine", "rollout", "train"}
    by_part: dict[str, set[str]] = {}
    for module, targets in graph.items():
        by_part.setdefault(_part(module), set()).update(_part(t) for t in targets)
    wiring = sorted(p for p, parts in by_part.items() if every <= parts | {p})
    assert wiring == ["run"], wiring


def test_config_modules_import_no_torch():
    for path in [PACKAGE / "config.py", *PACKAGE.glob("*/config.py")]:
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "torch" not in imported, path


ROLLOUT_KNOBS = ["group_size", "groups_per_step", "max_turns", "max_new_tokens", "max_sample_tokens", "temperature",
                 "rollouts_in_flight", "max_ready_batches", "drop_truncated", "advantage"]


@pytest.mark.parametrize("knob", ROLLOUT_KNOBS)
def test_each_rollout_knob_is_defined_once(knob):
    # Knobs are config fields; a request's own parameters (the engine's SamplingParams) are not knobs.
    pattern = re.compile(rf"^\s+{knob}: [^=]+=", re.M)  # a dataclass field with a default
    configs = [*PACKAGE.rglob("config.py"), *(PACKAGE / "run").glob("*.py"), PACKAGE / "cli.py"]
    found = [str(p.relative_to(ROOT)) for p in configs if pattern.search(p.read_text())]
    assert found == ["agentrl/rollout/config.py"], found


def _yaml_leaves(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict) and key != "args":
            yield from _yaml_leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_key_of_an_example_config_reaches_its_owner(path, tmp_path, capsys):
    import yaml

    from agentrl.config import coerce
    from agentrl.engine.config import DENSE_STEP_TOKENS, EngineConfig
    from agentrl.run.build import build_run
    from agentrl.run.config import TrainConfig

    cfg = TrainConfig.from_yaml(path)
    assert capsys.readouterr().err == "", "an example config uses a deprecated key"
    # Every key in the file is set on the section its name says (no key silently dropped or renamed).
    for key, value in _yaml_leaves(yaml.safe_load(path.read_text())):
        section, _, field = key.rpartition(".")
        owner = getattr(cfg, section) if section else cfg
        hint = typing.get_type_hints(type(owner))[field]
        assert getattr(owner, field) == coerce(value, hint, key), key

    # ... and each section is the very object its component runs with (a tiny model and built-in data here).
    small = TrainConfig.from_yaml(path, ["--model.name=tiny-qwen3", "--env.data=null", "--env.data_rows=null",
                                         f"--checkpoint.run_dir={tmp_path}", "--engine.gpu_memory_fraction=0.05"])
    run = build_run(small)
    try:
        assert run.driver.config is small.rollout
        assert run.trainer.config is small.trainer and run.trainer.loss_config is small.loss
        assert run.trainer.temperature == small.rollout.temperature
        derived = {"max_model_len", "eos_token_ids", "seed", "compile", "max_tokens_per_step"}
        for f in dataclasses.fields(EngineConfig):
            if f.name not in derived:
                assert getattr(run.engine.config, f.name) == getattr(small.engine, f.name), f.name
        assert run.engine.config.max_tokens_per_step == (small.engine.max_tokens_per_step or DENSE_STEP_TOKENS)
        assert run.engine.max_model_len == small.rollout.max_sample_tokens
        for key, value in small.env.args.items():
            assert getattr(run.env, key) == value, key
        assert run.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
            small.optim.lr * run.trainer.scheduler.lr_lambdas[0](0))
    finally:
        run.engine.stop()
