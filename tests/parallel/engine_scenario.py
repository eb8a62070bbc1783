"""The engine on a tensor-parallel model, one rank of `worker.py`'s "engine" scenario (gloo, CPU).

Every rank runs the same calls on two engines: one over the tp-split model, one over the whole model in this
process (the reference), and reports how they compare; the sampled run and the refusals are reported as they are,
for the test to compare across ranks. The tiny models keep `load_model`'s wide initialiser: with the narrow one
greedy decoding repeats the prompt's last token, which would hide a wrong attention.
"""

from __future__ import annotations

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.models import load_model
from agentrl.parallel import apply_tensor_parallel, full_state_dict, load_full_state_dict
from tests.helpers import perturb_, random_prompts

GREEDY = SamplingParams(max_new_tokens=10, temperature=0)
SAMPLED = SamplingParams(max_new_tokens=10, temperature=1.0)  # seeds drawn from (tp rank 0's) engine generator
# A token budget below the prompts' total: prefill chunks share steps with decodes.
CONFIG = EngineConfig(num_pages=64, max_tokens_per_step=48)


def engine_tp(mesh) -> dict:
    out = {}
    for name in ("tiny-qwen3", "tiny-qwen3.5"):
        reference = load_model(name)[0]
        model = apply_tensor_parallel(load_model(name)[0], mesh)
        prompts = random_prompts(6, 3, 50, seed=4)
        out[name] = {**turns_and_update(model, reference, prompts), **released(model, prompts),
                     **sampled(model, reference, prompts)}
    out.update(agreement(mesh))
    return out


def session(engine: Engine, prompts, update) -> tuple[list, list]:
    """Turn 1 of every prompt; then turn 2 (history + completion + a few tool tokens, resubmitted), with
    `update` applied in place, under `pause()` and followed by the version bump, once turn 2 has generated a few
    tokens. Every rank submits (generate and submit on tp ranks other than 0 make mirrors of tp rank 0's requests).
    """
    first = engine.generate(prompts, GREEDY)
    tool = random_prompts(len(prompts), 2, 6, seed=5)
    ids = [engine.submit(p + o.token_ids + t, GREEDY) for p, o, t in zip(prompts, first, tool)]
    update_at = engine.stats.generated_tokens + 2 * len(ids)
    done = {}
    while len(done) < len(ids):
        if update is not None and engine.stats.generated_tokens >= update_at:
            with engine.pause():
                update()
                engine.bump_version()
            update = None
        done.update((c.request_id, c) for c in engine.step())
    return first, [done[i] for i in ids]


def compare(got: list, want: list) -> dict:
    return {"tokens_equal": [g.token_ids for g in got] == [w.token_ids for w in want],
            "versions_equal": [g.versions for g in got] == [w.versions for w in want],
            "logprob_diff": max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs)),
            "cached_tokens": [g.cached_tokens for g in got], "reference_cached_tokens": [w.cached_tokens for w in want]}


def turns_and_update(model, reference, prompts) -> dict:
    before = [p.to_local().data_ptr() for p in model.parameters()]
    ref_first, ref_second = session(Engine(reference, CONFIG), prompts, lambda: perturb_(reference, seed=1))
    engine = Engine(model, CONFIG)
    # The tp model takes the same update in place: each rank copies its slice of the perturbed whole tensors.
    first, second = session(engine, prompts, lambda: load_full_state_dict(model, full_state_dict(reference)))
    return {
        "first": compare(first, ref_first), "second": compare(second, ref_second),
        "versions_seen": sorted({v for c in second for v in c.versions}),
        "local_heads": [engine.geometry.num_heads, engine.geometry.num_kv_heads],
        "kv_shape": list(engine.storage.shape), "num_pages": engine.pool.num_pages,
        "view_shares_parameters": all(a is b for a, b in zip(engine.view.parameters(), model.parameters())),
        "updated_in_place": [p.to_local().data_ptr() for p in model.parameters()] == before,
        "steps_agreed": engine.tp.steps_agreed, "stats_steps": engine.stats.steps,
        "graphs": engine.graphs is not None or engine.mixed_graphs is not None,
        "greedy_first": [c.token_ids for c in first],
    }


def released(model, prompts) -> dict:
    """The KV pool released and restored after every step, with requests live; against the same calls without."""
    runs = []
    for release in (False, True):
        engine = Engine(model, CONFIG)
        ids = [engine.submit(p, GREEDY) for p in prompts]
        done = {}
        while len(done) < len(ids):
            done.update((c.request_id, c) for c in engine.step())
            if release:
                engine.release_kv()
                engine.restore_kv()
        runs.append([done[i] for i in ids])
    stats = engine.stats
    return {"release": {**compare(runs[1], runs[0]), "kv_releases": stats.kv_releases, "steps": stats.steps}}


def sampled(model, reference, prompts) -> dict:
    got = Engine(model, CONFIG).generate(prompts, SAMPLED)
    want = Engine(reference, CONFIG).generate(prompts, SAMPLED)
    return {"sampled": {**compare(got, want), "token_ids": [c.token_ids for c in got],
                        "logprobs": [c.logprobs for c in got]}}


def agreement(mesh) -> dict:
    """How the tp ranks agree, on a tiny Qwen3: the ranks other than tp rank 0 submitting nothing and following its
    requests (half of them submitted a few steps late); a background thread (refused); engines built with
    different configs (refused); mirrors in another order than tp rank 0's requests (refused); and a version bumped
    on one rank only (refused). Each refusal is
    a message, the same on every rank."""
    model = apply_tensor_parallel(load_model("tiny-qwen3")[0], mesh)
    prompts = random_prompts(4, 3, 30, seed=6)
    engine = Engine(model, CONFIG)
    out = {"min_free_bytes": engine.tp.agree_at_construction(CONFIG, 1000 + 10 * mesh.tp_rank)}

    leader = mesh.tp_rank == 0
    if leader:
        for p in prompts[:2]:
            engine.submit(p, GREEDY)
    done = {}
    for step in range(1000):
        if step == 3 and leader:
            for p in prompts[2:]:
                engine.submit(p, GREEDY)
        done.update((c.request_id, c) for c in engine.step())  # a follower gets every completion back too
        if len(done) == len(prompts):
            break
    got = [done[i] for i in sorted(done)]
    want = Engine(load_model("tiny-qwen3")[0], CONFIG).generate(prompts, GREEDY)
    out["follow"] = {**compare(got, want), "token_ids": [c.token_ids for c in got], "steps": engine.tp.steps_agreed}

    try:
        engine.start()
        out["start"] = None
    except RuntimeError as exc:
        out["start"] = str(exc)
    try:
        Engine(model, EngineConfig(num_pages=64, max_num_seqs=8 + mesh.tp_rank))
        out["different_configs"] = None
    except ValueError as exc:
        out["different_configs"] = str(exc).split(" (")[0]
    engine = Engine(model, CONFIG)
    for p in (prompts[:2] if mesh.tp_rank == 0 else prompts[1::-1]):
        engine.submit(p, GREEDY)
    try:
        for _ in range(3):
            engine.step()
        out["different_order"] = None
    except RuntimeError as exc:
        out["different_order"] = str(exc).split(" (")[0]
    engine = Engine(model, CONFIG)
    if mesh.tp_rank:
        engine.bump_version()
    try:
        engine.step()
        out["different_versions"] = None
    except RuntimeError as exc:
        out["different_versions"] = str(exc).split(":")[0]
    return out
