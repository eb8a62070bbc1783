"""Tensor parallelism and replicas on real process groups: `worker.py` launched under torch.distributed.run
(gloo, CPU, tiny fp32 models), each rank comparing itself with the single-process reference it also computes.

Three launches: 2 processes run tp=2 (one replica) and then replicas=2 (tp=1) on meshes of their own; 4 processes
run tp=2 × replicas=2; 2 processes run the engine over a tp=2 model (`engine_scenario.py`), on a launch of its own
so that a failure there leaves the others' results standing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import torchrun

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORKER = Path(__file__).with_name("worker.py")
TIMEOUT_S = 150  # a deadlocked collective (gloo's own timeout is 30 min) fails the test here instead


def launch(nproc: int, specs: list[str], out: Path) -> dict[str, list[dict]]:
    torchrun(nproc, [str(WORKER), str(out), *specs], TIMEOUT_S)
    results = {}
    for spec in specs:
        where = out / spec.replace(":", "-tp")
        results[spec] = [json.loads((where / f"rank{r}.json").read_text()) for r in range(nproc)]
    return results


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    return launch(2, ["tp:2", "replicas:1"], tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    return launch(4, ["replicas:2"], tmp_path_factory.mktemp("four"))


@pytest.fixture(params=["replicas=2", "tp=2 x replicas=2"])
def replica_ranks(request, two_processes, four_processes):
    if request.param == "replicas=2":
        return two_processes["replicas:1"]
    return four_processes["replicas:2"]


@pytest.fixture(scope="module")
def engine_ranks(tmp_path_factory):
    return launch(2, ["engine:2"], tmp_path_factory.mktemp("engine"))["engine:2"]


MODELS = ("tiny-qwen3", "tiny-qwen3.5")

# ------------------------------------------------------------------------------------------ tensor parallel


@pytest.mark.parametrize("model", MODELS)
def test_tp_splits_projections_and_replicates_the_rest_as_dtensors(two_processes, model):
    for rank in two_processes["tp:2"]:
        assert rank[f"{model}/all_dtensor"]
        assert rank[f"{model}/same_keys"]  # checkpoints keep the single-process names
        assert rank[f"{model}/placements"] == {
            "model.layers.1.self_attn.q_proj.weight": ["S(0)"], "model.layers.1.self_attn.o_proj.weight": ["S(1)"],
            "model.layers.1.mlp.down_proj.weight": ["S(1)"], "model.layers.1.self_attn.q_norm.weight": ["R"],
            "model.norm.weight": ["R"], "model.embed_tokens.weight": ["R"], "lm_head": ["R"]}


@pytest.mark.parametrize("model", MODELS)
def test_tp_packed_logprobs_equal_one_process(two_processes, model):
    for rank in two_processes["tp:2"]:
        assert rank[f"{model}/logprob_diff"] <= 1e-5
        assert rank[f"{model}/entropy_diff"] <= 1e-5


@pytest.mark.parametrize("model", MODELS)
def test_tp_optimizer_step_equals_one_process(two_processes, model):
    for rank in two_processes["tp:2"]:
        assert rank[f"{model}/grad_diff"] <= 1e-6  # q_norm / k_norm included: their gradients are summed over tp
        tp_norm, reference_norm = rank[f"{model}/grad_norm"]
        assert abs(tp_norm - reference_norm) <= 1e-5 * reference_norm  # clipping saw the whole model once
        assert rank[f"{model}/step_param_diff"] <= 1e-6
        assert rank[f"{model}/step_changed"] > 5e-4  # the step did move the weights (lr 1e-3)


def test_tp_under_activation_checkpointing_and_through_a_shared_view(two_processes):
    for rank in two_processes["tp:2"]:
        assert rank["tiny-qwen3.5/checkpointed_grad_diff"] <= 1e-6
        assert rank["tiny-qwen3.5/view_shares_parameters"]
        assert rank["tiny-qwen3.5/view_logits_diff"] <= 1e-5


@pytest.mark.parametrize("model", MODELS)
def test_tp_full_state_dict_is_the_single_process_one(two_processes, model):
    assert all(rank[f"{model}/state_dict_equal"] for rank in two_processes["tp:2"])


# ------------------------------------------------------------------------------------------------- replicas


def test_pooled_steps_equal_one_process_on_the_union(replica_ranks):
    for rank in replica_ranks:
        assert rank["n_replicas"] == 2
        assert rank["chosen_oldest"] == [True, True, True]  # the pool gave back the oldest, on every rank
        assert max(rank["loss_diff"]) <= 1e-6
        assert max(rank["step_param_diff"]) <= 1e-6
        assert rank["grads_cleared"] == [True, True, True]
        assert rank["pool_left"] == 1


def test_a_replica_with_no_samples_still_steps(replica_ranks):
    # The last step takes one sample: one replica trains on it, the other on nothing, and both finish the step
    # (a deadlock would have failed the launch) with the reference's weights.
    last_shares = sorted({(r["replica"], r["share_sizes"][-1]) for r in replica_ranks})
    assert last_shares == [(0, 1), (1, 0)]
    assert all(r["step_param_diff"][-1] <= 1e-6 for r in replica_ranks)


def test_replicas_bit_identical_after_three_steps(replica_ranks):
    assert all(rank["replicas_bit_identical"] for rank in replica_ranks)


def test_weight_check_names_the_first_differing_parameter(replica_ranks):
    for rank in replica_ranks:
        message = rank["divergence_message"]
        assert message is not None and "'model.layers.1.mlp.up_proj.weight'" in message
        assert "1 of 24 differ" in message


def test_sharded_adam_is_torch_adamw_bit_for_bit(replica_ranks):
    for rank in replica_ranks:
        assert rank["adam_bit_identical"] == [True, True, True]
        assert rank["adam_bit_identical_after_reload"]  # each rank's shard saved and loaded back
        assert rank["adam_zero_grad_clears_all"]
        assert 0.4 <= rank["adam_owned_share"] <= 0.6  # moments divided, not duplicated


def test_readiness_gate_asks_once_every_k_calls(replica_ranks):
    for rank in replica_ranks:
        assert rank["gate_answers"] == [False, False, False, True]
        assert rank["gate_collectives"] == 1
        assert rank["gate_short"] is False


# ------------------------------------------------------------------------------- the engine under tensor parallel

# The engine tiny models keep the wide initialiser (logits ~40), where reassociated fp32 sums move a logprob by
# ~1e-4; greedy tokens are compared exactly.
LOGPROB_TOL = 3e-4


@pytest.mark.parametrize("model", MODELS)
def test_tp_engine_decodes_local_heads_from_the_shared_shards(engine_ranks, model):
    for rank in engine_ranks:
        got = rank[model]
        assert got["local_heads"] == [2, 1]  # 4 query and 2 KV heads over 2 ranks
        assert got["kv_shape"][4] == 1  # the pool holds this rank's KV head only
        assert got["view_shares_parameters"] and got["updated_in_place"]
        assert got["graphs"] is False
        assert got["steps_agreed"] >= got["stats_steps"] > 0  # every step was compared across the ranks
    assert engine_ranks[0][model]["num_pages"] == engine_ranks[1][model]["num_pages"]
    assert engine_ranks[0][model]["greedy_first"] == engine_ranks[1][model]["greedy_first"]


@pytest.mark.parametrize("model", MODELS)
def test_tp_engine_greedy_equals_one_process_across_turns_and_an_update(engine_ranks, model):
    for rank in engine_ranks:
        first, second = rank[model]["first"], rank[model]["second"]
        for run in (first, second):
            assert run["tokens_equal"] and run["versions_equal"]
            assert run["logprob_diff"] <= LOGPROB_TOL
            assert run["cached_tokens"] == run["reference_cached_tokens"]
        assert rank[model]["versions_seen"] == [0, 1]  # the update landed in the middle of turn 2
        if model == "tiny-qwen3":  # the prefix cache served turn 2's history (hybrid models recompute it)
            assert sum(second["cached_tokens"]) > 0


@pytest.mark.parametrize("model", MODELS)
def test_tp_engine_release_and_restore_keep_live_requests_exact(engine_ranks, model):
    for rank in engine_ranks:
        run = rank[model]["release"]
        assert run["tokens_equal"] and run["logprob_diff"] == 0.0
        assert run["kv_releases"] >= run["steps"] > 1  # after every step, the one completing the last included


@pytest.mark.parametrize("model", MODELS)
def test_tp_engine_sampling_is_the_same_on_every_rank(engine_ranks, model):
    rank0, rank1 = (rank[model]["sampled"] for rank in engine_ranks)
    assert rank0["token_ids"] == rank1["token_ids"]
    assert rank0["logprobs"] == rank1["logprobs"]
    assert rank0["tokens_equal"] and rank0["logprob_diff"] <= LOGPROB_TOL  # and the one-process engine's draws
    assert rank0["token_ids"] != engine_ranks[0][model]["greedy_first"]  # it did sample


def test_tp_engine_follows_tp_rank_0s_requests(engine_ranks):
    # Only tp rank 0 submitted (half of the prompts three steps in); tp rank 1 stepped and got the same completions.
    rank0, rank1 = (rank["follow"] for rank in engine_ranks)
    assert rank0["token_ids"] == rank1["token_ids"] and rank0["steps"] == rank1["steps"]
    assert rank0["tokens_equal"] and rank0["logprob_diff"] <= LOGPROB_TOL  # the one-process engine's tokens


def test_tp_engine_refuses_what_would_deadlock(engine_ranks):
    for rank in engine_ranks:
        assert rank["min_free_bytes"] == 1000  # the smallest free memory of the group sizes every rank's pool
        assert "stepped by its owner" in rank["start"]
        assert rank["different_configs"] == "the engines of the tp group were built with different configs"
        assert rank["different_order"] == "the tp ranks took in different requests or sampled different tokens"
        assert rank["different_versions"] == "the tp ranks step under different policy versions [0, 1]"
