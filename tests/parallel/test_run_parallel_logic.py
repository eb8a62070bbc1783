"""The run's multi-process pieces that need no process group: prompts shared out by replica (and regrouped for
another number of replicas on resume), each replica's part of a step, metrics of several replicas as one step's,
sharded checkpoints written and read under one layout or another, and the config's rule."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import ConfigError
from agentrl.models import load_model
from agentrl.parallel import ParallelConfig
from agentrl.parallel.mesh import Mesh
from agentrl.parallel.replicas import assign
from agentrl.rollout import PromptIterator
from agentrl.run.config import TrainConfig
from agentrl.run.distributed import (GROUP_IDS, ParallelRun, ShardedPromptIterator, combine_train_metrics,
                                     regroup_prompt_states, restore_rollout_state)
from agentrl.train import checkpoint as ckpt
from agentrl.train.config import OptimConfig
from agentrl.train.optim import build_optimizer, build_scheduler

DATASET = [{"question": f"q{i}", "answer": str(i)} for i in range(23)]


def mesh(replica: int, n_replicas: int, tp_rank: int = 0, tp_size: int = 1) -> Mesh:
    return Mesh(rank=replica * tp_size + tp_rank, world_size=n_replicas * tp_size, local_rank=0, tp_size=tp_size,
                n_replicas=n_replicas, tp_rank=tp_rank, replica=replica, device=torch.device("cpu"))


def draw(iterator, n: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(n):
        prompt = next(iterator)
        iterator.consumed(prompt)
        out.append((prompt.epoch, prompt.index))
    return out


class FakeDriver:
    def __init__(self, next_group_id=0):
        self.next_group_id = next_group_id

    def state_dict(self):
        return {"next_group_id": self.next_group_id}

    def load_state_dict(self, state):
        self.next_group_id = state["next_group_id"]


def test_replicas_read_each_prompt_of_an_epoch_once_in_the_single_process_order():
    single = draw(PromptIterator(DATASET, seed=3), len(DATASET))
    shards = [ShardedPromptIterator(DATASET, replica=r, n_replicas=3, seed=3) for r in range(3)]
    read = [draw(shard, len(range(r, len(DATASET), 3))) for r, shard in enumerate(shards)]
    assert sorted(p for part in read for p in part) == sorted(single)  # every prompt once
    assert [read[i % 3][i // 3] for i in range(len(DATASET))] == single  # interleaved: one process's order
    assert draw(shards[1], 1)[0][0] == 1  # past its share: the next epoch


def test_too_few_prompts_for_the_replicas_is_refused():
    with pytest.raises(ValueError, match="2 prompts for 3 replicas"):
        ShardedPromptIterator(DATASET[:2], replica=0, n_replicas=3)


@pytest.mark.parametrize("n_new", [1, 2, 3, 5])
def test_a_resume_on_another_number_of_replicas_reads_every_unread_prompt_and_few_twice(n_new):
    old = [ShardedPromptIterator(DATASET, replica=r, n_replicas=2, seed=1) for r in range(2)]
    before = draw(old[0], 7) + draw(old[1], 4)  # replica 0 ran ahead
    states = [it.state_dict() for it in old]
    new = []
    for r in range(n_new):
        it = ShardedPromptIterator(DATASET, replica=r, n_replicas=n_new, seed=1)
        it.load_state_dict(regroup_prompt_states(states, r, n_new))
        new.append(it)
    after = [p for r, it in enumerate(new) for p in draw(it, len(range(r, len(DATASET), n_new)) - it.position)]
    epoch0 = {p for p in before + after if p[0] == 0}
    assert len(epoch0) == len(DATASET)  # nothing of the epoch is skipped
    assert all(p[0] == 0 for p in after)  # the new replicas finish epoch 0 before any starts epoch 1
    again = len(before) + len(after) - len(DATASET)
    assert 0 <= again <= 7 - 4  # read twice: at most what replica 0 had read beyond replica 1


def test_prompts_drawn_but_not_trained_are_shared_out_on_regrouping():
    old = [ShardedPromptIterator(DATASET, replica=r, n_replicas=2, seed=1) for r in range(2)]
    draw(old[0], 2), draw(old[1], 2)
    pending = [next(old[0]), next(old[1])]  # drawn, not consumed: they replay first
    states = [it.state_dict() for it in old]
    single, driver = PromptIterator(DATASET, seed=1), FakeDriver()
    extra = {"replicas": [{"prompts": s, "driver": {"next_group_id": g}} for s, g in zip(states, [5, GROUP_IDS + 9])]}
    restore_rollout_state(extra, single, driver)
    assert [next(single) for _ in range(2)] == pending
    assert driver.next_group_id == 9  # past every group id an old replica used


def test_a_single_process_checkpoint_restores_exactly_as_before():
    prompts, driver = PromptIterator(DATASET, seed=2), FakeDriver()
    draw(prompts, 5)
    extra = {"prompts": prompts.state_dict(), "driver": {"next_group_id": 4}, "stepper": {}}
    fresh, fresh_driver = PromptIterator(DATASET, seed=2), FakeDriver()
    restore_rollout_state(extra, fresh, fresh_driver)
    assert fresh.state_dict() == prompts.state_dict() and fresh_driver.next_group_id == 4
    replica, replica_driver = ShardedPromptIterator(DATASET, replica=1, n_replicas=2, seed=2), FakeDriver()
    restore_rollout_state(extra, replica, replica_driver, 1, 2)  # one process's checkpoint → two replicas
    assert draw(replica, 1)[0] == draw(PromptIterator(DATASET, seed=2), 6)[5]  # position 5 of the order is 1's
    assert replica_driver.next_group_id == GROUP_IDS + 4


@pytest.mark.parametrize("groups", [1, 4, 7])
def test_the_replicas_generate_the_steps_groups_between_them(groups):
    cfg = TrainConfig()
    parts = [ParallelRun(mesh(r, 3), cfg).groups_to_generate(groups) for r in range(3)]
    assert sum(parts) == groups and max(parts) - min(parts) <= 1


def test_metrics_of_the_replicas_combine_into_one_steps():
    rows = [{"loss": 0.5, "grad_norm": 2.0, "lr": 1e-6, "skipped": False, "train_seconds": 2.0, "trained_tokens": 300,
             "trained_tokens_per_s": 150.0, "generated_tokens": 100, "rows": 1, "tokens": 100,
             "loss/is_ratio_mean": 1.0, "loss/is_ratio_max": 1.5, "loss/staleness_hist": {"0": 100}},
            {"loss": 0.0, "grad_norm": 2.0, "lr": 1e-6, "skipped": False, "train_seconds": 4.0, "trained_tokens": 100,
             "trained_tokens_per_s": 25.0, "generated_tokens": 300, "rows": 1, "tokens": 300,
             "loss/is_ratio_mean": 2.0, "loss/is_ratio_max": 1.2, "loss/staleness_hist": {"0": 200, "1": 100}}]
    out = combine_train_metrics(rows, pooled_loss=0.25)
    assert out["loss"] == 0.25 and out["grad_norm"] == 2.0
    assert (out["trained_tokens"], out["generated_tokens"], out["rows"], out["tokens"]) == (400, 400, 2, 400)
    assert out["train_seconds"] == 4.0 and out["trained_tokens_per_s"] == 100.0  # over the slowest replica
    assert out["loss/is_ratio_mean"] == pytest.approx((1.0 * 100 + 2.0 * 300) / 400)
    assert out["loss/is_ratio_max"] == 1.5 and out["loss/staleness_hist"] == {"0": 300, "1": 100}


OPTIM = OptimConfig(lr=1e-3, warmup_steps=0)


def stepped(seed: int):
    model = load_model("tiny-qwen3", seed=seed)[0]
    optimizer = build_optimizer(model, OPTIM)
    scheduler = build_scheduler(optimizer, OPTIM, 4)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step(), scheduler.step()
    return model, optimizer, scheduler


def writers(layout: str) -> ckpt.Writers:
    return ckpt.Writers(writer=True, shard="optimizer-replica000-tp000.pt", shards=("optimizer-replica000-tp000.pt",),
                        layout=layout, barrier=lambda: None)


def test_a_sharded_checkpoint_loads_its_shard_under_its_layout_and_starts_afresh_elsewhere(tmp_path):
    model, optimizer, scheduler = stepped(0)
    path = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, scheduler, extra={"k": 1},
                                writers=writers("replicas=1 tp=2"))
    assert sorted(p.name for p in path.iterdir()) == ["model.pt", "optimizer-replica000-tp000.pt", "optimizer.pt",
                                                      "scheduler.pt", "trainer_state.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # no temporary left behind
    assert ckpt.latest_checkpoint(tmp_path) == path

    same, same_opt, same_sched = stepped(1)
    state = ckpt.load_checkpoint(path, same, same_opt, same_sched, writers=writers("replicas=1 tp=2"))
    assert "optimizer_afresh" not in state and state["extra"] == {"k": 1}
    assert all(torch.equal(a, b) for a, b in zip(same.parameters(), model.parameters()))
    assert torch.equal(same_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])

    for where in ({"writers": writers("replicas=2 tp=1")}, {}):  # another layout; one process
        other, other_opt, other_sched = stepped(1)
        moments = other_opt.state_dict()["state"][0]["exp_avg"].clone()
        state = ckpt.load_checkpoint(path, other, other_opt, other_sched, **where)
        assert state["optimizer_afresh"].startswith("saved by replicas=1 tp=2, loaded by ")
        assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], moments)  # left as it was
        assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))  # the model loads
        assert other_sched.last_epoch == 1  # and the schedule


def test_a_single_process_checkpoint_in_a_run_of_several_starts_the_optimizer_afresh(tmp_path):
    model, optimizer, scheduler = stepped(0)
    path = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    state = ckpt.load_checkpoint(path, *stepped(1), writers=writers("replicas=2 tp=1"))
    assert state["optimizer_afresh"] == "saved by one process, loaded by replicas=2 tp=1"


def test_compiled_layers_under_tensor_parallelism_are_a_config_error():
    with pytest.raises(ConfigError, match="model.compile_layers"):
        TrainConfig.from_dict({"parallel": {"tp_size": 2}, "model": {"compile_layers": True}})
    assert TrainConfig.from_dict({"parallel": {"tp_size": 2}}).parallel == ParallelConfig(tp_size=2)


def test_a_prefix_sharing_trainer_gets_whole_groups_per_replica():
    from types import SimpleNamespace

    mesh = Mesh(rank=0, world_size=2, local_rank=0, tp_size=1, n_replicas=2, tp_rank=0, replica=0,
                device=torch.device("cpu"))
    run = ParallelRun.__new__(ParallelRun)
    run.mesh = mesh
    samples = [SimpleNamespace(group_id=g) for g in (0, 0, 1, 1, 1, 2, 2, None)]
    lengths = [10, 12, 30, 30, 31, 5, 6, 40]
    shares = run._share_out(samples, lengths, SimpleNamespace(share_prefix=True))
    assert sorted(i for s in shares for i in s) == list(range(8))
    for share in shares:  # no group is split
        groups = {samples[i].group_id for i in share}
        assert all({j for j, s in enumerate(samples) if s.group_id == g} <= set(share) for g in groups if g is not None)
    # Without sharing, samples are placed one by one (the Σ L² assignment of single samples).
    assert run._share_out(samples, lengths, SimpleNamespace(share_prefix=False)) == assign(lengths, 2)
