import logging
import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

# The benchmarks' shared module (benchmarks/harness.py) is importable as ``harness``, as it is from a
# benchmark script's own folder: tests check its constructions and load benchmarks that import it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

# The quantizer kernels run uncompiled in tests (same code, same numbers; test_kernels.py checks both
# modes bit for bit against the reference): compiling them costs ~5-10 s per kernel in every test
# process and subprocess, which doubled the suite's time. Tests marked ``compiled_quantizers`` run
# with the default, compiled kernels, end to end.
os.environ.setdefault("LIGHTNING_SNIP_QUANTIZERS", "eager")


def pytest_configure(config):
    config.addinivalue_line("markers", "compiled_quantizers: run with the compiled quantizer kernels (the default "
                            "outside tests)")


@pytest.fixture(autouse=True)
def _seed(request, monkeypatch):
    if request.node.get_closest_marker("compiled_quantizers"):
        monkeypatch.setenv("LIGHTNING_SNIP_QUANTIZERS", "compiled")
    # In-process rounds take one error-probe draw per FP4 format (the library's 2; what the tests configured
    # before the setting became a constant): the suite's rounds stay as cheap as they were. Its own MonkeyPatch,
    # so that a test's ``monkeypatch.undo()`` (of its faults) does not change the draws mid-test.
    from lightning_snip import statistics_round

    draws = pytest.MonkeyPatch()
    draws.setattr(statistics_round, "DEFAULT_ROUND", statistics_round.RoundSettings(noise_draws=1))
    torch.manual_seed(0)
    yield
    draws.undo()
