"""`agentrl.run.interrupt`: a signal inside a critical section is held and raised once; one held through the
optimizer update waits for the end of its step (`raise_pending`), so the step it interrupted is counted."""

import os
import signal

import pytest

from agentrl.run import interrupt


def test_a_signal_held_by_a_section_is_raised_at_its_end_and_only_once():
    with interrupt.interrupts_stop_the_run():
        with pytest.raises(interrupt.Interrupted) as raised:
            with interrupt.critical():
                os.kill(os.getpid(), signal.SIGINT)
                assert interrupt._pending == [signal.SIGINT]  # held, not raised, inside the section
        assert raised.value.exit_code == 130
        with interrupt.critical():  # the checkpoint written on the way out: no second Interrupted from it
            pass
        interrupt.raise_pending()


def test_a_signal_held_past_the_update_waits_for_the_end_of_the_step():
    steps_done = 0
    with interrupt.interrupts_stop_the_run():
        with pytest.raises(interrupt.Interrupted):
            for _ in range(3):
                with interrupt.critical(hold_past_end=True):  # the update
                    if steps_done == 1:
                        os.kill(os.getpid(), signal.SIGINT)
                steps_done += 1  # the rest of the step: schedule, metrics, the step count
                interrupt.raise_pending()
        assert steps_done == 2  # the interrupted step finished and counted; the next one never began
        with interrupt.critical():
            pass
    assert interrupt._pending == []


def test_a_signal_whose_exception_python_dropped_is_raised_at_the_end_of_the_step():
    """A handler that runs inside a weakref callback (or a finalizer) raises where Python prints the exception and
    drops it: the run went on through SIGTERM on the GPU host. The end of the step raises it again."""
    import gc
    import weakref

    class Thing:
        pass

    with interrupt.interrupts_stop_the_run():
        thing = Thing()
        ref = weakref.ref(thing, lambda _: os.kill(os.getpid(), signal.SIGTERM))
        del thing
        gc.collect()
        assert ref() is None and interrupt.held() == [signal.SIGTERM]  # dropped by Python, kept here
        with pytest.raises(interrupt.Interrupted) as raised:
            interrupt.raise_pending()
        assert raised.value.exit_code == 143
        interrupt.raise_pending()  # once only
    assert interrupt.held() == []


def test_a_signal_the_run_caught_is_not_raised_again():
    with interrupt.interrupts_stop_the_run():
        with pytest.raises(interrupt.Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10**6):  # the handler runs between bytecodes
                pass
        interrupt.caught()
        interrupt.raise_pending()
