"""One multi-process scenario, launched by the tests with `python -m torch.distributed.run` (gloo, CPU).

Every rank builds the single-process reference itself (same seed, same samples), runs the parallel path beside
it, and writes what it measured to `<out>/rank<R>.json`; the tests assert on those numbers. A failure inside a
rank raises, so the launcher exits non-zero and the test shows the traceback.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/parallel/worker.py OUT SCENARIO:TP ...

SCENARIO is `tp`, `replicas` or `engine` (the engine on a tp-split model, in `engine_scenario.py`).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `tests.*` imports

from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

from agentrl.parallel import (ParallelConfig, ReadinessGate, ReplicaDivergence, SharedPool, ShardedAdamW,  # noqa: E402
                              apply_tensor_parallel, check_replica_weights, close_mesh, full_state_dict, init_mesh,
                              my_share, pooled_loss_denominator, reduce_gradients, sum_over_replicas)
from agentrl.parallel.process_exit import exit_process  # noqa: E402
from agentrl.parallel.sharded_adam import shard_filename  # noqa: E402
from agentrl.sample import TrainingSample  # noqa: E402
from agentrl.train.config import LossConfig, OptimConfig  # noqa: E402
from agentrl.train.logprobs import packed_token_logprobs  # noqa: E402
from agentrl.train.loss import policy_loss  # noqa: E402
from agentrl.train.optim import Stepper, build_optimizer, build_scheduler  # noqa: E402
from agentrl.train.pack import pack_samples  # noqa: E402

ROW_TOKENS = 40
LOSS = LossConfig(type="grpo", tis_cap=None)
# Adam's first step moves each weight by lr * g / (|g| + eps): with the usual eps = 1e-8, a gradient element near
# 1e-8 whose last bits differ (a split matmul sums in another order) moves its update by a sizeable fraction of lr.
# eps = 1e-4 bounds that amplification at lr / eps, so the tolerance measures the parallel arithmetic.
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, eps=1e-4, warmup_steps=0, max_grad_norm=1.0)


def tiny_model(name: str):
    """The tiny test models with the usual 0.02 initialiser instead of `load_model`'s 1.0: at 1.0 the logits reach
    ~40, where reassociating fp32 sums (what splitting a matmul does) alone moves a logprob by ~1e-5."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM

    from agentrl.models import tiny_config

    config = tiny_config(name)
    config.initializer_range = 0.02
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3_5ForCausalLM(config) if name == "tiny-qwen3.5" else AutoModelForCausalLM.from_config(config)
    return model.float().train()


