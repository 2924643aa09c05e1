import json
import math
import os
import subprocess
import sys
from pathlib import Path


def test_two_process_ddp_identical_plans_and_weights(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    worker = Path(__file__).with_name("ddp_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert ranks[0]["formats"] == ranks[1]["formats"] == ranks[0]["plan"]
    assert "mxfp4" in ranks[0]["plan"].values()
    assert ranks[0]["weights"] == ranks[1]["weights"]
    # The demo's stream shards itself: Lightning did not wrap it (its wrapper lists the whole 10^8-window
    # epoch on every rank: 17 GB and ~80 s per start, measured).
    assert [r["sampler"] for r in ranks] == [["WindowStream", 0], ["WindowStream", 1]]
    # Stochastic rounding: each rank its own stream (seed_everything gave both the same global seed).
    assert ranks[0]["sr_seed"] != ranks[1]["sr_seed"]
    # The reduced divergences are the mean of the ranks' own (which differ: each rank saw its own data).
    assert len(ranks[0]["rounds"]) == 1
    local = [r["rounds"][0]["local"]["layers"] for r in ranks]
    reduced = ranks[0]["rounds"][0]["reduced"]["layers"]
    assert reduced == ranks[1]["rounds"][0]["reduced"]["layers"]
    differs = 0
    for fqn, layer in reduced.items():
        for metric in ("loss_divergence", "weight_divergence"):
            for fmt, value in layer[metric].items():
                a, b = local[0][fqn][metric][fmt], local[1][fqn][metric][fmt]
                assert math.isclose(value, (a + b) / 2, rel_tol=1e-9, abs_tol=1e-15), (fqn, metric, fmt)
                differs += a != b
    assert differs > len(reduced)  # the test would notice ranks that kept their own values


def test_two_process_ddp_ranks_revert_a_spiking_plan_at_the_same_step(tmp_path):
    """Only rank 0's FP4 forwards are broken: the plan canary's failures are summed over ranks, so both ranks
    put the layers back at the same step, to the same formats, and their weights stay equal."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), str(Path(__file__).parent),
                                          str(Path(__file__).resolve().parent.parent / "benchmarks")])}
    worker = Path(__file__).with_name("ddp_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path), "spike"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"spike{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["reverts"] == ranks[1]["reverts"] and len(ranks[0]["reverts"]) == 1
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert "mxfp4" not in [fmt for key, fmt in ranks[0]["plan"].items() if key.endswith(":forward")]  # (the broken GEMM)
    assert ranks[0]["guard"] == ranks[1]["guard"] and ranks[0]["avoid"]
    assert ranks[0]["weights"] == ranks[1]["weights"]
