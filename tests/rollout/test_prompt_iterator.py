"""The prompt iterator reads each prompt exactly once per epoch: under concurrent draws, across epochs, and across
checkpoints taken while prompts are out (drawn, their work not yet kept). The driver-level versions of these
checks live in test_rollout_driver.py."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter

import pytest

from agentrl.rollout import Prompt, PromptIterator

N = 50



def dataset(n: int = N) -> list[dict]:
    return [{"question": f"question {i}", "answer": str(i)} for i in range(n)]


def digest(sample: dict) -> str:
    return hashlib.sha256(json.dumps(sample, sort_keys=True).encode()).hexdigest()


def assert_once_per_epoch(pairs, samples, epochs):
    """`pairs` of (epoch, sample): every sample exactly once in each of `epochs` epochs."""
    everything = {digest(s) for s in samples}
    counts = Counter((e, digest(s)) for e, s in pairs)
    assert set(counts.values()) == {1}, [k for k, c in counts.items() if c > 1][:5]
    for epoch in range(epochs):
        assert {d for e, d in counts if e == epoch} == everything, epoch
    assert {e for e, _ in counts} == set(range(epochs))


def test_concurrent_draws_over_three_epochs_hand_out_each_prompt_once_per_epoch():
    samples = dataset()
    it = PromptIterator(samples, shuffle=True, seed=4, max_epochs=3)
    drawn: list[Prompt] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def reader():
        barrier.wait()
        for prompt in it:
            with lock:
                drawn.append(prompt)
            it.consumed(prompt)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(drawn) == 3 * N
    assert all(p.sample is samples[p.index] for p in drawn)
    assert_once_per_epoch([(p.epoch, p.sample) for p in drawn], samples, 3)
    assert it.exhausted() and it.state_dict()["outstanding"] == []
    with pytest.raises(StopIteration):
        next(it)


def test_epoch_orders_are_shuffled_afresh_and_reproducible():
    def orders(seed):
        it = PromptIterator(dataset(), shuffle=True, seed=seed, max_epochs=3)
        got = [(p.epoch, p.index) for p in it]
        return [[i for e, i in got if e == epoch] for epoch in range(3)]

    a, b, c = orders(1), orders(1), orders(2)
    assert a == b and a != c
    assert len({tuple(o) for o in a}) == 3
    assert [p.index for p in PromptIterator(dataset(), shuffle=False, max_epochs=1)] == list(range(N))


def test_unbounded_epochs_never_exhaust():
    it = PromptIterator(dataset(3), shuffle=False)
    got = [next(it) for _ in range(10)]
    assert [p.epoch for p in got] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert not it.exhausted()


def run_with_checkpoint(checkpoint_at: int, consume_lag: int, epochs: int = 3, n: int = N, seed: int = 9):
    """Draw with `consume_lag` prompts in flight (consumed in a scrambled order), checkpoint after
    `checkpoint_at` draws, and finish from a new iterator loaded from the checkpoint. Returns the consumed
    (epoch, sample) pairs a crash at the checkpoint would leave behind, plus the checkpoint."""
    samples = dataset(n)
    first = PromptIterator(samples, shuffle=True, seed=seed, max_epochs=epochs)
    in_flight: list[Prompt] = []
    kept = []
    for step in range(checkpoint_at):
        in_flight.append(next(first))
        if len(in_flight) > consume_lag:  # finish one of the older ones, not always the oldest
            done = in_flight.pop((step * 7) % (len(in_flight) - 1))
            first.consumed(done)
            kept.append((done.epoch, done.sample))
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint holds plain data
    assert sorted(map(tuple, state["outstanding"])) == sorted((p.epoch, p.index) for p in in_flight)
    # After the checkpoint the old process keeps going, but its work is lost with it: nothing more is kept.
    for p in in_flight:
        first.consumed(p)
    next(first, None)

    second = PromptIterator(samples, shuffle=True, seed=seed, max_epochs=epochs)
    second.load_state_dict(state)
    replayed = [next(second) for _ in range(len(in_flight))]
    assert [(p.epoch, p.index) for p in replayed] == [tuple(k) for k in state["outstanding"]]
    for p in replayed:
        assert p.sample is samples[p.index]
        second.consumed(p)
        kept.append((p.epoch, p.sample))
    for p in second:
        second.consumed(p)
        kept.append((p.epoch, p.sample))
    return samples, kept, state


@pytest.mark.parametrize("checkpoint_at, consume_lag", [(23, 6), (N + 3, 8), (N, 5), (1, 1), (3 * N, 4)])
def test_checkpoint_mid_epoch_with_prompts_outstanding_skips_and_repeats_nothing(checkpoint_at, consume_lag):
    samples, kept, state = run_with_checkpoint(checkpoint_at, consume_lag)
    assert len(state["outstanding"]) == min(consume_lag, checkpoint_at)
    assert_once_per_epoch(kept, samples, 3)


def test_outstanding_prompts_of_an_earlier_epoch_keep_their_epoch_after_restore():
    # Checkpoint just after the epoch rolled over, with prompts of epoch 0 still out.
    samples, kept, state = run_with_checkpoint(N + 2, 6)
    assert state["epoch"] == 1 and state["position"] == 2
    epochs_out = Counter(e for e, _ in state["outstanding"])
    assert epochs_out[0] > 0 and epochs_out[1] > 0
    assert_once_per_epoch(kept, samples, 3)


def test_a_restored_iterator_checkpointed_again_before_its_replay_drains_loses_nothing():
    samples = dataset()
    first = PromptIterator(samples, shuffle=True, seed=2, max_epochs=2)
    out = [next(first) for _ in range(10)]
    for p in out[:4]:
        first.consumed(p)
    state = first.state_dict()
    assert len(state["outstanding"]) == 6

    second = PromptIterator(samples, shuffle=True, seed=2, max_epochs=2)
    second.load_state_dict(state)
    again = [next(second) for _ in range(2)]  # two replayed, four still waiting to be
    second.consumed(again[0])
    state2 = second.state_dict()
    assert sorted(map(tuple, state2["outstanding"])) == sorted((p.epoch, p.index) for p in out[5:])

    third = PromptIterator(samples, shuffle=True, seed=2, max_epochs=2)
    third.load_state_dict(state2)
    kept = [(p.epoch, p.sample) for p in out[:4]] + [(again[0].epoch, again[0].sample)]
    for p in third:
        third.consumed(p)
        kept.append((p.epoch, p.sample))
    assert_once_per_epoch(kept, samples, 2)


def test_a_checkpoint_restores_its_own_order_whatever_the_new_iterator_was_built_with():
    samples = dataset()
    first = PromptIterator(samples, shuffle=True, seed=3, max_epochs=1)
    head = [next(first) for _ in range(20)]
    for p in head:
        first.consumed(p)
    second = PromptIterator(samples, shuffle=False, seed=0, max_epochs=1)
    second.load_state_dict(first.state_dict())
    rest = list(second)
    assert [p.index for p in head + rest] == [p.index for p in PromptIterator(samples, seed=3, max_epochs=1)]


def test_a_checkpoint_of_another_dataset_is_refused():
    state = PromptIterator(dataset(10)).state_dict()
    with pytest.raises(ValueError, match="10 prompts"):
        PromptIterator(dataset(11)).load_state_dict(state)
    with pytest.raises(ValueError, match="empty"):
        PromptIterator([])
