"""The guard against harm (issue 60): the plan canary and the loss watch, on faults of the training path alone.

Parts (each run cached as JSON under --out as it ends; a rerun resumes):

- ``fault``: the demo model (2 blocks, dim 64; 60 steps, rounds at 10, 30, 50, plans a step later) with one of
  harness.TRAINING_PATH_FAULTS injected into lightning_snip.linear's GEMM only (the statistics round's path
  untouched): negated / zeroed FP4 gradients, noise 1x the output on the FP4 forward, an FP8 forward with every
  other 16-column block zeroed. Per seed three runs: the guard on (the defaults: canary and loss watch), the
  guard off (``plan_canary=False, spike_threshold=None``: what the fault costs unguarded), and a run that never
  had a plan (``replan=False``: fp8, or bf16 for the FP8 fault, whose runs start in bf16). Reported: the steps
  from the first plan to the first revert, the reverts, and the held-out loss against the never-planned run.
- ``healthy``: runs whose plans are healthy, counted for false reverts and for alarms the same batch found were
  not the plan's: the app at its defaults (the demo; ``--smollm2`` adds SmolLM2 at its preset), a Hugging Face
  Llama trained from scratch with a linear LR warm-up (40 steps) and a cosine, and the demo with a data shift
  (from step 40 the bytes of every batch are reversed: another distribution of the same corpus).
- ``overhead``: the demo model at the defaults, 160 steps, the guard on against off, alternated in one process,
  the ratio per pair.

    python benchmarks/guard_faults.py --parts fault healthy overhead --seeds 0 1 2 3 4 [--smollm2]

Prints a markdown report; commit it under benchmarks/results/guard_faults_<date>.md.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

import lightning_snip.linear as linear
from lightning_snip.callback import SNIPCallback
from lightning_snip.config import SNIPConfig
from lightning_snip.demo.lightning import ByteTextDataModule, CausalLM, DemoLM
from lightning_snip.demo.model import LlamaConfig

from harness import TRAINING_PATH_FAULTS, cached_json, mean_std, training_path_fault, warm_up_config

ROOT = Path(__file__).resolve().parent.parent
DEMO = LlamaConfig(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=160)
FAULT_STEPS = 60
FAULT_SETTINGS = dict(warmup_steps=10, interval=20, fp4_fraction=0.6, max_rows=128, overhead_budget=None)


class _Events(pl.Callback):
    """The steps at which plans were applied and reverted (by the canary or the loss watch)."""

    def __init__(self, snip: SNIPCallback):
        self.snip, self.applied, self.reverted = snip, [], []
        self._last = (0, 0, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        c = self.snip.controller
        now = (c.num_plans_applied, c.num_canary_reverts, c.guard.num_reverts)
        step = trainer.global_step - 1
        if now[0] > self._last[0]:
            self.applied.append(step)
        if now[1] > self._last[1] or now[2] > self._last[2]:
            self.reverted.append(step)
        self._last = now


def _fit(module, data, snip: SNIPCallback, max_steps: int, extra=()) -> tuple[pl.Trainer, _Events]:
    events = _Events(snip)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[snip, events, *extra], accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         val_check_interval=max_steps, limit_val_batches=4)
    trainer.fit(module, datamodule=data)
    return trainer, events


def _summary(snip: SNIPCallback, trainer: pl.Trainer, events: _Events, **extra) -> dict:
    c = snip.controller
    return {**extra, "val_loss": float(trainer.callback_metrics["val/loss"]), "plans": c.num_plans_applied,
            "applied_at": events.applied, "reverted_at": events.reverted, "canary_reverts": c.num_canary_reverts,
            "watch_reverts": c.guard.num_reverts, "unconfirmed": c.guard.num_unconfirmed,
            "largest_rise": c.guard.max_rise if math.isfinite(c.guard.max_rise) else None}


def fault_run(kind: str, seed: int, mode: str) -> dict:
    """``mode``: "guard" (the defaults), "watch_only" (the canary off), "unguarded" (canary and watch off), "never"
    (no plan)."""
    initial = "bf16" if kind == "broken_fp8_forward" else "fp8"
    settings = {**FAULT_SETTINGS, "initial_format": initial}
    if mode == "unguarded":
        settings.update(plan_canary=False, spike_threshold=None)
    elif mode == "watch_only":
        settings.update(plan_canary=False)
    elif mode == "never":
        settings.update(replan=False)
    pl.seed_everything(seed)
    module, data = DemoLM(DEMO), ByteTextDataModule(seq_len=32, batch_size=8, val_batches=4, seed=seed)
    snip = SNIPCallback(SNIPConfig(**settings))
    real = linear.quantized_matmul

    class Fault(pl.Callback):  # the layers exist from fit start; the fault hits every layer in its format
        def on_fit_start(self, trainer, pl_module):
            linear.quantized_matmul = training_path_fault(kind)

    try:
        trainer, events = _fit(module, data, snip, FAULT_STEPS, extra=[Fault()])
    finally:
        linear.quantized_matmul = real
    return _summary(snip, trainer, events, kind=kind, seed=seed, mode=mode)


def app_run(out: Path, seed: int, model: str = "tiny") -> dict:
    """One run of the app at its defaults; what its summary says."""
    args = [sys.executable, "-m", "lightning_snip.train", f"trainer.seed={seed}", f"trainer.output_dir={out}/run",
            f"hydra.run.dir={out}/hydra"] + (["model=smollm2"] if model != "tiny" else [])
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    guard = re.search(r"spike guard: (\d+) plans watched, (\d+) reverted(?: \(largest loss rise (-?[\d.]+) sigma\))?, "
                      r"(\d+) alarms not the plan's; plan canary: (\d+) GEMM", proc.stdout)
    losses = re.search(r"val loss ([\d.]+)", proc.stdout)
    plans = re.search(r"plans applied (\d+)", proc.stdout)
    return {"run": f"app {model}", "seed": seed, "plans": int(plans.group(1)), "watch_reverts": int(guard.group(2)),
            "largest_rise": float(guard.group(3)) if guard.group(3) else None, "unconfirmed": int(guard.group(4)),
            "canary_reverts": int(guard.group(5)), "val_loss": float(losses.group(1)),
            "seconds": time.perf_counter() - start}


def hf_scratch_run(seed: int, steps: int = 160) -> dict:
    """A Hugging Face Llama from scratch: LR warm-up over 40 steps, then a cosine; plans from step 11 every 20."""
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    pl.seed_everything(seed)
    config = HFConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    module = CausalLM(LlamaForCausalLM(config), lr=3e-3, warmup_steps=40, cosine=True, min_lr_ratio=0.1)
    data = ByteTextDataModule(seq_len=32, batch_size=8, val_batches=4, seed=seed)
    snip = SNIPCallback(SNIPConfig(**FAULT_SETTINGS))
    trainer, events = _fit(module, data, snip, steps)
    return _summary(snip, trainer, events, run="hf llama, scratch, warm-up + cosine", seed=seed)


class _ReversedFrom(ByteTextDataModule):
    """The corpus's batches, their bytes reversed from ``step`` on (a data shift mid-run)."""

    def __init__(self, step: int, **kw):
        super().__init__(**kw)
        self.shift_step, self.trainer_ref = step, None

    def train_dataloader(self):
        inner = super().train_dataloader()
        owner = self

        class Shifted:
            def __iter__(self):
                for inputs, targets in inner:
                    trainer = owner.trainer
                    if trainer is not None and trainer.global_step >= owner.shift_step:
                        tokens = torch.cat([inputs, targets[:, -1:]], dim=1).flip(1)
                        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
                    yield inputs, targets

            def __len__(self):
                return len(inner)

        return Shifted()


