import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_fidelity_quick_prints_one_line_per_estimator_and_format():
    proc = subprocess.run([sys.executable, "benchmarks/divergence_fidelity.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"^spearman (\w+) (mxfp4|nvfp4) (-?[0-9.]+|nan)$", proc.stdout, re.M)
    names = {(n, f) for n, f, _ in lines}
    expected = {(n, f) for n in ("loss_divergence", "weight_divergence", "rel_error_vs_loss", "rel_error_vs_weights")
                for f in ("mxfp4", "nvfp4")}
    assert names == expected
    assert proc.stdout.strip().splitlines()[-1].startswith("spearman ")
