import os
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SHARED_DATA = SHARED / "data"

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip("../shared/data is absent (it lives beside the project checkout)")
    return SHARED_DATA
