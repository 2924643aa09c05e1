import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_add_callback_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = runpy.run_path(str(ROOT / "examples" / "add_callback.py"))
    snip = module["main"](max_steps=12)
    assert snip.plan is not None and snip.plan.fp4_fraction >= 0.75


def test_readme_main_job_command_runs(tmp_path):
    # The README's main job, shortened by the same overrides a user would pass.
    cmd = [sys.executable, "-m", "lightning_snip.train", "trainer.max_steps=12", "snip.warmup_steps=3", "snip.interval=5",
           "snip.fp4_fraction=0.8", "model.num_layers=2", "model.dim=64", "model.hidden_dim=160", "data.seq_len=32",
           "data.batch_size=8", "trainer.val_check_interval=12", f"trainer.output_dir={tmp_path}/runs",
           f"hydra.run.dir={tmp_path}/hydra"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "=== SNIP summary ===" in proc.stdout and "FP4 FLOPs fraction 0.8" in proc.stdout
    assert "TensorBoard logs:" in proc.stdout
    assert list((tmp_path / "runs").rglob("events.out.tfevents.*"))
    readme = (ROOT / "README.md").read_text()
    assert "python -m lightning_snip.train" in readme and "make demo" in readme
