"""Overhead of SNIPCallback at its default interval, measured side by side in one process.

Run A trains the demo model with SNIPCallback (default SNIPConfig: interval 100, warmup 50). Run B
trains the same model, data and seed with the same layers converted and the same formats at the same
steps (A's plans replayed at A's apply steps) but no statistics rounds and no solver: the plan frozen.
A and B alternate ``--repeats`` times; the ratio of median wall times is the amortized overhead. Also
reports a statistics round's cost in training steps (its seconds over B's mean step time).

    python benchmarks/overhead.py [--steps 350] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import time

import lightning.pytorch as pl
import torch

from lightning_snip.callback import SNIPCallback
from lightning_snip.config import SNIPConfig
from lightning_snip.convert import apply_plan
from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM
from lightning_snip.demo.model import LlamaConfig
from lightning_snip.plan import Plan


class PlanReplay(pl.Callback):
    """Applies recorded plans at their steps (run B)."""

    def __init__(self, schedule: dict[int, Plan]):
        self.schedule = schedule

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        plan = self.schedule.get(trainer.global_step)
        if plan is not None:
            apply_plan(pl_module, plan)


class StepTimer(pl.Callback):
    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args):
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.times.append(time.perf_counter() - self._start)


def train(model_cfg, steps: int, callbacks) -> float:
    pl.seed_everything(0)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    start = time.perf_counter()
    trainer.fit(DemoLM(model_cfg), datamodule=ByteTextDataModule(seq_len=128, batch_size=16))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=350)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = SNIPConfig()
    steps = args.steps
    model_cfg = LlamaConfig()
    if args.quick:
        config = SNIPConfig(warmup_steps=5, interval=10)
        steps, model_cfg = 25, LlamaConfig(dim=64, num_layers=2, hidden_dim=160)
    times_a, times_b, stats_seconds, step_b = [], [], [], []
    for _ in range(args.repeats):
        snip = SNIPCallback(config)
        history: dict[int, Plan] = {}

        class Record(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if snip.plan is not None and (not history or history[max(history)] is not snip.plan):
                    history[trainer.global_step] = snip.plan

        timer_a = StepTimer()
        # The timer's hook runs first, so a statistics step's time includes the statistics round.
        times_a.append(train(model_cfg, steps, [timer_a, snip, Record()]))
        rounds = [timer_a.times[h["step"]] for h in snip.history]
        frozen = SNIPCallback(dataclasses.replace(config, replan=False))
        timer_b = StepTimer()
        times_b.append(train(model_cfg, steps, [timer_b, frozen, PlanReplay(history)]))
        stats_seconds += [r - statistics.median(timer_b.times) for r in rounds]
        step_b.append(statistics.mean(timer_b.times))
    a, b = statistics.median(times_a), statistics.median(times_b)
    step = statistics.mean(step_b)
    print(f"# overhead — {datetime.date.today().isoformat()}")
    print(f"# command: python benchmarks/overhead.py {' '.join(os.sys.argv[1:])}; seed 0; {args.repeats} repeats, A and B alternated")
    print(f"# machine: {platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}, 1 thread; FP4/FP8 emulated")
    print(f"# {steps} steps, interval {config.interval}, warmup {config.warmup_steps}, max_rows {config.max_rows}, "
          f"candidates {[f.value for f in config.candidate_formats]}")
    print(f"run A (SNIP) wall seconds: {[round(t, 1) for t in times_a]}")
    print(f"run B (frozen plan) wall seconds: {[round(t, 1) for t in times_b]}")
    print(f"amortized overhead A/B - 1 = {a / b - 1:+.2%} (target <= 2%)")
    print(f"statistics round (extra time of a statistics step) = {statistics.mean(stats_seconds):.2f} s "
          f"= {statistics.mean(stats_seconds) / step:.1f} training steps of run B ({step * 1000:.0f} ms/step)")


if __name__ == "__main__":
    main()
