"""Speed of SNIP on SmolLM2-135M-Instruct (30 blocks, 211 linears), side by side in one process.

One training batch of the stdlib corpus in SmolLM2's tokens (``--batch`` x ``--seq-len``), AdamW
state in place, every switchable linear converted (the LM head pinned in bf16, as the app pins it).
Interleaved over ``--repeats`` (the machine is shared), medians of:
- a training step (forward, backward, AdamW) in high precision (every SNIPLinear in bf16, i.e. the
  run's own precision: fp32 GEMMs under 32-true) and with every unpinned layer in fp8, mxfp4, nvfp4
  (emulated on a CPU: quantize, dequantize, a high-precision GEMM);
- a held-out evaluation forward in high precision (the quality benchmark's eval, per batch);
- a statistics round as the callback runs it (statistics_round.run_statistics_round, candidates fp8
  and mxfp4) at the app preset's settings (``model=smollm2``: max_rows 256) and at SNIPConfig()'s
  (max_rows 1024: the whole batch where it holds fewer rows), in high-precision steps;
- peak memory: the process's peak RSS in each phase (VmHWM reset before it), and its RSS at rest.
From these, the continuation that fits a 2-core session for the quality benchmark (issue 32): the
steps per run at this batch for ``--runs`` runs in ``--session-minutes`` of compute, given a plan
run's step (75% of FLOPs in mxfp4, 25% in fp8: their times weighted so), ``--evals`` evaluations of
``--eval-batches`` batches, and ``--rounds`` statistics rounds per SNIP run.

    python benchmarks/smollm2_speed.py [--batch 4] [--seq-len 128] [--repeats 3] [--threads 2]

Prints ``step <format> <seconds> <x hp>``, ``eval_batch <seconds>``, ``round <setting> <seconds>
<hp steps>``, ``peak_rss_mib <phase> <MiB>``, and ``continuation ...`` lines.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from harness import reset_peak, round_formats, rss_mib

from lightning_snip.config import SNIPConfig
from lightning_snip.statistics_round import NOISE_DRAWS, WD_PROBES
from lightning_snip.convert import convert_linears, high_precision
from lightning_snip.demo.lightning import ByteTextDataModule, CausalLM
from lightning_snip.statistics_round import estimate_divergence
from lightning_snip.formats import Format
from lightning_snip.hf import load_smollm2
from lightning_snip.statistics_round import run_statistics_round
from lightning_snip.stats import collect_stats, slice_batch

FORMATS = (Format.BF16, Format.FP8, Format.MXFP4, Format.NVFP4)
ROUND_SETTINGS = {"preset": SNIPConfig(max_rows=256), "default": SNIPConfig(),
                  # the preset's round before 2026-12-03 afternoon: the pinned LM head measured in every format too
                  "preset_pinned": SNIPConfig(max_rows=256)}
PINNED_MEASURED = {"preset_pinned"}


def _parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", default="preset,default",
                        help="round settings to time: preset, default, preset_pinned (the preset's round "
                             "before 2026-12-03 afternoon: the pinned LM head measured in every format)")
    parser.add_argument("--runs", type=int, default=51, help="quality runs per session (16 policies x 3 seeds + 3 bf16)")
    parser.add_argument("--session-minutes", type=float, default=150.0)
    parser.add_argument("--evals", type=int, default=2, help="held-out evaluations per quality run")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--snip-rounds", type=int, default=2, help="statistics rounds per SNIP run")
    return parser


def _phases(model, module, layers, optimizer, batch, held_out):
    """The timed phases on the loaded model: returns (a training step with every unpinned layer in a format, a
    held-out evaluation forward in high precision, a statistics round at a ROUND_SETTINGS name)."""
    unpinned = [layer for layer in layers.values() if layer.pinned is None]

    def step(fmt: Format) -> None:
        for layer in unpinned:
            layer.format = fmt
        optimizer.zero_grad(set_to_none=True)
        module.snip_loss(batch).backward()
        optimizer.step()

    def evaluate() -> None:
        with torch.no_grad(), high_precision(layers):
            module.snip_loss(held_out)

    def statistics_round(name: str) -> None:
        cfg = ROUND_SETTINGS[name]
        for layer in unpinned:
            layer.format = Format.FP8
        sliced = slice_batch(batch, cfg.max_rows)
        if name not in PINNED_MEASURED:  # the callback's round
            run_statistics_round(model, sliced, module.snip_loss, layers, cfg, optimizer=optimizer,
                                 generator=torch.Generator().manual_seed(0))
            return
        # the pinned head measured in every format: the callback's round with other allowed formats
        stats = collect_stats(model, lambda: module.snip_loss(sliced), layers=layers, optimizer=optimizer)
        try:
            estimate_divergence(stats, cfg.candidate_formats, recipe=cfg.recipe, noise_draws=NOISE_DRAWS, probes=WD_PROBES,
                                generator=torch.Generator().manual_seed(0), allowed=round_formats(layers, True))
        finally:
            stats.release()

    return step, evaluate, statistics_round


def _print_times(args, rounds: list[str], num_layers: int, load_seconds: float, times: dict, med: dict,
                 rest: float, rest_before: float, peaks: dict) -> None:
    """Prints the header, the ``step``, ``eval_batch``, ``round`` and ``peak_rss_mib`` lines."""
    hp = med["step_bf16"]
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()} python "
          f"{platform.python_version()} torch {torch.__version__}; {args.threads} thread(s); SmolLM2-135M-Instruct "
          f"(loaded in {load_seconds:.1f} s), {num_layers} switchable linears (lm_head pinned bf16); batch "
          f"{args.batch}x{args.seq_len} tokens; median of {args.repeats} interleaved repeat(s)")
    for fmt in FORMATS:
        key = f"step_{fmt.value}"
        print(f"step {fmt.value if fmt is not Format.BF16 else 'hp'} {med[key]:.2f} {med[key] / hp:.2f} "
              f"(all: {', '.join(f'{t:.2f}' for t in times[key])})")
    print(f"eval_batch {med['eval']:.2f} {med['eval'] / hp:.2f}")
    for r in rounds:
        cfg = ROUND_SETTINGS[r]
        rows = min(cfg.max_rows, args.batch * args.seq_len)
        print(f"round {r} {med[f'round_{r}']:.1f} {med[f'round_{r}'] / hp:.1f} ({rows} rows: max_rows {cfg.max_rows}, noise_draws "
              f"{NOISE_DRAWS}, wd_probes {WD_PROBES}{', pinned head measured' if r in PINNED_MEASURED else ''}, "
              f"candidates {'/'.join(f.value for f in cfg.candidate_formats)})")
    print(f"peak_rss_mib rest {rest:.0f} (model and tokenizer loaded: {rest_before:.0f})")
    for name, peak in peaks.items():
        print(f"peak_rss_mib {name} {peak:.0f}")


def _print_continuation(args, rounds: list[str], med: dict, load_seconds: float) -> None:
    """Prints the ``continuation`` lines: the steps per quality run that fit --runs runs in --session-minutes."""
    plan_step = 0.75 * med["step_mxfp4"] + 0.25 * med["step_fp8"]
    eval_seconds = args.evals * args.eval_batches * med["eval"]
    snip_round = med[f"round_{rounds[0]}"] if rounds else 0.0
    budget = args.session_minutes * 60
    tokens = args.batch * args.seq_len
    # every run: load_seconds (a fresh process per run, or one load shared) is counted once per run
    per_run_fixed = eval_seconds + load_seconds
    # a third of the runs are SNIP/oracle runs that add their rounds (a conservative share)
    round_share = args.snip_rounds * snip_round / 3
    steps = max(0, int((budget / args.runs - per_run_fixed - round_share) / plan_step))
    print(f"continuation plan_step {plan_step:.2f} s; per run fixed {per_run_fixed:.0f} s (load {load_seconds:.0f}, "
          f"eval {eval_seconds:.0f}); rounds {args.snip_rounds} x {snip_round:.0f} s on a third of the runs")
    print(f"continuation fits {args.runs} runs in {args.session_minutes:.0f} min: {steps} steps x {tokens} tokens "
          f"= {steps * tokens} tokens per run ({steps * tokens * args.runs} in all)")


def main() -> None:
    args = _parser().parse_args()
    rounds = [r for r in args.rounds.split(",") if r]
    for r in rounds:
        if r not in ROUND_SETTINGS:
            raise SystemExit(f"--rounds: {r!r} is not a setting; allowed: {', '.join(ROUND_SETTINGS)}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    load_seconds = time.perf_counter() - start
    rest_before = rss_mib()[0]
    data = ByteTextDataModule(seq_len=args.seq_len, batch_size=args.batch, tokenizer=tokenizer)
    data.setup()
    loader = iter(data.train_dataloader())
    batch, held_out = next(loader), next(loader)
    module = CausalLM(model)
    layers = convert_linears(model, pins={"*lm_head": "bf16"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, betas=(0.9, 0.95))
    step, evaluate, statistics_round = _phases(model, module, layers, optimizer, batch, held_out)
    peaks: dict[str, float] = {}

    def timed(name: str, fn) -> float:
        reset_peak()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        peaks[name] = max(peaks.get(name, 0.0), rss_mib()[1])
        return seconds

    # warm-up: Adam state, every quantizer kernel compiled once
    for fmt in FORMATS:
        step(fmt)
    evaluate()
    rest = rss_mib()[0]
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for fmt in FORMATS:
            times.setdefault(f"step_{fmt.value}", []).append(timed(f"step_{fmt.value}", lambda: step(fmt)))
        times.setdefault("eval", []).append(timed("eval", evaluate))
        for r in rounds:
            times.setdefault(f"round_{r}", []).append(timed(f"round_{r}", lambda: statistics_round(r)))
    med = {k: statistics.median(v) for k, v in times.items()}
    _print_times(args, rounds, len(layers), load_seconds, times, med, rest, rest_before, peaks)
    _print_continuation(args, rounds, med, load_seconds)


if __name__ == "__main__":
    main()
