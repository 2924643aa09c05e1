"""Fidelity of the divergence estimates (../SNIP_METHOD.md section 9) on the demo model.

Trains the demo model briefly in high precision on the bundled corpus, then on one batch:
  (a) ground truth for LD: the loss increase when only layer l's forward GEMM runs in format p;
  (b) ground truth for WD: the deviation of one AdamW step's parameter update (all parameters) when
      only layer l's backward GEMMs run in p, averaged over stochastic-rounding seeds, relative to
      the high-precision update.
Prints Spearman rank correlations of LD / WD with (a) / (b), beside the relative local quantization
error, and the cost of a statistics round in training steps.

    python benchmarks/divergence_fidelity.py [--quick] [--seed 0]
"""

from __future__ import annotations

import argparse
import copy
import platform
import time

import torch
from scipy.stats import spearmanr

from lightning_snip.convert import convert_linears
from lightning_snip.demo.data import ByteWindows, load_corpus, split_corpus
from lightning_snip.demo.model import LlamaConfig, TinyLlama
from lightning_snip.divergence import estimate_divergence
from lightning_snip.formats import Format
from lightning_snip.stats import collect_stats

FORMATS = (Format.MXFP4, Format.NVFP4)


def batches(dataset, batch_size, generator):
    while True:
        idx = torch.randint(len(dataset), (batch_size,), generator=generator)
        items = [dataset[int(i)] for i in idx]
        yield torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller model and fewer steps (< 1 minute)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sr-seeds", type=int, default=3)
    parser.add_argument("--noise-draws", type=int, default=2)
    parser.add_argument("--noise-scale", type=float, default=0.1)
    parser.add_argument("--probe", choices=["error", "gaussian"], default="error")
    parser.add_argument("--skip-weights", action="store_true", help="skip the WD ground truth (LD study only)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    if args.quick:
        cfg, train_steps, batch_size, seq_len, sr_seeds = LlamaConfig(dim=64, num_layers=2, hidden_dim=160), 60, 8, 64, 2
    else:
        cfg, train_steps, batch_size, seq_len, sr_seeds = LlamaConfig(), 300, 16, 128, args.sr_seeds
    print(f"# machine: {platform.machine()} python {platform.python_version()} torch {torch.__version__}")
    print(f"# model {cfg}, train_steps={train_steps}, batch {batch_size}x{seq_len}, seed={args.seed}, sr_seeds={sr_seeds}")

    train, _ = split_corpus(load_corpus(None), 0.05)
    data = batches(ByteWindows(train, seq_len), batch_size, torch.Generator().manual_seed(args.seed))
    model = TinyLlama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for _ in range(train_steps):
        loss = model.loss(next(data))
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"# trained: loss {loss.item():.3f}")

    layers = convert_linears(model)
    batch = next(data)

    def train_step_seconds(repeats=5):
        m, o = copy.deepcopy(model), copy.deepcopy(opt)
        start = 0.0
        for i in range(repeats + 1):  # the first step warms up (lazy imports, allocator)
            if i == 1:
                start = time.perf_counter()
            loss = m.loss(batch)
            o.zero_grad()
            loss.backward()
            o.step()
        return (time.perf_counter() - start) / repeats

    step_seconds = train_step_seconds()
    # On this machine a training step in low precision is emulated (quantize, dequantize, matmul):
    # the step SNIP's plans actually run. Measured with every layer in mxfp4.
    for layer in layers.values():
        layer.format = Format.MXFP4
    emulated_step_seconds = train_step_seconds(repeats=3)
    for layer in layers.values():
        layer.format = Format.BF16
    warmup = collect_stats(model, lambda: model.loss(batch), layers=layers, optimizer=opt)  # one-time costs
    estimate_divergence(warmup, FORMATS, noise_draws=1, curvature_probe=args.probe)
    warmup.release()
    start = time.perf_counter()
    stats = collect_stats(model, lambda: model.loss(batch), layers=layers, optimizer=opt)
    result = estimate_divergence(stats, FORMATS, noise_draws=args.noise_draws, noise_scale=args.noise_scale,
                                 curvature_probe=args.probe, generator=torch.Generator().manual_seed(args.seed))
    stats.release()
    round_seconds = time.perf_counter() - start

    # (a) one layer's forward in p
    with torch.no_grad():
        base = model.loss(batch).item()
        loss_increase = {}
        for fqn, layer in layers.items():
            for fmt in FORMATS:
                layer.format, layer.backward_format = fmt, Format.BF16
                loss_increase[fqn, fmt] = model.loss(batch).item() - base
            layer.format, layer.backward_format = Format.BF16, None

    # (b) one layer's backward in p: deviation of one AdamW update
    model_state, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    before = [p.detach().clone() for p in model.parameters()]

    def update(seed):
        model.load_state_dict(model_state)
        opt.load_state_dict(copy.deepcopy(opt_state))
        torch.manual_seed(seed)
        l = model.loss(batch)
        opt.zero_grad()
        l.backward()
        opt.step()
        return [p.detach() - b for p, b in zip(model.parameters(), before)]

    ref = update(0)
    ref_norm = sum(float(r.pow(2).sum()) for r in ref)
    update_deviation = {}
    for fqn, layer in layers.items() if not args.skip_weights else ():
        for fmt in FORMATS:
            layer.backward_format = fmt
            devs = []
            for seed in range(sr_seeds):
                u = update(1000 + seed)
                devs.append(sum(float((a - b).pow(2).sum()) for a, b in zip(u, ref)) / ref_norm)
            update_deviation[fqn, fmt] = sum(devs) / len(devs)
        layer.backward_format = None
    model.load_state_dict(model_state)

    fqns = list(layers)
    if args.skip_weights:
        update_deviation = {key: float("nan") for key in loss_increase}
    print(f"# curvature probe {args.probe}, noise_draws={args.noise_draws} noise_scale={args.noise_scale}")
    print(f"{'layer':<22} {'fmt':<6} {'LD':>10} {'loss_inc':>10} {'WD':>10} {'upd_dev':>10} {'WDdirect':>9} {'WDprop':>9}")
    for fqn in fqns:
        d = result.layers[fqn]
        for fmt in FORMATS:
            print(f"{fqn:<22} {fmt.value:<6} {d.loss_divergence[fmt] * result.loss:10.3e} {loss_increase[fqn, fmt]:10.3e} "
                  f"{d.weight_divergence[fmt]:10.3e} {update_deviation[fqn, fmt]:10.3e} {d.wd_direct[fmt]:9.2e} {d.wd_propagated[fmt]:9.2e}")
    print(f"# statistics round {round_seconds:.2f} s = {round_seconds / step_seconds:.2f} high-precision training steps "
          f"({step_seconds * 1000:.0f} ms/step) = {round_seconds / emulated_step_seconds:.2f} emulated mxfp4 training steps "
          f"({emulated_step_seconds * 1000:.0f} ms/step); limit 2 + {len(fqns)}/4 = {2 + len(fqns) / 4:.2f}")
    extra = {}
    for fmt in FORMATS:
        truth_a = [loss_increase[f, fmt] for f in fqns]
        truth_b = [update_deviation[f, fmt] for f in fqns]
        d = result.layers
        extra[fmt] = {
            "first_order_only": spearmanr([d[f].first_order[fmt] for f in fqns], truth_a).statistic,
            "wd_direct_only": spearmanr([d[f].wd_direct[fmt] for f in fqns], truth_b).statistic,
            "wd_propagated_only": spearmanr([d[f].wd_propagated[fmt] for f in fqns], truth_b).statistic,
        }
        print(f"# {fmt.value}: " + ", ".join(f"{k} {v:.3f}" for k, v in extra[fmt].items()))
    for fmt in FORMATS:
        truth_a = [loss_increase[f, fmt] for f in fqns]
        truth_b = [update_deviation[f, fmt] for f in fqns]
        d = result.layers
        rows = {
            "loss_divergence": spearmanr([d[f].loss_divergence[fmt] for f in fqns], truth_a).statistic,
            "weight_divergence": spearmanr([d[f].weight_divergence[fmt] for f in fqns], truth_b).statistic,
            "rel_error_vs_loss": spearmanr([d[f].rel_error_forward[fmt] for f in fqns], truth_a).statistic,
            "rel_error_vs_weights": spearmanr([d[f].rel_error_wgrad[fmt] for f in fqns], truth_b).statistic,
        }
        for name, value in rows.items():
            print(f"spearman {name} {fmt.value} {value:.3f}")


if __name__ == "__main__":
    main()
