"""What SNIP costs a user at scale, predicted from counted FLOPs and kernel launches (issue 50).

Counted on this CPU, at SNIPConfig()'s defaults, on demo models with Llama-3's proportions (hidden = 3.5 x dim,
head dim 64, 4 query heads per KV head) at two widths and two depths: the FLOPs (torch.utils.flop_counter) and
the kernel launches (harness.count_kernel_ops: the aten operations that would launch a GPU kernel) of a
training step, of a step that samples LD's first-order term, and of a statistics round. Fitted: FLOPs per
(row x weight element) of the round and of the sample, launches per linear layer, and checked to be constant
across widths and depths. Predicted at Llama-3-8B's layer sizes (32 blocks, dim 4096, hidden 14336, 8 KV heads),
8k and 16k tokens per GPU, H100 and B200 dense bf16 peaks: a step's time (its linear FLOPs at 40% MFU; attention
left out, which shortens the step and overstates SNIP's share), a round's (its FLOPs at 40% of peak plus 5 us
per launch), and from them the overhead of the fixed schedule (a round every 100 steps, 32 sampled) and the
spacing a 2% budget sets. Calibrated against the H200's measured round at width 4096 x 4 blocks
(benchmarks/results/gpu_check_2026-11-30_round_precision.md: 523 ms, 26,331 kernels, 42.5 ms per 2048-token step).

    python benchmarks/overhead_at_scale.py [--widths 128 256] [--blocks 2 4]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from harness import count_kernel_ops
from lightning_snip.config import SNIPConfig
from lightning_snip.controller import SNIPController
from lightning_snip.demo.model import LlamaConfig, TinyLlama

TOKENS = 2048  # a counted step: 16 x 128
PEAKS = {"H100": 989e12, "B200": 2250e12}  # dense bf16 FLOP/s
MFU, LAUNCH_SECONDS = 0.40, 5e-6
FP4_SPEEDUP = 1.6  # the step at 75% FP4 against bf16 (the upper end of what users gain)
LLAMA3_8B = dict(blocks=32, dim=4096, hidden=14336, kv_dim=1024)


def llama_like(width: int, blocks: int) -> LlamaConfig:
    heads = max(width // 64, 4)
    return LlamaConfig(dim=width, num_layers=blocks, num_heads=heads, num_kv_heads=max(heads // 4, 1),
                       hidden_dim=width * 7 // 2, max_seq_len=128)


def linear_elements(layers, switchable_only=True) -> int:
    return sum(layer.in_features * layer.out_features for layer in layers.values()
               if not (switchable_only and layer.pinned is not None))


def count(fn, inner_flops=None) -> tuple[float, int]:
    """(FLOPs, launches) of ``fn()``, each counted on a call after a first (compiled kernels built).
    ``inner_flops``: a list the first-order sample's FLOPs are added to (its tap is one opaque operator: a
    dispatch mode does not see inside)."""
    fn()
    with FlopCounterMode(display=False) as counter:
        fn()
    flops = float(counter.get_total_flops()) + (sum(inner_flops) if inner_flops else 0.0)
    if inner_flops:
        inner_flops.clear()
    return flops, count_kernel_ops(fn)


def _workload(width: int, blocks: int, tokens: int, device: str = "cpu", autocast: bool = False):
    """A Llama-shaped demo model under SNIPController (SNIPConfig() defaults, fixed schedule) and three callables
    on one batch of ``tokens`` tokens: a training step, a step that samples the first-order term, a round."""
    torch.manual_seed(0)
    model = TinyLlama(llama_like(width, blocks)).to(device)
    controller = SNIPController(SNIPConfig(overhead_budget=None))
    controller.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch_tokens = torch.randint(0, 256, (tokens // 128, 129), device=device)
    batch = (batch_tokens[:, :-1], batch_tokens[:, 1:])
    context = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def loss_of(b):
        with context:
            logits = model(b[0])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[1].reshape(-1))

    def step():
        loss_of(batch).backward()
        opt.step()
        opt.zero_grad()

    def sampled_step():
        controller.start_first_order(0)
        step()
        controller.end_batch()

    round_step = [100]

    def statistics_round():
        controller.statistics_round(model, batch, loss_of, step=round_step[0], optimizer=opt)
        round_step[0] += 1
        controller.pending.join(60)

    return controller, step, sampled_step, statistics_round


def measure(width: int, blocks: int) -> dict:
    controller, step, sampled_step, statistics_round = _workload(width, blocks, TOKENS)
    step()
    inner = []
    sampler = controller.recorder.sampler
    real_add = sampler.measure

    def counted_add(*a):
        with FlopCounterMode(display=False) as counter:
            real_add(*a)
        inner.append(float(counter.get_total_flops()))

    sampler.measure = counted_add
    step_flops, step_ops = count(step)
    sampled_flops, sampled_ops = count(sampled_step, inner)
    round_flops, round_ops = count(statistics_round)
    controller.close()
    cfg = controller.config
    elements = linear_elements(controller.layers)
    return {"width": width, "blocks": blocks, "layers": len(controller.layers), "elements": elements,
            "step_flops": step_flops, "step_ops": step_ops, "sample_flops": sampled_flops - step_flops,
            "sample_ops": sampled_ops - step_ops, "round_flops": round_flops, "round_ops": round_ops,
            "round_alpha": round_flops / (cfg.max_rows * elements),
            "sample_alpha": (sampled_flops - step_flops) / (cfg.max_rows * elements)}


def time_on_device(width: int, blocks: int, tokens: int, device: str = "cuda", repeats: int = 3) -> dict:
    """Measured, not predicted (gpu_check's ``scale`` part): seconds of a bf16-autocast training step, of a step
    that samples the first-order term, and of a statistics round, at SNIPConfig()'s defaults, on ``device``."""
    import statistics
    import time

    controller, step, sampled_step, statistics_round = _workload(width, blocks, tokens, device, autocast=True)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    times = {"step": [], "sample": [], "round": []}
    for name, fn in (("step", step), ("sample", sampled_step), ("round", statistics_round)):
        fn()  # (compiles, allocator warm-up)
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    controller.close()
    return {name: statistics.median(values) for name, values in times.items()}


def predict(fit: dict, tokens: int, peak: float) -> dict:
    cfg = SNIPConfig()
    s = LLAMA3_8B
    elements = s["blocks"] * (2 * s["dim"] * s["dim"] + 2 * s["dim"] * s["kv_dim"] + 3 * s["dim"] * s["hidden"])
    layers = s["blocks"] * 7
    step = 6 * tokens * elements / (MFU * peak)
    step_fp4 = step / FP4_SPEEDUP
    round_seconds = fit["round_alpha"] * cfg.max_rows * elements / (MFU * peak) + fit["round_ops_per_layer"] * layers * LAUNCH_SECONDS
    sample = fit["sample_alpha"] * cfg.max_rows * elements / (MFU * peak) + fit["sample_ops_per_layer"] * layers * LAUNCH_SECONDS
    out = {}
    for name, t in (("bf16", step), ("fp4", step_fp4)):
        fixed = (round_seconds + cfg.first_order_steps * sample) / (cfg.interval * t)
        num = min(cfg.first_order_steps, int(round_seconds / sample))
        spacing = max(cfg.interval, (round_seconds + num * sample) / (0.02 * t))
        out[name] = {"step": t, "round_steps": round_seconds / t, "sample_steps": sample / t, "fixed": fixed,
                     "spacing": spacing, "num": num}
    out["round"], out["sample"] = round_seconds, sample
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--time-on", default=None, help="a device: time a step, a sampled step and a round there instead")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    if args.time_on:
        for width in args.widths:
            for blocks in args.blocks:
                t = time_on_device(width, blocks, args.tokens, args.time_on)
                print(f"measured on {args.time_on} width {width} x {blocks} blocks, {args.tokens} tokens: step "
                      f"{t['step'] * 1e3:.1f} ms, sampled step {t['sample'] * 1e3:.1f} ms (+{t['sample'] / t['step'] - 1:.1%}), "
                      f"round {t['round'] * 1e3:.0f} ms = {t['round'] / t['step']:.2f} steps", flush=True)
        return
    torch.set_num_threads(1)
    rows = [measure(w, b) for w in args.widths for b in args.blocks]
    print(f"# overhead_at_scale — {datetime.date.today()}; python benchmarks/overhead_at_scale.py "
          f"--widths {' '.join(map(str, args.widths))} --blocks {' '.join(map(str, args.blocks))}")
    print(f"# counted on {platform.machine()}, torch {torch.__version__}, SNIPConfig() defaults, steps of {TOKENS} tokens")
    print("| width | blocks | linears | step GFLOP | step launches | sample +GFLOP | sample +launches | round GFLOP | "
          "round launches | round FLOPs/(row x elem) | sample FLOPs/(row x elem) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['width']} | {r['blocks']} | {r['layers']} | {r['step_flops'] / 1e9:.2f} | {r['step_ops']} | "
              f"{r['sample_flops'] / 1e9:.2f} | {r['sample_ops']} | {r['round_flops'] / 1e9:.2f} | {r['round_ops']} | "
              f"{r['round_alpha']:.1f} | {r['sample_alpha']:.1f} |")
    widest = [r for r in rows if r["width"] == max(args.widths)]
    shallow, deep = min(widest, key=lambda r: r["blocks"]), max(widest, key=lambda r: r["blocks"])
    per_layer = lambda key: (deep[key] - shallow[key]) / (deep["layers"] - shallow["layers"])  # noqa: E731
    fit = {"round_alpha": deep["round_alpha"], "sample_alpha": deep["sample_alpha"],
           "round_ops_per_layer": per_layer("round_ops"), "sample_ops_per_layer": per_layer("sample_ops")}
    print(f"\nfit (width {deep['width']}): round {fit['round_alpha']:.1f} FLOPs per row x weight element, "
          f"{fit['round_ops_per_layer']:.0f} launches per linear layer; sample {fit['sample_alpha']:.1f} FLOPs per row x "
          f"element, {fit['sample_ops_per_layer']:.0f} launches per layer")
    # Calibration: the H200's measured round at width 4096 x 4 blocks (29 layers, 28 switchable).
    h200_elements = 4 * (2 * 4096 * 4096 + 2 * 4096 * 2048 + 3 * 4096 * 11264)
    predicted = fit["round_alpha"] * 1024 * h200_elements / (MFU * 989e12) + fit["round_ops_per_layer"] * 28 * LAUNCH_SECONDS
    print(f"calibration, H200 width 4096 x 4 blocks: predicted round {predicted * 1e3:.0f} ms against 523 ms measured "
          f"(2026-11-30; 26,331 kernels measured, {fit['round_ops_per_layer'] * 28:.0f} launches predicted)")
    print("\nLlama-3-8B layer sizes (32 blocks, 224 linears), a step's linear FLOPs at 40% MFU, 5 us per launch:")
    print("| GPU | tokens/GPU | step (bf16) | round | round in steps (bf16 / 75% FP4) | sample in steps | "
          "fixed schedule overhead (bf16 / FP4) | 2% budget: round every (bf16 / FP4) steps |")
    print("|---|---|---|---|---|---|---|---|")
    for gpu, peak in PEAKS.items():
        for tokens in (8192, 16384):
            p = predict(fit, tokens, peak)
            print(f"| {gpu} | {tokens} | {p['bf16']['step'] * 1e3:.0f} ms | {p['round'] * 1e3:.0f} ms | "
                  f"{p['bf16']['round_steps']:.2f} / {p['fp4']['round_steps']:.2f} | {p['bf16']['sample_steps']:.3f} | "
                  f"{p['bf16']['fixed']:.2%} / {p['fp4']['fixed']:.2%} | {p['bf16']['spacing']:.0f} / {p['fp4']['spacing']:.0f} |")


if __name__ == "__main__":
    main()
