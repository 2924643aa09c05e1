import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_fidelity_quick_prints_out_of_sample_lines_per_model_and_format():
    proc = subprocess.run([sys.executable, "benchmarks/divergence_fidelity.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    number = r"(-?[0-9.]+|nan)"
    spearman = re.findall(rf"^spearman_out (\w+) (mxfp4|nvfp4) {number} (demo|deep)$", proc.stdout, re.M)
    names = {(n, f, m) for n, f, _, m in spearman}
    for model in ("demo", "deep"):
        for fmt in ("mxfp4", "nvfp4"):
            for name in ("loss_divergence", "weight_divergence", "rel_error_vs_loss", "rel_error_vs_weights",
                         "abs_error_vs_loss", "abs_error_vs_weights"):
                assert (name, fmt, model) in names
            ceilings = re.findall(rf"^ceiling (loss|weights) {fmt} {number} {model}$", proc.stdout, re.M)
            assert {c for c, _ in ceilings} == {"loss", "weights"}
            assert re.search(rf"^round_agreement loss_divergence {fmt} {number} {model}$", proc.stdout, re.M)
    assert not proc.stdout.strip().splitlines()[-1].startswith("#")
