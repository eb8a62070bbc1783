"""The decisions every rank takes alone (balance, selection, ownership, the loss denominator), and the
single-process paths of the parallel package: in-process, no process group."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import ConfigError
from agentrl.parallel import (ParallelConfig, ReadinessGate, SharedPool, ShardedAdamW, apply_tensor_parallel, assign,
                              imbalance, init_mesh, local_head_counts, pooled_loss_denominator, reduce_gradients,
                              select_oldest, sum_over_replicas)
from agentrl.parallel.sharded_adam import partition_by_numel
from agentrl.parallel.tensor_parallel import check_divisible, tensor_parallel_plan
from agentrl.parallel.weight_check import check_replica_weights, parameter_hashes
from agentrl.models import load_model, tiny_config
from agentrl.sample import TrainingSample
from agentrl.train.config import LossConfig
from agentrl.train.loss import loss_denominator
from agentrl.train.pack import pack_samples


@pytest.fixture
def single(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    return init_mesh(ParallelConfig())


# ---------------------------------------------------------------------------------------------- assignment


def test_assign_balances_sum_of_squares_longest_first():
    # Σ L² puts the three 6s together against the 10 (100 vs 108); balancing Σ L would pair a 6 with the 10.
    assert assign([10, 6, 6, 6], 2) == [[0], [1, 2, 3]]
    assert assign([10, 9, 8, 2, 2, 1], 2) == [[0, 3, 4, 5], [1, 2]]


def test_assign_breaks_ties_by_count_then_replica_then_index():
    assert assign([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert assign([3, 3, 3], 2) == [[0, 2], [1]]
    assert assign([7], 3) == [[0], [], []]
    assert assign([], 2) == [[], []]


def test_assign_is_a_partition_and_deterministic():
    lengths = torch.randint(1, 500, (97,), generator=torch.Generator().manual_seed(0)).tolist()
    shares = assign(lengths, 4)
    assert sorted(i for share in shares for i in share) == list(range(97))
    assert shares == assign(list(lengths), 4)
    assert imbalance(lengths, shares) < 1.05


def test_imbalance():
    assert imbalance([10, 6, 6, 6], [[0], [1, 2, 3]]) == pytest.approx(108 / 104)
    assert imbalance([], [[], []]) == 1.0


def test_select_oldest_takes_by_age_not_length_or_order():
    assert select_oldest([3.0, 1.0, 2.0, 1.0], 3) == [1, 3, 2]
    assert select_oldest([3.0, 1.0], 5) == [1, 0]
    assert select_oldest([3.0, 1.0], 0) == []


def test_shared_pool_on_one_replica(single):
    pool = SharedPool(single)
    pool.exchange(["c", "a", "b"], [3.0, 1.0, 2.0])
    pool.exchange(["d"], [0.5])
    assert len(pool) == 4
    assert pool.take_oldest(2) == ["d", "a"]
    assert pool.take_oldest(5) == ["b", "c"]
    with pytest.raises(ValueError):
        pool.exchange(["x"], [])


def test_partition_by_numel_largest_first_to_the_lightest():
    assert partition_by_numel([100, 60, 50, 10, 10], 2) == [0, 1, 1, 0, 0]
    assert partition_by_numel([1, 1, 1], 4) == [0, 1, 2]


# ------------------------------------------------------------------------------------ loss denominator


def _samples():
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate((9, 5, 12, 7)):
        trainable = [0, 0] + [1] * (n - 4) + [0, 1]
        versions = [(i % 3) if t else -1 for t in trainable]
        out.append(TrainingSample(torch.randint(0, 256, (n,), generator=g).tolist(), trainable,
                                  [-1.0 if t else 0.0 for t in trainable], versions, advantage=0.1 * i))
    return out


@pytest.mark.parametrize("cfg", [LossConfig(type="grpo"), LossConfig(type="dapo"), LossConfig(type="dr_grpo"),
                                 LossConfig(type="grpo", max_staleness=0), LossConfig(type="dapo", max_staleness=1)])
def test_pooled_denominator_is_the_union_batch_denominator(cfg):
    samples = _samples()
    expected = float(loss_denominator(pack_samples(samples, 16).trainable_tokens(), cfg, current_version=2))
    assert pooled_loss_denominator(samples, cfg, current_version=2) == expected


# ------------------------------------------------------------------------------------ single process


def test_parallel_config_checks_its_values():
    assert ParallelConfig(tp_size="2").tp_size == 2
    with pytest.raises(ConfigError, match="parallel.tp_size"):
        ParallelConfig(tp_size=0)
    with pytest.raises(ConfigError, match="parallel.ready_check_every"):
        ParallelConfig(ready_check_every=0)


def test_single_process_gets_a_trivial_mesh(single):
    import torch.distributed as dist

    assert (single.world_size, single.n_replicas, single.tp_size, single.replica, single.tp_rank) == (1, 1, 1, 0, 0)
    assert single.is_main and not single.distributed
    assert single.tp_mesh is None and single.replica_group is None
    assert not dist.is_initialized()


def test_world_not_divisible_by_tp_size_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="tp_size=2 does not divide the 3 processes") as info:
        init_mesh(ParallelConfig(tp_size=2))
    assert "\n" not in str(info.value)


def test_single_process_paths_are_no_ops(single):
    model, _ = load_model("tiny-qwen3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_tensor_parallel(model, single) is model
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    reduce_gradients(model.parameters(), single)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert sum_over_replicas([1.5, 2.0], single) == [1.5, 2.0]
    check_replica_weights(model, single)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    gate = ReadinessGate(single, every=8)
    assert [gate.poll(n, needed=2) for n in (0, 1, 2)] == [False, False, True] and gate.collectives == 0


def test_sharded_adam_on_one_replica_is_adamw(single):
    model, _ = load_model("tiny-qwen3")
    reference, _ = load_model("tiny-qwen3")
    groups = lambda m: [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                        {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    sharded = ShardedAdamW(groups(model), single, lr=1e-2)
    plain = torch.optim.AdamW(groups(reference), lr=1e-2)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        for p, q in zip(model.parameters(), reference.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        sharded.step()
        plain.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    sharded.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_parameter_hash_sees_one_ulp_and_a_swap():
    model, _ = load_model("tiny-qwen3")
    names, base = parameter_hashes(model)
    assert torch.equal(parameter_hashes(load_model("tiny-qwen3")[0])[1], base)
    w = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    with torch.no_grad():
        w.view(-1)[5] = torch.nextafter(w.view(-1)[5], torch.tensor(float("inf")))
    changed = parameter_hashes(model)[1] != base
    assert [n for n, c in zip(names, changed) if c] == ["model.layers.0.mlp.up_proj.weight"]
    w = dict(model.named_parameters())["model.norm.weight"]
    with torch.no_grad():
        w[:2] = torch.tensor([1.0, 2.0])
        _, before = parameter_hashes(model)
        w[:2] = torch.tensor([2.0, 1.0])  # the same bytes, in another order
    assert not torch.equal(parameter_hashes(model)[1], before)


# ------------------------------------------------------------------------------------------------ the plan


def test_plan_names_real_modules_of_both_models():
    for name, split in (("tiny-qwen3", 0), ("tiny-qwen3.5", 5)):
        model, _ = load_model(name)
        plan = tensor_parallel_plan(model)
        modules = dict(model.named_modules())
        assert all(key in modules for key in plan)
        assert plan["model.layers.1.self_attn.o_proj"] == "rowwise"
        assert plan["model.layers.1.mlp.gate_proj"] == "colwise"
        assert sum(style == "colwise_gather_output" for style in plan.values()) == split * 2  # linear attention


def test_an_embedding_rowwise_entry_leaves_the_embedding_whole():
    """transformers 5.17 adds `embed_tokens: embedding_rowwise` to a model's plan; the embedding stays whole (it is
    not split, and the plan is accepted), and an unknown style still raises."""
    model, _ = load_model("tiny-qwen3")
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    plan = tensor_parallel_plan(model)
    assert "model.embed_tokens" not in plan and plan["model.layers.1.self_attn.o_proj"] == "rowwise"
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "norm": "sequence_parallel"}
    with pytest.raises(NotImplementedError, match="'sequence_parallel'"):
        tensor_parallel_plan(model)


def test_local_head_counts_and_divisibility():
    config = tiny_config("tiny-qwen3")
    assert local_head_counts(config, 2) == (2, 1)
    check_divisible(config, 2)
    with pytest.raises(ValueError, match="tp_size=4 must divide"):
        check_divisible(config, 4)
