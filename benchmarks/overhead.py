"""SNIPCallback's overhead at its defaults, measured side by side in one process (an A/B of whole runs).

Run A trains a model with SNIPCallback (SNIPConfig() unless told otherwise: the overhead budget on). Run B trains
the same model, data and seed with the same layers converted and the same formats at the same steps (A's plans
replayed at A's apply steps, and A's reverts), but no statistics round, no first-order sample, no solver and no
per-step guard: the plan frozen. A and B alternate ``--repeats`` times; reported: each pair's ratio A/B - 1, their
mean and std, SNIP's own measured share (controller.overhead, what the budget steers by) beside it, and a
round's cost in B's steps. ``--batch-sizes`` repeats the A/B per tokens per step (the round's cost is fixed by
max_rows; a step grows with its tokens). Writes a JSON of every run with ``--json``.

    python benchmarks/overhead.py [--model demo|smollm2] [--steps 350] [--repeats 2] [--compile]
        [--batch-sizes 16] [--budget 0.02|none] [--device cpu|cuda] [--precision 32-true|bf16-mixed] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import statistics
import tempfile
import time

import lightning.pytorch as pl
import torch

from lightning_snip.callback import SNIPCallback
from lightning_snip.config import SNIPConfig
from lightning_snip.demo.lightning import ByteTextDataModule, CausalLM, DemoLM
from lightning_snip.demo.model import LlamaConfig


class FormatRecord(pl.Callback):
    """Run A: every step's format assignment as it starts (after SNIP's hooks: put it after the callback)."""

    def __init__(self, snip: SNIPCallback):
        self.snip, self.assignments = snip, {}
        self._last = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        formats = {fqn: (layer.format.value, None if layer.backward_format is None else layer.backward_format.value)
                   for fqn, layer in self.snip.layers.items()}
        if formats != self._last:
            self.assignments[trainer.global_step] = formats
            self._last = formats


class FormatReplay(pl.Callback):
    """Run B: A's format assignments at A's steps (before the step's forward)."""

    def __init__(self, snip: SNIPCallback, assignments: dict):
        self.snip, self.assignments = snip, assignments

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        formats = self.assignments.get(trainer.global_step)
        if formats is not None:
            for fqn, (forward, backward) in formats.items():
                layer = self.snip.layers[fqn]
                layer.format, layer.backward_format = forward, backward


class StepTimer(pl.Callback):
    """Each step's wall time from its first hook to its last (put it first: a round's step includes the round)."""

    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args):
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.times.append(time.perf_counter() - self._start)


class CompiledDemoLM(DemoLM):
    def configure_model(self):
        self.model = torch.compile(self.model)


class CompiledCausalLM(CausalLM):
    def configure_model(self):
        self.model = torch.compile(self.model)


