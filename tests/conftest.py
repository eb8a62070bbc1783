import os
from pathlib import Path

import pytest
import torch

from tests.helpers import SHARED_DATA

# One thread: the engine, the rollout driver and the trainer run threads of their own, and on the 2-core CI box
# the tiny models ran 4.5x slower with two torch threads each than with one.
torch.set_num_threads(1)

# IEEE fp32 products in every Triton kernel the tests compile. Triton's default for `tl.dot` on fp32 inputs is tf32,
# and fla's delta-rule kernels use it: the fp32 GPU comparisons of hybrid models measured 1.8e-3 on the H200 that
# way, where they compare fp32 arithmetic. Set here, before any test module imports a kernel; bf16 is unaffected.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip("../shared/data is absent (it lives beside the project checkout)")
    return SHARED_DATA
