"""The Hydra app as a user runs it: a subprocess per run (few steps, a small model)."""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["model.num_layers=2", "model.dim=64", "model.hidden_dim=160", "data.seq_len=32", "data.batch_size=8",
         "snip.warmup_steps=2", "snip.interval=4", "snip.fp4_fraction=0.6", "snip.max_rows=128",
         "snip.first_order_steps=2"]


def _cmd(tmp_path, *overrides):
    return [sys.executable, "-m", "lightning_snip.train", *SMALL, f"trainer.output_dir={tmp_path}/runs",
            f"hydra.run.dir={tmp_path}/hydra", *overrides]


def _run(tmp_path, *overrides, timeout=600):
    return subprocess.run(_cmd(tmp_path, *overrides), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# Runs of the app that fail their configuration, many to a test: forked from one process that imported the
# app once (each fresh `python -m lightning_snip.train` spent ~7.5 of its 8 s importing torch and Lightning).
# A child is a fresh run of the same entry point (cli(), the argv, its own stdout and stderr).
_FORK_SERVER = r"""
import json, os, sys, traceback
import lightning.pytorch
import lightning_snip.train as app
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # (not the requests' pipe)
        sys.argv = ["snip-train", *request["argv"]]
        code = 0
        try:
            app.cli()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if not isinstance(exit_.code, int) and exit_.code is not None:
                print(exit_.code, file=sys.stderr)  # as the interpreter prints it
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    print(json.dumps(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])), flush=True)
"""


@pytest.fixture(scope="module")
def forked_app():
    """forked_app(tmp_path, *overrides): the app's run as _run gives it (returncode, stdout, stderr), forked
    from a process that imported it once."""
    import json

    # (its own process group: killed whole, with a hanging child, on a timeout)
    server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)

    def kill():
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()

    def run(tmp_path, *overrides, timeout=300):
        import select

        tmp_path.mkdir(parents=True, exist_ok=True)
        out, err = tmp_path / "app.stdout", tmp_path / "app.stderr"
        server.stdin.write(json.dumps({"argv": _cmd(tmp_path, *overrides)[3:], "stdout": str(out),
                                       "stderr": str(err)}) + "\n")
        server.stdin.flush()
        if not select.select([server.stdout], [], [], timeout)[0]:  # a child that hangs: fail, do not wait on
            kill()
            pytest.fail(f"the app's run did not end within {timeout} s: {overrides}; its stderr: "
                        f"{err.read_text()[-3000:] if err.exists() else ''}")
        reply = server.stdout.readline()
        assert reply, "the fork server exited"
        return subprocess.CompletedProcess(_cmd(tmp_path, *overrides), json.loads(reply), out.read_text(),
                                           err.read_text())

    yield run
    server.stdin.close()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill()


def _plan_table(stdout: str) -> str:
    return stdout.split("=== SNIP summary ===", 1)[1].split("steps ", 1)[0]