def build(args, batch_size: int):
    """(module, datamodule) for one run, the same weights and data every time."""
    pl.seed_everything(0)
    if args.model == "smollm2":
        from lightning_snip.hf import load_smollm2

        model, tokenizer = load_smollm2(progress=False)
        module = (CompiledCausalLM if args.compile else CausalLM)(model, lr=3e-4)
        return module, ByteTextDataModule(seq_len=args.seq_len, batch_size=batch_size, tokenizer=tokenizer)
    model_cfg = LlamaConfig(dim=64, num_layers=2, hidden_dim=160) if args.quick else LlamaConfig(
        dim=args.dim, num_layers=args.layers, hidden_dim=args.hidden_dim or LlamaConfig().hidden_dim * args.dim // 128)
    module = (CompiledDemoLM if args.compile else DemoLM)(model_cfg)
    return module, ByteTextDataModule(seq_len=args.seq_len, batch_size=batch_size)


def train(args, batch_size: int, callbacks) -> float:
    module, data = build(args, batch_size)
    trainer = pl.Trainer(max_steps=args.steps, accelerator=args.device, devices=1, precision=args.precision,
                         callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    if args.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _fresh_kernel_cache(args):
    """Under --compile, an empty inductor cache directory for the run (torch's own temporary_cache_dir, which also
    clears the in-memory caches): the FX-graph and autograd caches are off (main), but the C++ kernels inductor
    compiles are cached on disk by their source, so B would load the kernels A compiled at its switch (the
    2026-12-04 afternoon pair: A's switch recompile 917 s, B's whole run 714 s)."""
    if not args.compile:
        return contextlib.nullcontext()
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    return temporary_cache_dir(tempfile.mkdtemp(prefix="snip_overhead_inductor_"))


def warm_up(args, config: SNIPConfig, batch_size: int) -> None:
    """Eager: before the pairs, a few frozen steps in each candidate format (no round: replan=False), so that the
    quantizer kernels training itself uses are compiled before either run of a pair. lightning_snip's kernels
    compile on first use, once per process (lightning_snip.kernels.run_compiled): without this the first A paid
    every training format's compile (fp8 at step 0, FP4 in its round) and every B reused them (--quick on
    2026-12-06: step 0 took 2.9 s in A, 0.08 s in B; A/B - 1 +477% against +19% warmed). The kernels only SNIP's
    round uses (AdamW's update deviation and sensitivity, ~4 s on this CPU) are left for A to compile: they are SNIP's
    cost, once per process. (Under --compile dynamo's reset before each run: each compiles its own.)"""
    for fmt in config.candidate_formats:
        frozen = dataclasses.replace(config, replan=False, initial_format=fmt)
        train(argparse.Namespace(**{**vars(args), "steps": 3}), batch_size, [SNIPCallback(frozen)])


def pair(args, config: SNIPConfig, batch_size: int) -> dict:
    """One A run and its B run. Under --compile each run starts from dynamo's reset with inductor's caches off
    (TORCHINDUCTOR_FX_GRAPH_CACHE=0, TORCHINDUCTOR_AUTOGRAD_CACHE=0, set by main): B would otherwise reuse the
    graphs A compiled (on 2026-12-04 a first, cached run made SmolLM2's B 6x faster than its A)."""
    snip = SNIPCallback(config)
    timer_a, record = StepTimer(), FormatRecord(snip)
    hooks = time_hooks(snip)
    if args.compile:
        torch._dynamo.reset()
    with _fresh_kernel_cache(args):
        seconds_a = train(args, batch_size, [timer_a, snip, record])
    frozen = SNIPCallback(dataclasses.replace(config, replan=False))
    timer_b = StepTimer()
    if args.compile:
        torch._dynamo.reset()
    with _fresh_kernel_cache(args):
        seconds_b = train(args, batch_size, [timer_b, frozen, FormatReplay(frozen, record.assignments)])
    step_b = statistics.median(timer_b.times)
    rounds = [h["step"] for h in snip.history]
    return {"batch_size": batch_size, "a_seconds": seconds_a, "b_seconds": seconds_b, "ratio": seconds_a / seconds_b - 1,
            "self_measured": snip.controller.overhead, "rounds": rounds, "plans_applied": snip.num_plans_applied,
            "first_order_steps": snip.controller.budget.num_first_order,
            "snip_seconds": dict(snip.controller.budget.snip_seconds),
            "round_steps": [(timer_a.times[r] - step_b) / step_b for r in rounds if r < len(timer_a.times)],
            "step_b_ms": 1000 * step_b,
            # where A - B goes: the steps (SNIP's work, and what its hooks cost on a plain step, which the self-measured
            # share does not see: its baseline is A's own plain steps) and what the fit spends outside them
            "a_step_seconds": sum(timer_a.times), "b_step_seconds": sum(timer_b.times),
            "median_step_ratio": statistics.median(timer_a.times) / step_b - 1,
            # SNIP's hooks on a plain step (the median step's), which the self-measured share does not count
            "median_hook_ms": 1000 * statistics.median(hooks.values()), "hook_share": statistics.median(hooks.values()) / step_b}


def time_hooks(snip: SNIPCallback) -> dict[int, float]:
    """The seconds SNIPCallback's per-step hooks take at each step (Lightning looks a callback's hooks up on the
    instance, so the timed wrappers stand in for them). On a CPU the host time is the cost; on a GPU it is launches."""
    seconds: dict[int, float] = {}
    for name in ("on_train_batch_start", "on_train_batch_end", "on_before_optimizer_step"):
        def timed(trainer, *args, _hook=getattr(snip, name), _end=name == "on_train_batch_end"):
            start = time.perf_counter()
            out = _hook(trainer, *args)
            step = trainer.global_step - 1 if _end else trainer.global_step  # (the end hook runs after the step)
            seconds[step] = seconds.get(step, 0.0) + time.perf_counter() - start
            return out

        setattr(snip, name, timed)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["demo", "smollm2"], default="demo")
    parser.add_argument("--steps", type=int, default=350)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default: 16 (demo), 4 (smollm2)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dim", type=int, default=LlamaConfig().dim)
    parser.add_argument("--layers", type=int, default=LlamaConfig().num_layers)
    parser.add_argument("--hidden-dim", type=int, default=None)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--budget", default="default", help="overhead_budget: a number, none, or default (SNIPConfig's)")
    parser.add_argument("--smollm2-preset", action="store_true", help="the app's model=smollm2 snip values")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-warmup", action="store_true", help="eager: no warm-up run before the pairs (see warm_up)")
    args = parser.parse_args()
    if args.compile:  # (read by inductor when it compiles: before the first run)
        os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
        os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    torch.set_num_threads(args.threads)
    settings = {}
    if args.budget != "default":
        settings["overhead_budget"] = None if args.budget == "none" else float(args.budget)
    if args.model == "smollm2" or args.smollm2_preset:
        settings.update(warmup_steps=10, interval=10, max_rows=256, first_order_steps=4)
    if args.quick:
        settings.update(warmup_steps=5, interval=10)
        args.steps = min(args.steps, 25)
    config = SNIPConfig(**settings)
    batch_sizes = args.batch_sizes or ([4] if args.model == "smollm2" else [16])
    runs = []
    if not args.compile and not args.no_warmup:
        warm_up(args, config, batch_sizes[0])
    for batch_size in batch_sizes:
        for repeat in range(args.repeats):
            runs.append(pair(args, config, batch_size))
            r = runs[-1]
            print(f"batch {batch_size} repeat {repeat}: A {r['a_seconds']:.1f} s, B {r['b_seconds']:.1f} s, "
                  f"A/B - 1 = {r['ratio']:+.2%}, self-measured {r['self_measured']:.2%}, rounds {r['rounds']}", flush=True)
    print(f"# overhead — {datetime.date.today().isoformat()}")
    print(f"# command: python benchmarks/overhead.py {' '.join(os.sys.argv[1:])}; seed 0; A and B alternated")
    print(f"# machine: {platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}, {args.threads} thread(s), "
          f"device {args.device}, precision {args.precision}, compile {args.compile}")
    print(f"# model {args.model}, {args.steps} steps, seq_len {args.seq_len}; SNIPConfig: overhead_budget "
          f"{config.overhead_budget}, interval {config.interval}, warmup {config.warmup_steps}, max_rows {config.max_rows}, "
          f"first_order_steps {config.first_order_steps} x {config.max_rows} rows")
    print("| tokens/step | pairs | A/B - 1 (mean ± std) | self-measured | rounds | round cost (B steps) | B ms/step |")
    print("|---|---|---|---|---|---|---|")
    for batch_size in batch_sizes:
        rs = [r for r in runs if r["batch_size"] == batch_size]
        ratios = [r["ratio"] for r in rs]
        std = statistics.stdev(ratios) if len(ratios) > 1 else float("nan")
        cost = [c for r in rs for c in r["round_steps"]]
        print(f"| {batch_size * args.seq_len} | {len(rs)} | {statistics.mean(ratios):+.2%} ± {std:.2%} | "
              f"{statistics.mean(r['self_measured'] for r in rs):.2%} | {rs[0]['rounds']} | "
              f"{statistics.mean(cost) if cost else float('nan'):.1f} | {statistics.mean(r['step_b_ms'] for r in rs):.0f} |")
    print()
    print("| pair | A/B - 1 | self-measured | SNIP's hooks, plain step | steps A/B - 1 | median step A/B - 1 | "
          "A/B - 1 less the median step's | outside the steps, A - B (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(runs):
        outside = (r["a_seconds"] - r["a_step_seconds"]) - (r["b_seconds"] - r["b_step_seconds"])
        print(f"| {i} (batch {r['batch_size']}) | {r['ratio']:+.2%} | {r['self_measured']:.2%} | {r['hook_share']:.2%} | "
              f"{r['a_step_seconds'] / r['b_step_seconds'] - 1:+.2%} | {r['median_step_ratio']:+.2%} | "
              f"{r['ratio'] - r['median_step_ratio']:+.2%} | {outside:+.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "config": {k: str(v) for k, v in dataclasses.asdict(config).items()},
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
