"""`agentrl.compile_watch`: compile time attributed to the thread that compiled, as a run's step metrics report it."""

import threading

import torch

from agentrl import compile_watch


def test_compile_seconds_go_to_the_thread_that_compiled():
    torch._dynamo.reset()  # drops every compile callback: installing again after it restores the watch
    assert compile_watch.install() and compile_watch.install()
    from torch._dynamo.callback import callback_handler

    assert callback_handler.start_callbacks.count(compile_watch._start) == 1  # once, however often asked
    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="eager")
    before = compile_watch.compile_seconds()
    try:
        fn(torch.ones(3))
        main, _ = compile_watch.since(before)
        assert set(main) == {threading.current_thread().name} and main[threading.current_thread().name] > 0
        mark = compile_watch.compile_seconds()
        worker = threading.Thread(target=lambda: fn(torch.ones(4, 5)), name="agentrl-engine")
        worker.start()
        worker.join()
        assert set(compile_watch.since(mark)[0]) == {"agentrl-engine"}  # a new shape: a compile in that thread only
        mark = compile_watch.compile_seconds()
        fn(torch.ones(3))  # cached: no compile, nothing gained
        assert compile_watch.since(mark)[0] == {}
    finally:
        torch._dynamo.reset()
