"""A model name that gives no model is one `ModelNotFound` line, at once: a local path that does not exist, a
folder without a model, a hub id without network or with HF_HUB_OFFLINE set; a hub id already in the hub cache
loads from it without network."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agentrl.models import EMBEDDED, TINY_MODELS, ModelNotFound, load_model

CHOICES = f"pass a local directory, a .gguf file or one of: {', '.join((EMBEDDED, *TINY_MODELS))}"


def not_found(name: str) -> str:
    with pytest.raises(ModelNotFound) as caught:
        load_model(name)
    assert isinstance(caught.value, ValueError)
    return str(caught.value)


@pytest.mark.parametrize("relative", ["runs/gsm8k_math/final", "./nope", "nope/"])
def test_local_path_that_does_not_exist(tmp_path, monkeypatch, relative):
    monkeypatch.chdir(tmp_path)
    assert not_found(relative) == f"no such directory: {relative}; {CHOICES}"
    assert not_found(str(tmp_path / "nope")) == f"no such directory: {tmp_path / 'nope'}; {CHOICES}"


def test_folder_or_file_without_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    assert not_found(str(tmp_path)) == f"{tmp_path} is a directory but holds no model (no config.json); {CHOICES}"
    assert not_found(str(tmp_path / "weights.bin")) == f"{tmp_path / 'weights.bin'} is a file, not a model " \
                                                       f"directory; {CHOICES}"


# In a fresh interpreter: the hub client reads its endpoint, cache and offline switch from the environment once.
HUB = """
import json, sys, torch
from agentrl.models import ModelNotFound, load_model
out = {}
for name in sys.argv[1:]:
    try:
        model, tok = load_model(name)
        out[name] = sum(float(p.double().sum()) for p in model.state_dict().values())
    except ModelNotFound as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""


def hub_start(tmp_path, *names: str, **env: str) -> subprocess.Popen:
    # A closed local port stands for "no network", wherever the tests run.
    environ = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    environ.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT="http://127.0.0.1:9", **env)
    return subprocess.Popen([sys.executable, "-c", HUB, *names], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=environ, cwd=tmp_path)


def hub_results(*procs: subprocess.Popen) -> list[dict]:
    done = []
    for proc in procs:  # every child waited for before any assertion, so none outlives the test
        try:
            done.append((proc, *proc.communicate(timeout=300)))
        except subprocess.TimeoutExpired:
            proc.kill()
            done.append((proc, *proc.communicate()))
    for proc, _, stderr in done:
        assert proc.returncode == 0, stderr[-3000:]
    return [json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in done]


def cache_tiny_model(tmp_path, repo_id: str) -> float:
    """tiny-qwen3 saved into the hub cache's layout, as a download of `repo_id` would have left it."""
    model, tok = load_model("tiny-qwen3")
    repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    model.save_pretrained(repo / "snapshots" / commit)
    tok.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return sum(float(p.double().sum()) for p in model.state_dict().values())


def test_hub_ids_without_network(tmp_path):
    weights = cache_tiny_model(tmp_path, "agentrl-tests/tiny")
    # Both fresh interpreters at once: each spends its seconds importing torch and transformers, on a core of its own.
    online = hub_start(tmp_path, "agentrl-tests/no-such-model", "tiny-qwen", "agentrl-tests/tiny")
    offline = hub_start(tmp_path, "agentrl-tests/no-such-model", "agentrl-tests/tiny", HF_HUB_OFFLINE="1")
    out, offline = hub_results(online, offline)
    missing = out["agentrl-tests/no-such-model"]
    assert missing == f"could not download agentrl-tests/no-such-model: no network; {CHOICES}"
    assert out["tiny-qwen"] == f"could not download tiny-qwen: no network; {CHOICES} (did you mean tiny-qwen3?)"
    assert out["agentrl-tests/tiny"] == pytest.approx(weights)  # from the cache, without network

    assert offline["agentrl-tests/no-such-model"] == ("could not load agentrl-tests/no-such-model: HF_HUB_OFFLINE is "
                                                      f"set and it is not in the hub cache; {CHOICES}")
    assert offline["agentrl-tests/tiny"] == pytest.approx(weights)