def make_samples(n: int, seed: int) -> list[TrainingSample]:
    """Rollout-shaped samples: a prompt, a generated turn, a tool result, another generated turn."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt, turn, tool, turn2 = (int(x) for x in torch.randint(2, 9, (4,), generator=g))
        n_tok = prompt + turn + tool + turn2
        trainable = [0] * prompt + [1] * turn + [0] * tool + [1] * turn2
        ids = torch.randint(0, 256, (n_tok,), generator=g).tolist()
        behaviour = [(-5.77 + 0.3 * float(torch.randn((), generator=g))) if t else 0.0 for t in trainable]
        versions = [0 if t else -1 for t in trainable]
        advantage = float(torch.randn((), generator=g))
        out.append(TrainingSample(ids, trainable, behaviour, versions, advantage=advantage, group_id=i))
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_param_diff(model, reference) -> float:
    return max(float((full(p.detach()) - q.detach()).abs().max())
               for p, q in zip(model.parameters(), reference.parameters()))


def train_step(model, samples, denominator=None, version: int = 0):
    """Forward/backward over `samples` (nothing if empty) and return the local loss."""
    if not samples:
        return 0.0
    batch = pack_samples(samples, ROW_TOKENS)
    logprobs, entropy = packed_token_logprobs(model, batch)
    loss, _ = policy_loss(logprobs, batch.trainable_tokens(), LOSS, current_version=version, entropy=entropy,
                          denominator=denominator)
    loss.backward()
    return float(loss.detach())


def new_stepper(model, mesh=None):
    optimizer = build_optimizer(model, OPTIM)
    if mesh is not None:
        optimizer = ShardedAdamW.from_adamw(optimizer, mesh)
    return Stepper(model, optimizer, build_scheduler(optimizer, OPTIM, 10), OPTIM)


# --------------------------------------------------------------------------------------------- scenarios


def tensor_parallel(mesh) -> dict:
    out = {}
    samples = make_samples(6, seed=1)
    for name in ("tiny-qwen3", "tiny-qwen3.5"):
        reference, model = tiny_model(name), apply_tensor_parallel(tiny_model(name), mesh)
        params = dict(model.named_parameters())
        out[f"{name}/all_dtensor"] = all(isinstance(p, DTensor) for p in params.values())
        out[f"{name}/same_keys"] = list(model.state_dict()) == list(reference.state_dict())
        placements = {k: [str(x) for x in params[k].placements] for k in (
            "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
            "model.layers.1.mlp.down_proj.weight", "model.layers.1.self_attn.q_norm.weight", "model.norm.weight",
            "model.embed_tokens.weight")}
        placements["lm_head"] = [str(x) for x in model.get_output_embeddings().weight.placements]
        out[f"{name}/placements"] = placements
        saved = full_state_dict(model)
        out[f"{name}/state_dict_equal"] = all(torch.equal(saved[k], v) for k, v in reference.state_dict().items())
        batch = pack_samples(samples, ROW_TOKENS)
        with torch.no_grad():
            lp, ent = packed_token_logprobs(model, batch)
            lp_ref, ent_ref = packed_token_logprobs(reference, batch)
        out[f"{name}/logprob_diff"] = float((lp - lp_ref).abs().max())
        out[f"{name}/entropy_diff"] = float((ent - ent_ref).abs().max())

        stepper, ref_stepper = new_stepper(model), new_stepper(reference)
        train_step(model, samples)
        train_step(reference, samples)
        grad_diff = max(float((full(p.grad) - q.grad).abs().max())
                        for p, q in zip(model.parameters(), reference.parameters()))
        if name == "tiny-qwen3.5":
            out.update(replays_and_views(name, mesh, samples, reference))
        result, ref_result = stepper.step(torch.tensor(0.0)), ref_stepper.step(torch.tensor(0.0))
        out[f"{name}/grad_diff"] = grad_diff
        out[f"{name}/grad_norm"] = [result.grad_norm, ref_result.grad_norm]
        out[f"{name}/step_param_diff"] = max_param_diff(model, reference)
        out[f"{name}/step_changed"] = max(float((p.detach() - q.detach()).abs().max()) for p, q in
                                          zip(tiny_model(name).parameters(), reference.parameters()))
    return out


def replays_and_views(name, mesh, samples, reference) -> dict:
    """Two other ways the local-view hooks get exercised, against `reference`'s gradients of the same loss:
    activation checkpointing (the backward replays each decoder layer's forward, the gated delta net reading its
    convolution's weight again), and a deep copy sharing every parameter (the engine's view of the model)."""
    checkpointed = apply_tensor_parallel(tiny_model(name), mesh)
    checkpointed.gradient_checkpointing_enable()  # the name both transformers 5.17 and 5.24 have
    train_step(checkpointed, samples)
    grad_diff = max(float((full(p.grad) - q.grad).abs().max())
                    for p, q in zip(checkpointed.parameters(), reference.parameters()))
    shared = {id(t): t for t in itertools.chain(checkpointed.parameters(), checkpointed.buffers())}
    view = copy.deepcopy(checkpointed, memo=dict(shared)).eval()
    ids = torch.tensor([samples[0].input_ids])
    with torch.no_grad():
        view_diff = float((view(ids).logits - reference.eval()(ids).logits).abs().max())
    reference.train()
    return {f"{name}/checkpointed_grad_diff": grad_diff, f"{name}/view_logits_diff": view_diff,
            f"{name}/view_shares_parameters": all(a is b for a, b in zip(view.parameters(),
                                                                         checkpointed.parameters()))}


def replicas(mesh) -> dict:
    out = {}
    model = apply_tensor_parallel(tiny_model("tiny-qwen3"), mesh)
    reference = tiny_model("tiny-qwen3")
    stepper, ref_stepper = new_stepper(model, mesh), new_stepper(reference)
    pool = SharedPool(mesh)
    # Three steps. Each replica finishes its own samples (sample i on replica i % n), with ages that do not follow
    # the generation order; a step takes the oldest `take` of the pool; the last step takes a single sample, so
    # one replica has nothing to train on.
    plan = [(make_samples(7, seed=10), 5), (make_samples(4, seed=11), 4), ([], 1)]
    ages_of = {}
    reference_pool: list = []
    diffs, chosen_ok, shares = [], [], []
    for step, (finished, take) in enumerate(plan):
        ages = [((i * 3 + step) % 7) + 10.0 * step for i in range(len(finished))]
        mine = [(s, a) for i, (s, a) in enumerate(zip(finished, ages)) if i % mesh.n_replicas == mesh.replica]
        if mesh.tp_rank:  # what a tp peer reports differs (its tools returned at other times): tp rank 0's counts
            mine = [(s, a + 100.0) for s, a in mine[::-1]][:1]
        pool.exchange([s for s, _ in mine], [a for _, a in mine])
        for i, (s, a) in enumerate(zip(finished, ages)):
            ages_of[id(s)] = a
            reference_pool.append((a, i % mesh.n_replicas, s))
        reference_pool.sort(key=lambda e: (e[0], e[1]))
        expected = [s for _, _, s in reference_pool[:take]]
        reference_pool = reference_pool[take:]
        taken = pool.take_oldest(take)
        chosen_ok.append([s.input_ids for s in taken] == [s.input_ids for s in expected])

        share = my_share(taken, mesh)
        shares.append(len(share))
        denominator = pooled_loss_denominator(taken, LOSS, current_version=0)
        local_loss = train_step(model, share, denominator=denominator)
        reduce_gradients(model.parameters(), mesh)
        total_loss = sum_over_replicas([local_loss], mesh)[0]
        stepper.step(torch.tensor(total_loss))
        ref_loss = train_step(reference, expected)
        ref_stepper.step(torch.tensor(ref_loss))
        out.setdefault("loss_diff", []).append(abs(total_loss - ref_loss))
        diffs.append(max_param_diff(model, reference))
        out.setdefault("grads_cleared", []).append(all(p.grad is None for p in model.parameters()))
    out["step_param_diff"] = diffs
    out["chosen_oldest"] = chosen_ok
    out["share_sizes"] = shares
    out["pool_left"] = len(pool)

    # Bit-identical across replicas: every local parameter gathered from every replica and compared.
    flat = torch.cat([(p.to_local() if isinstance(p, DTensor) else p).detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(mesh.n_replicas)]
    torch.distributed.all_gather(gathered, flat, group=mesh.replica_group)
    out["replicas_bit_identical"] = all(torch.equal(g, gathered[0]) for g in gathered)
    check_replica_weights(model, mesh)  # must pass
    # ... and a one-element change on the last replica must be caught and named.
    target = "model.layers.1.mlp.up_proj.weight"
    param = dict(model.named_parameters())[target]
    if mesh.replica == mesh.n_replicas - 1:
        with torch.no_grad():
            (param.to_local() if isinstance(param, DTensor) else param).view(-1)[3] += 1e-3
    try:
        check_replica_weights(model, mesh)
        out["divergence_message"] = None
    except ReplicaDivergence as exc:
        out["divergence_message"] = str(exc)

    out.update(sharded_adam_bitwise(mesh))
    out.update(readiness_gate(mesh))
    return out


def sharded_adam_bitwise(mesh) -> dict:
    """Sharded AdamW against torch AdamW on identical gradients: 3 steps (warmup schedule), a checkpoint round
    trip, and one more step from the reloaded shard."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2, max_grad_norm=None)
    model = apply_tensor_parallel(tiny_model("tiny-qwen3"), mesh)
    reference = tiny_model("tiny-qwen3")
    sharded = ShardedAdamW.from_adamw(build_optimizer(model, cfg), mesh)
    plain = build_optimizer(reference, cfg)
    schedulers = [build_scheduler(sharded, cfg, 10), build_scheduler(plain, cfg, 10)]

    def set_grads(seed):
        g = torch.Generator().manual_seed(seed)
        for p, q in zip(model.parameters(), reference.parameters()):
            grad = torch.randn(q.shape, generator=g)
            q.grad = grad.clone()
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None) \
                if isinstance(p, DTensor) else grad.clone()

    def step(optimizers):
        for o in optimizers:
            o.step()
        for s in schedulers:
            s.step()

    equal = []
    for seed in range(3):
        set_grads(seed)
        step([sharded, plain])
        equal.append(all(torch.equal(full(p.detach()), q.detach())
                         for p, q in zip(model.parameters(), reference.parameters())))
    sharded.zero_grad(set_to_none=True)
    cleared = all(p.grad is None for p in model.parameters())
    owned = sum(p.numel() for g in sharded.inner.param_groups for p in g["params"])

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / shard_filename(mesh)
        torch.save(sharded.state_dict(), path)
        reloaded = ShardedAdamW.from_adamw(build_optimizer(model, cfg), mesh)
        reloaded.load_state_dict(torch.load(path, weights_only=True))
    set_grads(3)
    reloaded.step()
    plain.step()
    equal_after_reload = all(torch.equal(full(p.detach()), q.detach())
                             for p, q in zip(model.parameters(), reference.parameters()))
    owned_all = sum_over_replicas([owned], mesh)[0]
    return {"adam_bit_identical": equal, "adam_zero_grad_clears_all": cleared,
            "adam_owned_share": owned / owned_all, "adam_bit_identical_after_reload": equal_after_reload}


