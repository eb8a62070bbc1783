"""The engine's step lock lets a waiting thread in before the background thread's next step (step_lock.py)."""

import threading
import time

from agentrl.engine.step_lock import StepLock


def steps_missed(lock, entries: int = 20) -> list[int]:
    """A stand-in engine thread takes the lock for one 'step' after another (holding it while it waits, as a step
    waits for its sampled tokens; re-taking it at once). Another thread enters `outside()` `entries` times: for each,
    how many steps began between its request and its entry."""
    steps, stop = [0], threading.Event()

    def engine():
        while not stop.is_set():
            lock.yield_to_outside()
            with lock:
                steps[0] += 1
                time.sleep(0.01)  # the wait for the step's tokens: the GIL is free, the lock is held

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    missed = []
    try:
        for _ in range(entries):
            time.sleep(0.013)
            before = steps[0]
            with lock.outside():
                missed.append(steps[0] - before)
    finally:
        stop.set()
        thread.join()
    return missed


def test_a_waiting_thread_enters_before_the_engine_threads_next_step_but_one():
    lock = StepLock()
    missed = steps_missed(lock)
    # The step in progress when it asked ends; at most one more begins (the engine had passed its yield already).
    assert max(missed) <= 1, missed
    assert lock.wait_seconds > 0


def test_nested_and_engine_thread_entries_do_not_deadlock():
    lock = StepLock()
    with lock.outside():
        with lock.outside():  # a guard inside pause(): the same thread again
            with lock:  # the foreground drive mode steps inside a pause
                pass
    lock.yield_to_outside()  # nobody waiting: returns at once
    assert lock._waiting == 0
