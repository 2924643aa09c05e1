"""The package as `pip install .` makes it (not editable): a wheel that carries the app's Hydra config, and
its `snip-train` run from a folder outside the checkout, with the checkout off the path."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["model.num_layers=2", "model.dim=64", "model.hidden_dim=160", "data.seq_len=32", "data.batch_size=8",
         "snip.warmup_steps=2", "snip.interval=2", "snip.max_rows=64", "snip.noise_draws=1", "snip.first_order_steps=1",
         "trainer.val_check_interval=5"]


def _build_wheel(out: Path) -> Path:
    import setuptools

    # Where the venv's setuptools is new enough, without pip's isolated build environment (no download).
    flags = ["--no-build-isolation"] if int(setuptools.__version__.split(".")[0]) >= 68 else []
    # Built from a copy of the sources: setuptools reuses a checkout's build/ folder, whose stale files
    # would hide a package-data glob that matches nothing.
    source = out.parent / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                                 "results", "snip_runs", "outputs", "lightning_logs"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *flags, "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("lightning_snip-*.whl")
    return wheel


def test_the_wheel_carries_the_config_and_its_app_trains_outside_the_checkout(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"lightning_snip/conf/config.yaml", "lightning_snip/conf/model/tiny.yaml",
            "lightning_snip/conf/model/smollm2.yaml"} <= names, sorted(n for n in names if "conf" in n)
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "elsewhere"
    run.mkdir()
    # The installed copy first on the path (the dependencies still come from this venv).
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import lightning_snip.train as t; print(t.__file__); print(t.CONF_DIR)"],
                           cwd=run, env=env, capture_output=True, text=True, timeout=600)
    assert where.returncode == 0 and all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    app = subprocess.run([str(site / "bin" / "snip-train"), "trainer.max_steps=5", *SMALL], cwd=run, env=env,
                         capture_output=True, text=True, timeout=600)
    assert app.returncode == 0, app.stderr[-3000:]
    assert "=== SNIP summary ===" in app.stdout
    assert (run / "snip_runs" / "checkpoints" / "last.ckpt").is_file()  # outputs under the current folder
    assert list((run / "outputs").rglob(".hydra/config.yaml"))  # Hydra's run folder too
