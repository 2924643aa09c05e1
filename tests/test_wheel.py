"""The package as `pip install .` makes it (not editable): a wheel that carries the app's Hydra config,
installed by pip into a fresh venv, whose `snip-train` runs from a folder outside the checkout, the checkout off the path."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["model.num_layers=2", "model.dim=64", "model.hidden_dim=160", "data.seq_len=32", "data.batch_size=8",
         "snip.warmup_steps=2", "snip.interval=2", "snip.max_rows=64", "snip.first_order_steps=1",
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
    # A fresh venv with the wheel installed by pip; its dependencies are this venv's, reached by a path
    # line (a .pth file's path line adds the folder but runs none of its .pth files: this venv's
    # editable hook to the checkout stays out).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    deps = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "torch").is_dir())
    (site / "_this_venvs_dependencies.pth").write_text(f"{deps}\n")
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "elsewhere"
    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import lightning_snip.train as t; print(t.__file__); "
                            "print(t.CONF_DIR)"], cwd=run, env=env, capture_output=True, text=True, timeout=600)
    assert where.returncode == 0 and all(line.startswith(str(site)) for line in where.stdout.split()), (where.stdout,
                                                                                                      where.stderr[-2000:])
    app = subprocess.run([str(venv / "bin" / "snip-train"), "trainer.max_steps=5", *SMALL], cwd=run, env=env,
                         capture_output=True, text=True, timeout=600)
    assert app.returncode == 0, app.stderr[-3000:]
    assert "=== SNIP summary ===" in app.stdout
    assert (run / "snip_runs" / "checkpoints" / "last.ckpt").is_file()  # outputs under the current folder
    assert list((run / "outputs").rglob(".hydra/config.yaml"))  # Hydra's run folder too
