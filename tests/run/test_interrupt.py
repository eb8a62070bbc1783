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
