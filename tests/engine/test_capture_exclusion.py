"""A background engine captures no CUDA graph while another thread works beside it (`Engine.beside()`, the
trainer's forward and backward): on a GPU, such work during a capture invalidates the capture and takes the run
down. Here the graphs are stand-ins (tests/helpers.py) and the trainer's work a sleep, held most of the time."""

import threading
import time

import pytest

from agentrl.engine import SamplingParams
from agentrl.models import load_model
from tests.helpers import completions_of, graph_engine, random_prompts


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen3")[0]


def test_no_capture_while_a_thread_works_beside(model):
    beside_at_capture: list[int] = []
    engine = graph_engine(model, mixed=True, on_capture=lambda e: beside_at_capture.append(e._lock._beside))
    stop = threading.Event()

    def trainer():  # beside the engine 95% of the time, with an optimizer step under pause() now and then
        while not stop.is_set():
            with engine.beside():
                time.sleep(0.019)
                with engine.pause():
                    pass
            time.sleep(0.001)

    worker = threading.Thread(target=trainer)
    worker.start()
    engine.start()
    try:
        ids = [engine.submit(p, SamplingParams(max_new_tokens=12, temperature=0))
               for p in random_prompts(12, 3, 40, seed=3)]
        done = completions_of(engine, ids)
    finally:
        stop.set()
        worker.join(10)
        engine.stop()
    assert len(done) == 12 and all(len(c.token_ids) == 12 for c in done.values())
    assert len(beside_at_capture) >= 3  # decode buckets and the prefill steps' token buckets
    assert beside_at_capture == [0] * len(beside_at_capture)
    assert engine.stats.capture_wait_seconds > 0  # the captures did wait for the trainer's work