@pytest.mark.compiled_quantizers  # as users run it: compiled quantizers, their first-call log clean
def test_progress_plan_lines_clean_output_and_summary(tmp_path):
    proc = _run(tmp_path, "trainer.max_steps=8", "trainer.progress_seconds=0.001", "trainer.val_check_interval=8",
                "trainer.checkpoint_every_n_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr + proc.stdout
    assert log.count("step 8/8 | loss ") == 1  # a progress line per step here, each printed once
    assert "SNIP plan applied at step 3: FP4 FLOPs fraction" in log and "layers changed" in log
    assert "GEMM kernels: fp8: emulated; nvfp4: emulated (cpu)" in log
    assert "compiled kernel _nvfp4_sr_kernel for cpu in" in log  # compiled, its first-call time reported
    for noise in ("💡", "Failed to load", "Detected no triton", "LeafSpec", "register_constant", "INFO: "):
        assert noise not in log, noise
    # Every line before the summary is Lightning's or the project's, once, in Hydra's format; nothing on stderr.
    assert not proc.stderr.strip(), proc.stderr[-3000:]
    lines = [line for line in proc.stdout.split("=== SNIP summary ===")[0].splitlines() if line.strip()]
    logged = re.compile(r"^\[[\d\- :,]+\]\[(lightning_snip|lightning\.pytorch)[\w.]*\]\[(INFO|WARNING)\] - ")
    assert all(logged.match(line) for line in lines), [line for line in lines if not logged.match(line)]
    assert [line.split("] - ", 1)[1][:22] for line in lines[:4]] == [
        "GPU available: False, ", "TPU available: False, ", "SNIP: 15 converted lay", "SNIP: GEMM kernels: fp"]
    summary = proc.stdout.split("=== SNIP summary ===", 1)[1]
    assert f"checkpoint: {tmp_path}/runs/checkpoints/last.ckpt" in summary
    # At the default overhead budget (2%) the first round costs more than the run's 8 steps allow for a second.
    assert "plans applied 1; statistics rounds 1; spike guard: 0 plans watched, 0 reverted" in summary  # (< 8 steps before)
    assert re.search(r"SNIP's own time: \d+\.\d\d% of training's \(budget 2%; \d+\.\d s beside \d+\.\d s of training "
                     r"steps\)\n  in a run of 8 steps, that is its first round, .* Not SNIP's cost at scale", summary), summary
    assert "non-finite" not in summary
    assert f"output folder: {tmp_path}/hydra" in summary
    assert f"--logdir {tmp_path}/runs" in summary
    assert (tmp_path / "runs" / "checkpoints" / "last.ckpt").is_file()
    assert not [p for p in (tmp_path / "runs" / "checkpoints").iterdir() if "=" in p.name]


@pytest.mark.parametrize("overrides,message", [
    (["data.path=/nonexistent/corpus.txt"], "data.path: '/nonexistent/corpus.txt' is not a readable file"),
    (["data.path={empty}"], "data.path: '{empty}' holds 0 bytes; at least"),
    (["data.path={short}"], "data.path: '{short}' holds 100 bytes; at least 661 are needed"),
    (["+snip.foo=1"], "snip.foo: unknown key; allowed:"),
    (["foo=1"], "foo: unknown key; allowed: data, model, snip, trainer and their fields"),
    (["model=foo"], "model: 'foo' is not a model preset; allowed: tiny, smollm2, gemma3"),
    (["model.dim=0"], "model.dim: invalid value 0; allowed: an integer > 0"),
    (["+foo.bar=1"], "foo.bar: unknown key; allowed: data, model, snip, trainer and their fields"),
    (["snip.formats=[fp8,int4]"], "snip.formats: unknown key; allowed: candidate_formats, exclude, extra_pins"),
    (["snip.replan=maybe"], "snip.replan: 'maybe' is not a valid value (Value 'maybe' is not a valid bool"),
    # an Enum field: its values named; the library's "pins[0]: ..." gets the app's prefix
    (["snip.granularity=gems"], "snip.granularity: 'gems' is not a valid value; allowed: layer, gemm"),
    (["snip.pins=[lm_head]"], "snip.pins[0]: 'lm_head' is not 'glob=format'"),
    # a list of Format that takes the FP4 formats only: what it takes, not every format
    (["snip.wgrad_hadamard=mxfp4"], "snip.wgrad_hadamard: 'mxfp4' is not a valid value (Invalid value assigned: str is "
                                    "not a ListConfig, list or tuple.); allowed: a list of FP4 formats (mxfp4, nvfp4)"),
    (["model.dim=1.5"], "model.dim: 1.5 is not a valid value"),
    (["trainer.strategy=nonsense"], "trainer: Lightning rejects these trainer settings (strategy='nonsense'"),
    (["trainer.val_check_interval=-5"], "trainer.val_check_interval: invalid value -5; allowed: an integer > 0"),
    (["snip.fp4_fraction=1.0", "snip.target_scope=model"], "snip.fp4_fraction: 1.0 cannot be met"),
    (["trainer.ckpt_path=last"], "trainer.ckpt_path: 'last', but there is no checkpoint"),
    (["model.dim=40", "model.hidden_dim=72"], "snip.fp4_fraction: 0.6 cannot be met"),  # 40, 72: no 16-block
    (["model.name=smollm2"], "model.name: 'smollm2' with the model preset 'tiny'; allowed: choose the model with "
                             "model=smollm2"),
    (["trainer.lr_warmup_steps=-1"], "trainer.lr_warmup_steps: invalid value -1; allowed: an integer >= 0"),
    (["trainer.ckpt_path={truncated}"], "trainer.ckpt_path: '{truncated}' is not a readable checkpoint ("),
    (["trainer.ckpt_path={folder}"], "trainer.ckpt_path: '{folder}' is a folder but not an FSDP2 checkpoint"),
    (["trainer.precision=64-true"], "trainer.precision: invalid value '64-true'; allowed: 32-true"),
])
def test_configuration_errors_are_one_line_before_training(tmp_path, overrides, message, forked_app):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "short.txt").write_bytes(b"x" * 100)
    import torch

    torch.save({"state_dict": {"w": torch.zeros(4096)}}, tmp_path / "whole.ckpt")
    (tmp_path / "truncated.ckpt").write_bytes((tmp_path / "whole.ckpt").read_bytes()[:10000])  # a copy cut off
    paths = {"empty": tmp_path / "empty.txt", "short": tmp_path / "short.txt", "truncated": tmp_path / "truncated.ckpt",
             "folder": tmp_path}
    overrides = [o.format(**paths) for o in overrides]
    proc = forked_app(tmp_path / "app", "trainer.max_steps=4", *overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message.format(**paths) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "app" / "runs").exists()  # no empty output or version folder left behind
    if "model.dim=40" in overrides:  # the shape, not a pin, is named as the reason
        assert "no FP4 candidate fits the shape (nvfp4 needs dimensions divisible by 16)" in proc.stderr


