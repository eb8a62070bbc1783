"""`agentrl train` on several processes, launched with `python -m torch.distributed.run` (gloo, CPU, tiny Qwen3).

- tp=2 (one replica) as a user types it: three steps, checkpoint shards, a whole `final/` model, then one process
  resuming the run (another mesh: the optimizer starts afresh, with a warning);
- replicas=2 and tp=2 × replicas=2 (`train_worker.py`, a reward the tiny model's rollouts differ in, one replica
  starting every rollout late): three steps leave the replicas bit-identical, and a run resumed from step 2 of the
  same mesh ends bit-identical to the straight run;
- the replica update itself (`run_worker.py`): a replica with no sample still joins the gradient sum, and the
  pooled step matches one process; a replica that drifts stops every rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import torchrun

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
TIMEOUT_S = 240  # a deadlocked collective (gloo's own timeout is 30 min) fails the test here instead
SMALL = ["--rollout.group_size=2", "--rollout.max_new_tokens=8", "--rollout.max_turns=2"]


def launch(nproc: int, args: list[str]) -> str:
    """Run `python -m torch.distributed.run ... args` from the checkout; fail the test on an error or a hang."""
    return torchrun(nproc, args, TIMEOUT_S, cwd=ROOT)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def load(path: Path):
    return torch.load(path, weights_only=True)


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


# ------------------------------------------------------------------------------------------ tp=2, as typed


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("tp") / "run"
    log = launch(2, ["-m", "agentrl", "train", "gsm8k_math", "--model", "tiny-qwen3", "--parallel.tp_size=2",
                     "--max-steps", "3", *SMALL, "--rollout.groups_per_step=2", "--run-dir", str(run_dir)])
    return run_dir, log


def test_tp2_trains_three_steps_and_saves_each_ranks_optimizer_shard(tp_run):
    run_dir, log = tp_run
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/n"] == 4 and r["engine/generated_tokens"] > 0 for r in rows)
    step = run_dir / "step_00000003"
    assert sorted(p.name for p in step.iterdir()) == ["model.pt", "optimizer-replica000-tp000.pt",
                                                      "optimizer-replica000-tp001.pt", "optimizer.pt",
                                                      "scheduler.pt", "trainer_state.pt"]
    assert load(step / "optimizer.pt")["layout"] == "replicas=1 tp=2"
    progress = [line for line in log.splitlines() if line.startswith('{"step": 1, "loss"') and '"reward"' in line]
    assert len(progress) == 1  # rank 0 alone prints progress


def test_tp2_final_model_is_the_whole_model_one_process_loads(tp_run):
    from transformers import AutoModelForCausalLM

    run_dir, _ = tp_run
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    saved = load(run_dir / "step_00000003" / "model.pt")
    assert saved["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # gathered, not one rank's half
    assert all(torch.equal(value, saved[key]) for key, value in final.state_dict().items())


def test_one_process_resumes_a_tp2_run_with_a_fresh_optimizer(tp_run, tmp_path, capsys, monkeypatch):
    from agentrl.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(tp_run[0], run_dir)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert main(["train", "gsm8k_math", "--model", "tiny-qwen3", "--parallel.tp_size=1", "--resume",
                 "--max-steps", "4", *SMALL, "--rollout.groups_per_step=2", "--run-dir", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert "was saved by replicas=1 tp=2, loaded by one process: the model and schedule are loaded, the " \
           "optimizer state starts afresh" in err
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    assert (run_dir / "step_00000004" / "optimizer.pt").exists()


# --------------------------------------------------------------------------------- replicas: identical, resumed

MESHES = {"replicas=2": (2, 1), "tp=2 x replicas=2": (4, 2)}


def replica_args(out: Path, run_dir: Path, nproc: int, tp: int, *extra: str) -> list[str]:
    return [str(HERE / "train_worker.py"), str(out), "--late-rank", str(nproc - tp), "--", "gsm8k_math", "--model",
            "tiny-qwen3", "--max-steps", "3", *SMALL, "--rollout.groups_per_step=3", f"--parallel.tp_size={tp}",
            "--parallel.weight_check_every=1", "--deterministic=true", "--checkpoint.save_every=1",
            "--checkpoint.keep_last=3", "--run-dir", str(run_dir), *extra]


def ranks(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module", params=list(MESHES))
def replica_run(request, tmp_path_factory) -> dict:
    """The straight three steps, then the same run cut back to its step-2 checkpoint and resumed."""
    nproc, tp = MESHES[request.param]
    where = tmp_path_factory.mktemp(request.param.replace(" ", ""))
    straight, resumed = where / "straight", where / "resumed"
    launch(nproc, replica_args(where / "out-straight", straight, nproc, tp))
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_00000003", "final"))
    log = launch(nproc, replica_args(where / "out-resumed", resumed, nproc, tp, "--resume"))
    return {"nproc": nproc, "tp": tp, "straight": straight, "resumed": resumed, "resume_log": log,
            "ranks": ranks(where / "out-straight", nproc), "resumed_ranks": ranks(where / "out-resumed", nproc)}


def test_replicas_hold_bit_identical_weights_after_three_steps(replica_run):
    by_slice: dict[int, set[str]] = {}
    for rank in replica_run["ranks"]:
        assert rank["code"] == 0 and rank["steps_done"] == 3
        by_slice.setdefault(rank["tp_rank"], set()).add(rank["sha256"])
    assert len(by_slice) == replica_run["tp"] and all(len(hashes) == 1 for hashes in by_slice.values())
    assert len({h for hashes in by_slice.values() for h in hashes}) == replica_run["tp"]  # the slices differ


def test_every_step_trained_all_replicas_groups_and_moved_the_weights(replica_run):
    rows = metrics(replica_run["straight"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/n"] == 6  # 3 groups of 2, generated 2 + 1 by the replicas, trained by both
        assert r["grad_norm"] > 0 and r["loss"] != 0 and not r["skipped"]
        assert r["parallel/imbalance"] >= 1.0
    shards = sorted(p.name for p in (replica_run["straight"] / "step_00000003").glob("optimizer-*"))
    assert len(shards) == replica_run["nproc"]


def test_a_run_resumed_on_the_same_mesh_continues_exactly(replica_run):
    assert "resuming" in replica_run["resume_log"] and "optimizer state starts afresh" not in replica_run["resume_log"]
    assert [r["step"] for r in metrics(replica_run["resumed"])] == [1, 2, 3]
    step = "step_00000003"
    for name in sorted(p.name for p in (replica_run["straight"] / step).iterdir()):
        if name != "trainer_state.pt":  # it holds RNG states the rollouts never draw from, and the prompts' state
            assert equal(load(replica_run["straight"] / step / name), load(replica_run["resumed"] / step / name)), name
    assert [r["sha256"] for r in replica_run["resumed_ranks"]] == [r["sha256"] for r in replica_run["ranks"]]


# ------------------------------------------------------------------------------------- the replica update


@pytest.fixture(scope="module")
def update_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("update")
    launch(2, [str(HERE / "run_worker.py"), str(out)])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_replica_with_no_sample_joins_the_sum_and_the_step_matches_one_process(update_ranks):
    for rank in update_ranks:
        lone, pooled, alike = rank["steps"]
        assert lone["param_diff"] == 0.0 and lone["grad_norm"][0] == lone["grad_norm"][1] > 0  # one sample: exact
        assert lone["imbalance"] == 2.0  # all of it on one replica
        assert pooled["param_diff"] <= 1e-5  # summed in another order; Adam's eps bounds what that moves
        for got, want in (pooled["grad_norm"], pooled["loss"]):
            assert got == pytest.approx(want, rel=1e-4)
        assert lone["trained_tokens"][0] == lone["trained_tokens"][1]
        assert pooled["trained_tokens"][0] == pooled["trained_tokens"][1]
        assert pooled["zero_advantage_samples"] == [1, 1] and alike["zero_advantage_samples"] == [3, 3]
        # nothing to run anywhere: every replica updates on zero gradients, as one process does (Adam's moments)
        assert alike["param_diff"] <= 1e-5 and alike["grad_norm"] == [0.0, 0.0]
        assert rank["changed"] > 1e-4  # the steps moved the weights


def test_a_replica_that_drifts_stops_every_rank_with_the_parameter_named(update_ranks):
    for rank in update_ranks:
        assert rank["divergence"] == ("after step 7: replica 1 holds different weights from replica 0 (tp rank 0): "
                                      "first differing parameter 'model.norm.weight', 1 of 24 differ; stopping the run")
