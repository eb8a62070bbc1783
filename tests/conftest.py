from pathlib import Path

import pytest
import torch

from tests.helpers import SHARED_DATA

# One thread: the engine, the rollout driver and the trainer run threads of their own, and on the 2-core CI box
# the tiny models ran 4.5x slower with two torch threads each than with one.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip("../shared/data is absent (it lives beside the project checkout)")
    return SHARED_DATA
