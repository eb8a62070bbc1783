import os
from pathlib import Path

import pytest
import torch

from tests.children import AHEAD, INTERPRETING
from tests.helpers import SHARED_DATA

# One thread: the engine, the rollout driver and the trainer run threads of their own, and on the 2-core CI box
# the tiny models ran 4.5x slower with two torch threads each than with one.
torch.set_num_threads(1)

# IEEE fp32 products in every Triton kernel the tests compile. Triton's default for `tl.dot` on fp32 inputs is tf32,
# and fla's delta-rule kernels use it: the fp32 GPU comparisons of hybrid models measured 1.8e-3 on the H200 that
# way, 3.3e-4 with TRITON_F32_DEFAULT=ieee, and the same again with fla's fused solve (which asks for tf32
# explicitly) in IEEE too. What was left is fp32's own rounding on the ill-conditioned tiny model, which misses fp64
# by 2.7e-4 on the CPU too; the fp32 comparison runs a well-conditioned one now (`test_hybrid_gpu.well_conditioned`).
# Set here, before any test compiles a kernel; bf16 is unaffected. Without CUDA nothing imports fla.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
if torch.cuda.is_available() and os.environ["TRITON_F32_DEFAULT"] == "ieee":
    from agentrl.engine.linear_varlen import ieee_fp32_kernels

    ieee_fp32_kernels()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip("../shared/data is absent (it lives beside the project checkout)")
    return SHARED_DATA


def pytest_configure(config):
    config.addinivalue_line("markers", "child(child): the test waits on this `tests.helpers.Child`, started ahead")


def pytest_collection_finish(session):
    # Children of the selected tests, started now in the tests' order (see "children started ahead" in helpers);
    # not from an interpreter run's child pytest, nor when nothing will run.
    if INTERPRETING or session.config.option.collectonly:
        return
    AHEAD.start([marker.args[0] for item in session.items for marker in item.iter_markers("child")])


def pytest_sessionfinish(session):
    AHEAD.stop()