def test_a_configuration_error_exits_2_from_the_command_line(tmp_path):
    """The configuration errors above, forked; one of them as `python -m lightning_snip.train` runs it (one
    that Hydra's main raises, after the command line's own checks)."""
    proc = _run(tmp_path, "trainer.max_steps=4", "trainer.strategy=nonsense")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: trainer: Lightning rejects these trainer settings (strategy='nonsense'")
    assert proc.stderr.endswith("(HYDRA_FULL_ERROR=1 shows the traceback)\n")
    assert not (tmp_path / "runs").exists()


def test_killed_run_resumes_to_the_uninterrupted_runs_plan(tmp_path):
    steps = ["trainer.max_steps=16", "trainer.checkpoint_every_n_steps=4", "trainer.val_check_interval=16"]
    full = _run(tmp_path / "full", *steps)
    assert full.returncode == 0, full.stderr[-3000:]

    # The output folder of an earlier run (its last.ckpt at step 16): the new run's checkpoints replace
    # it, so that "last" resumes the new run (Lightning's version counter wrote last-v1.ckpt beside it).
    old = tmp_path / "killed" / "runs" / "checkpoints"
    old.mkdir(parents=True)
    shutil.copy(tmp_path / "full" / "runs" / "checkpoints" / "last.ckpt", old / "last.ckpt")
    # The run kills itself (SIGKILL, no clean-up) after its 10th step, so that the step-8 checkpoint is
    # the newest one (save_top_k=1) however fast the machine: polling for a file raced a fast CI machine
    # to the end of the run.
    killer = ("import os, signal, sys, lightning.pytorch as pl, lightning_snip.train as app\n"
              "class Kill(pl.Callback):\n"
              "    def on_train_batch_end(self, trainer, *args):\n"
              "        if trainer.global_step == 10: os.kill(os.getpid(), signal.SIGKILL)\n"
              "build = app._build_trainer\n"
              "app._build_trainer = lambda t, tb, callbacks: build(t, tb, [*callbacks, Kill()])\n"
              "sys.argv[0] = 'snip-train'; app.cli()\n")
    killed = subprocess.run([sys.executable, "-c", killer, *_cmd(tmp_path / "killed", *steps)[3:]], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoints = old / "step000008.ckpt", old / "step000012.ckpt"
    assert checkpoints[0].exists() and not checkpoints[1].exists()

    resumed = _run(tmp_path / "killed", *steps, "trainer.ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"training to step 16 from step 8\b", resumed.stderr + resumed.stdout), resumed.stdout[-2000:]
    assert not list(old.glob("*-v*.ckpt"))
    assert _plan_table(resumed.stdout) == _plan_table(full.stdout)


def test_readme_pin_command_works_through_make(tmp_path):
    # The README's make form, as the outer shell hands it to make: the recipe's shell removes one
    # level of quotes, Hydra sees snip.extra_pins=["*.attn.q=fp8"].
    args = " ".join(_cmd(tmp_path, "trainer.max_steps=4", "trainer.val_check_interval=4")[3:])
    proc = subprocess.run(["make", "-s", "demo", f"ARGS={args} 'snip.extra_pins=[\"*.attn.q=fp8\"]'"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _plan_table(proc.stdout)
    rows = {line.split()[0]: line.split()[1] for line in table.splitlines() if line.startswith("model.")}
    # (per-GEMM plans, the default: a pinned layer's forward and backward both hold the pin)
    assert {rows[f"model.layers.{b}.attn.q:{d}"] for b in (0, 1) for d in ("forward", "backward")} == {"fp8"}
    assert rows["model.lm_head:forward"] == rows["model.lm_head:backward"] == "bf16"  # the default pin is kept


def test_demo_stream_shards_over_ranks_as_one_stream_and_resumes():
    """Under DDP / FSDP2 the demo's rank streams interleave into the single-process stream (nothing
    drawn twice, nothing skipped), also from a resumed position; the data module picks each rank's
    share, or the whole stream when the Trainer's use_distributed_sampler is off."""
    from types import SimpleNamespace

    from torch.utils.data.distributed import DistributedSampler

    from lightning_snip.demo.lightning import ByteTextDataModule, WindowStream

    whole = list(WindowStream(1000, seed=3, length=3 * WindowStream.CHUNK + 5))
    for replicas in (2, 3):
        shares = [list(WindowStream(1000, seed=3, length=len(whole), num_replicas=replicas, rank=r))
                  for r in range(replicas)]
        merged = [None] * len(whole)
        for rank, share in enumerate(shares):
            merged[rank::replicas] = share
        assert merged == whole
    assert list(WindowStream(1000, seed=3, start=4098, length=len(whole), num_replicas=2, rank=1)) == whole[4099::2]
    with pytest.raises(ValueError, match="rank 2 is not in"):
        WindowStream(10, seed=0, num_replicas=2, rank=2)

    data = ByteTextDataModule(seq_len=32, batch_size=4, val_batches=1)
    data.setup()
    for use_distributed_sampler, share in ((True, (2, 1)), (False, (1, 0))):
        data.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1}, global_step=5,
                                       accumulate_grad_batches=2,
                                       _accelerator_connector=SimpleNamespace(use_distributed_sampler=use_distributed_sampler))
        sampler = data.train_dataloader().sampler
        assert isinstance(sampler, DistributedSampler)  # so Lightning does not wrap it
        assert (sampler.num_replicas, sampler.rank) == share
        assert sampler.start == 5 * 2 * 4 * share[0]  # steps x accumulation x batch x ranks
