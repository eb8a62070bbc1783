"""The engine's step lock lets a waiting thread in before the background thread's next step (step_lock.py)."""

import threading
import time

from agentrl.engine.step_lock import StepLock


def first_after_a_step(lock) -> list[str]:
    """The engine thread holds the lock for a step while another thread waits in `outside()`; the step ends and the
    engine thread at once goes for its next one, as its loop does. Returns who held the lock first after the step."""
    order: list[str] = []

    def wait_outside():
        with lock.outside():
            order.append("outside")

    lock.__enter__()  # the engine thread's step in progress
    waiter = threading.Thread(target=wait_outside)
    waiter.start()
    deadline = time.monotonic() + 10
    while not lock._waiting and waiter.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)  # until the waiter has said it waits
    time.sleep(0.01)  # and is blocked on the lock itself
    lock.__exit__(None, None, None)  # the step ends
    lock.yield_to_outside()
    with lock:  # the next step
        order.append("engine")
    waiter.join()
    return order


def test_a_waiting_thread_goes_before_the_engine_threads_next_step():
    lock = StepLock()
    for _ in range(20):
        assert first_after_a_step(lock) == ["outside", "engine"]
    assert lock._waiting == 0 and lock.wait_seconds > 0.15  # each waited through the 10 ms left of a step


def test_nested_and_engine_thread_entries_do_not_deadlock():
    lock = StepLock()
    with lock.outside():
        with lock.outside():  # a guard inside pause(): the same thread again
            with lock:  # the foreground drive mode steps inside a pause
                pass
    lock.yield_to_outside()  # nobody waiting: returns at once
    assert lock._waiting == 0