def data_shift_run(seed: int, steps: int = 80) -> dict:
    pl.seed_everything(seed)
    module, data = DemoLM(DEMO), _ReversedFrom(40, seq_len=32, batch_size=8, val_batches=4, seed=seed)
    snip = SNIPCallback(SNIPConfig(**FAULT_SETTINGS))
    trainer, events = _fit(module, data, snip, steps)
    return _summary(snip, trainer, events, run="demo, data shift at step 40", seed=seed)


def overhead_pair(seed: int, steps: int = 160) -> dict:
    """Seconds of a demo run at the defaults with the guard off, then on (the same seed, in this process, after a
    warm-up run that compiles the quantizers both use: harness.warm_up_config)."""
    out = {}
    for name, settings in (("warm_up", None), ("off", dict(plan_canary=False, spike_threshold=None)), ("on", {})):
        pl.seed_everything(seed)
        module, data = DemoLM(LlamaConfig()), ByteTextDataModule(seq_len=128, batch_size=16, val_batches=1, seed=seed)
        snip = SNIPCallback(SNIPConfig(**settings) if settings is not None else warm_up_config(SNIPConfig()))
        trainer = pl.Trainer(max_steps=steps if settings is not None else 8, callbacks=[snip], accelerator="cpu",
                             logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        out[name] = time.perf_counter() - start
        out[f"{name}_plans"] = snip.num_plans_applied
    out["ratio"] = out["on"] / out["off"]
    return out


def fault_report(out: Path, seeds) -> list[str]:
    lines = ["## Training-path faults (demo, 60 steps, first plan at step 11)", "",
             "Steps to revert: from the first plan's step to the first revert (0: before that step's forward). Loss "
             "cost: the held-out loss minus the never-planned run's, paired by seed.", "",
             "| fault | seeds reverted (guard) | steps to revert | canary / watch reverts | cost, guard | cost, unguarded "
             "| the loss watch alone: seeds reverted, cost |",
             "|---|---|---|---|---|---|---|"]
    for kind in TRAINING_PATH_FAULTS:
        runs = {mode: [cached_json(out / f"fault_{kind}_{mode}_{s}.json", lambda s=s, m=mode: fault_run(kind, s, m))
                       for s in seeds] for mode in ("guard", "watch_only", "unguarded", "never")}
        guarded = runs["guard"]
        delays = [r["reverted_at"][0] - r["applied_at"][0] for r in guarded if r["reverted_at"] and r["applied_at"]]
        cost = [g["val_loss"] - n["val_loss"] for g, n in zip(guarded, runs["never"])]
        bare = [u["val_loss"] - n["val_loss"] for u, n in zip(runs["unguarded"], runs["never"])]
        alone = [w["val_loss"] - n["val_loss"] for w, n in zip(runs["watch_only"], runs["never"])]
        (cm, cs), (bm, bs), (am, as_) = mean_std(cost), mean_std(bare), mean_std(alone)
        lines.append(f"| {kind} | {sum(bool(r['reverted_at']) for r in guarded)} of {len(guarded)} | "
                     f"{', '.join(str(d) for d in delays) or '-'} | {sum(r['canary_reverts'] for r in guarded)} / "
                     f"{sum(r['watch_reverts'] for r in guarded)} | {cm:+.4f} ± {cs:.4f} (max {max(cost):+.4f}) | "
                     f"{bm:+.4f} ± {bs:.4f} | {sum(bool(r['reverted_at']) for r in runs['watch_only'])} of "
                     f"{len(alone)}, {am:+.4f} ± {as_:.4f} |")
    return lines + [""]


def healthy_report(out: Path, seeds, smollm2: bool) -> list[str]:
    runs = [cached_json(out / f"healthy_app_tiny_{s}.json", lambda s=s: app_run(out / f"tiny{s}", s)) for s in seeds]
    if smollm2:
        runs.append(cached_json(out / "healthy_app_smollm2_0.json", lambda: app_run(out / "smollm2", 0, "smollm2")))
    runs += [cached_json(out / f"healthy_hf_scratch_{s}.json", lambda s=s: hf_scratch_run(s)) for s in seeds[:3]]
    runs += [cached_json(out / f"healthy_data_shift_{s}.json", lambda s=s: data_shift_run(s)) for s in seeds[:3]]
    lines = ["## Healthy runs: false reverts", "",
             "| run | seed | plans | canary reverts | watch reverts | alarms not the plan's | largest rise (sigma) | val loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rise = "-" if r.get("largest_rise") is None else f"{r['largest_rise']:.1f}"
        lines.append(f"| {r['run']} | {r['seed']} | {r['plans']} | {r['canary_reverts']} | {r['watch_reverts']} | "
                     f"{r['unconfirmed']} | {rise} | {r['val_loss']:.4f} |")
    false = sum(r["canary_reverts"] + r["watch_reverts"] for r in runs)
    return lines + ["", f"False reverts: {false} over {len(runs)} healthy runs "
                        f"({sum(r['plans'] for r in runs)} plans).", ""]


def overhead_report(out: Path, seeds) -> list[str]:
    pairs = [cached_json(out / f"overhead_{s}.json", lambda s=s: overhead_pair(s)) for s in seeds[:3]]
    mean, std = mean_std([p["ratio"] for p in pairs])
    lines = ["## The guard's cost (demo at the defaults, 160 steps, on / off in one process)", "",
             "| seed | off s | on s | on / off |", "|---|---|---|---|"]
    lines += [f"| {i} | {p['off']:.1f} | {p['on']:.1f} | {p['ratio']:.3f} |" for i, p in enumerate(pairs)]
    return lines + ["", f"Ratio {mean:.3f} ± {std:.3f}.", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", default=["fault", "healthy", "overhead"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--smollm2", action="store_true", help="also one healthy SmolLM2 run (model=smollm2)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "guard_faults_runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = []
    if "fault" in args.parts:
        lines += fault_report(args.out, args.seeds)
    if "healthy" in args.parts:
        lines += healthy_report(args.out, args.seeds, args.smollm2)
    if "overhead" in args.parts:
        lines += overhead_report(args.out, args.seeds)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