def readiness_gate(mesh) -> dict:
    """Replica 0 holds 3 ready items, the others none; 3 are needed. With k = 4 the first three calls answer False
    without a collective and the fourth, on every rank, says True. A tp peer's own count is not counted."""
    gate = ReadinessGate(mesh, every=4)
    answers = [gate.poll(3 if mesh.replica == 0 else 0, needed=3) for _ in range(4)]
    short = ReadinessGate(mesh, every=1).poll(100 if mesh.tp_rank else 1, needed=mesh.n_replicas + 1)
    return {"gate_answers": answers, "gate_collectives": gate.collectives, "gate_short": short}


def engine(mesh) -> dict:
    from tests.parallel.engine_scenario import engine_tp  # its imports (tests.helpers) only where it runs

    return engine_tp(mesh)


def main():
    """`worker.py OUT SCENARIO:TP [SCENARIO:TP ...]`: the scenarios run one after the other on one process group,
    each on a mesh of its own (a launch costs more than a scenario on these tiny models)."""
    out_dir, specs = Path(sys.argv[1]), sys.argv[2:]
    mesh = None
    for spec in specs:
        scenario, tp_size = spec.split(":")
        mesh = init_mesh(ParallelConfig(tp_size=int(tp_size)))
        result = {"rank": mesh.rank, "replica": mesh.replica, "tp_rank": mesh.tp_rank, "n_replicas": mesh.n_replicas}
        result.update({"tp": tensor_parallel, "replicas": replicas, "engine": engine}[scenario](mesh))
        where = out_dir / spec.replace(":", "-tp")
        where.mkdir(parents=True, exist_ok=True)
        (where / f"rank{mesh.rank}.json").write_text(json.dumps(result))
    close_mesh(mesh)


if __name__ == "__main__":
    main()
    exit_process(0)
