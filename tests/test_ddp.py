import json
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
