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


def run_together(*targets) -> None:
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "deadlock"


def test_a_capture_waits_for_work_beside_and_keeps_new_work_out():
    """The trainer's forward and backward (beside) and a graph capture (exclusive) never overlap: a capture waits
    for the work under way, and work that starts during a capture waits for it to end."""
    lock, events = StepLock(), []
    beside_started, capture_started = threading.Event(), threading.Event()

    def trainer():
        with lock.beside():
            events.append("work 1 starts")
            beside_started.set()
            capture_started.wait(10)
            time.sleep(0.05)  # the capture is asked for now and must wait
            events.append("work 1 ends")
        capture_started.wait(10)
        with lock.beside():  # asked for during the capture
            events.append("work 2")

    def engine():
        beside_started.wait(10)
        capture_started.set()
        with lock.exclusive():
            events.append("capture starts")
            time.sleep(0.05)  # the trainer's second piece of work is asked for now and must wait
            events.append("capture ends")

    run_together(trainer, engine)
    assert events == ["work 1 starts", "work 1 ends", "capture starts", "capture ends", "work 2"]
    assert lock.capture_wait_seconds >= 0.04


def test_work_beside_leaves_that_state_while_it_waits_for_the_lock():
    """The trainer's optimizer step enters pause() from inside its work beside, while the engine thread holds the
    lock for a step that wants to capture: the capture goes ahead instead of deadlocking, and the pause follows."""
    lock, events = StepLock(), []
    in_step, trainer_waits = threading.Event(), threading.Event()

    def engine():
        with lock:  # a step
            in_step.set()
            trainer_waits.wait(10)
            with lock.exclusive():  # the step captures a graph
                events.append("capture")

    def trainer():
        in_step.wait(10)
        with lock.beside():
            trainer_waits.set()
            with lock.outside():  # pause() for the update
                events.append("update")
            events.append("beside again")

    run_together(engine, trainer)
    assert events == ["capture", "update", "beside again"]
    assert lock._beside == 0 and lock._capturing == 0
