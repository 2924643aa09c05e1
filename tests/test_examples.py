import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_add_callback_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = runpy.run_path(str(ROOT / "examples" / "add_callback.py"))
    snip = module["main"](max_steps=12)
    assert snip.plan is not None and snip.switchable_fp4_fraction >= 0.75 - 1e-9  # of the unpinned layers


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


def test_a_library_user_sees_snips_lines_and_not_torchaos_notices(tmp_path):
    """A script that only adds the callback (no logging set up) prints SNIP's setup and plan lines, as
    Lightning prints its own, and none of torchao's notices of absent CUDA extensions or torch's of
    torchao's enum registrations; a script that configures logging gets each line once."""
    script = (
        "import sys, logging, lightning.pytorch as pl\n"
        "from lightning_snip import SNIPCallback, SNIPConfig\n"
        "from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM\n"
        "from lightning_snip.demo.model import LlamaConfig\n"
        "if sys.argv[1] == 'configured':\n"
        "    logging.basicConfig(level=logging.INFO, format='ROOT %(name)s: %(message)s')\n"
        "snip = SNIPCallback(SNIPConfig(warmup_steps=2, interval=4, max_rows=64, first_order_steps=1))\n"
        "pl.Trainer(max_steps=4, callbacks=[snip], accelerator='cpu', limit_val_batches=0, logger=False,\n"
        "           enable_checkpointing=False, enable_progress_bar=False).fit(\n"
        "    DemoLM(LlamaConfig(dim=64, num_layers=2, hidden_dim=160)), datamodule=ByteTextDataModule(seq_len=32, batch_size=4))\n"
    )
    for mode in ("bare", "configured"):
        proc = subprocess.run([sys.executable, "-c", script, mode], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = proc.stderr + proc.stdout
        setup = [line for line in log.splitlines() if "SNIP: 15 converted layers (1 pinned, 14 switchable)" in line]
        applied = [line for line in log.splitlines() if "SNIP plan applied at step 3: FP4 FLOPs fraction" in line]
        assert len(setup) == 1 and len(applied) == 1, log[-3000:]
        assert applied[0].startswith("ROOT lightning_snip.controller: " if mode == "configured" else "SNIP plan"), applied
        for noise in ("Failed to load", "register_constant", "Detected no triton"):
            assert noise not in log, noise
