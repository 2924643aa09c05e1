"""How much each piece of the published NVFP4 training recipe reduces each GEMM's error, on SmolLM2's real operands
(issue 63: the design study before the recipe enters the library).

One batch of SmolLM2-135M-Instruct (pretrained, 4 x 128 tokens of the bundled corpus) runs forward and backward in
high precision; every linear layer's input X, output gradient G and weight W are kept. For each layer and each
variant, the relative error ||approx - exact|| / ||exact|| of its three GEMMs: forward Y = X W^T, dgrad dX = G W,
wgrad dW = G^T X. Variants (registered before the run):

- ``mxfp4``: the library's MXFP4 (block 32 along each GEMM's contraction axis, power-of-two scales), stochastic
  rounding on gradient operands, round-to-nearest-even elsewhere (lightning_snip.quantize.fake_quantize).
- ``nvfp4``: the library's NVFP4 (block 16, E4M3 block scales under an FP32 per-tensor scale), the same roundings.
- ``nvfp4+2d``: NVFP4 with 16x16 block scales for the weight (one quantized weight for forward and dgrad).
- ``nvfp4+rht``: NVFP4 with a 16x16 random Hadamard transform on both wgrad operands along the token axis.
- ``nvfp4_recipe``: both (NVIDIA's recipe: 2D weight scales, RHT on wgrad, SR on gradients).
- ``mxfp4+rht``: MXFP4 with the same RHT on wgrad (whether the transform also serves block-32 power-of-two scales).

Since 2026-12-06 (later) every variant runs through the library's GEMM, ``quantized_matmul``, with the recipe's
knobs (QuantRecipe.wgrad_hadamard, nvfp4_weight_scales_2d) and each layer's own RHT sign vector
(hadamard.layer_signs of its name, as convert_linears gives it); before, the study applied one seeded sign vector
per batch to every layer and its own 2D quantizer. The RHT matrix is torchao's (``get_rht_matrix``); the hand-written
tile quantizer below (after torchao's Triton ``_nvfp4_2d_quantize``, compute capability 10.x only) is kept as an
independent check of the library's: with 1x16 tiles it equals the library's NVFP4, with 16x16 tiles the library's
2D weight scales, bit for bit, or the study stops.

    python benchmarks/nvfp4_recipe_error.py [--seeds 3] [--out results/nvfp4_recipe_error_<date>.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from pathlib import Path

import torch

from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.gemm import quantized_matmul
from lightning_snip.grid import E2M1, round_to_grid
from lightning_snip.hadamard import hadamard_rows, layer_signs, rht_matrix
from lightning_snip.quantize import fake_quantize, nvfp4_per_tensor_scale

VARIANTS = ("mxfp4", "nvfp4", "nvfp4+2d", "nvfp4+rht", "nvfp4_recipe", "mxfp4+rht")
GEMMS = ("forward", "dgrad", "wgrad")
TILE = 16


def nvfp4_tiles(w: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """NVFP4 fake quantization of ``w`` (rows x cols, contraction along cols) with one E4M3 scale per
    ``tile_rows`` x 16 tile under torchao's FP32 per-tensor scale; round-to-nearest-even. tile_rows 1: the 1D
    layout (checked equal to the library's); 16: the recipe's 2D weight scales (the tile's amax does not change
    under transposition, so the transpose quantizes to the transpose)."""
    rows, cols = w.shape
    x = w.float()
    g = nvfp4_per_tensor_scale(x)
    tiles = x.reshape(rows // tile_rows, tile_rows, cols // TILE, TILE)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    s8 = (amax / 6.0 / g).clamp(torch.finfo(torch.float8_e4m3fn).tiny, 448.0).to(torch.float8_e4m3fn).float()
    scaled = (tiles * ((1.0 / g) / s8)).clamp(-6.0, 6.0)
    return (round_to_grid(scaled, E2M1) * (s8 * g)).reshape(rows, cols)


def variant_recipe(variant: str) -> tuple[Format, QuantRecipe]:
    """The format and the library's recipe of a variant (stochastic rounding on gradients in every one)."""
    fmt = Format.MXFP4 if variant.startswith("mxfp4") else Format.NVFP4
    two_d, with_rht = variant in ("nvfp4+2d", "nvfp4_recipe"), variant in ("nvfp4+rht", "nvfp4_recipe", "mxfp4+rht")
    return fmt, QuantRecipe(wgrad_hadamard=(fmt,) if with_rht else (), nvfp4_weight_scales_2d=two_d)


def gemm_errors(x, g, w, variant: str, signs: tuple[int, ...], generator: torch.Generator) -> dict[str, float]:
    """Each GEMM's relative error in ``variant``, as SNIPLinear multiplies (gemm.quantized_matmul)."""
    fmt, recipe = variant_recipe(variant)
    x, g, w = x.float(), g.float(), w.float()
    exact = {"forward": x @ w.t(), "dgrad": g @ w, "wgrad": g.t() @ x}
    approx = {"forward": quantized_matmul(x, w, fmt, recipe=recipe, b_is_weight=True, generator=generator),
              "dgrad": quantized_matmul(g, w.t(), fmt, recipe=recipe, a_is_grad=True, b_is_weight=True,
                                        generator=generator),
              "wgrad": quantized_matmul(g.t(), x.t(), fmt, recipe=recipe, a_is_grad=True, hadamard=signs,
                                        generator=generator)}
    return {k: float((approx[k] - exact[k]).norm() / exact[k].norm().clamp_min(1e-30)) for k in GEMMS}


def capture_operands(seed: int):
    """(fqn, X, G, W) of every nn.Linear of SmolLM2 on one batch (4 x 128 tokens, the batch drawn by ``seed``)."""
    from lightning_snip.demo.lightning import ByteTextDataModule
    from lightning_snip.hf import load_smollm2

    torch.manual_seed(seed)
    model, tokenizer = load_smollm2(progress=False)
    data = ByteTextDataModule(seq_len=128, batch_size=4, tokenizer=tokenizer, seed=seed)
    data.setup("fit")
    inputs, targets = next(iter(data.train_dataloader()))
    kept, handles = {}, []
    for fqn, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def forward_hook(mod, args, out, fqn=fqn):
                kept[fqn] = [args[0].detach().reshape(-1, args[0].shape[-1])]

            def backward_hook(mod, grad_input, grad_output, fqn=fqn):
                kept[fqn].append(grad_output[0].detach().reshape(-1, grad_output[0].shape[-1]))

            handles += [module.register_forward_hook(forward_hook), module.register_full_backward_hook(backward_hook)]
    logits = model(inputs).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    for handle in handles:
        handle.remove()
    modules = dict(model.named_modules())
    return [(fqn, x, g, modules[fqn].weight.detach()) for fqn, (x, g) in kept.items()]


def check_2d_quantizer() -> None:
    """The hand-written tile quantizer with 1x16 tiles equals the library's NVFP4 (torchao's to_nvfp4), with
    16x16 tiles the library's 2D weight scales, and commutes with the transpose; else the study stops."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.equal(nvfp4_tiles(w, 1), fake_quantize(w, Format.NVFP4, axis=1)), "1x16 tiles != the library's NVFP4"
    assert torch.equal(nvfp4_tiles(w, TILE), fake_quantize(w, Format.NVFP4, axis=1, scales_2d=True)), \
        "16x16 tiles != the library's 2D weight scales"
    assert torch.equal(nvfp4_tiles(w, TILE).t(), nvfp4_tiles(w.t().contiguous(), TILE)), "2D scales not transposable"


def check_rht() -> None:
    """Before quantization the library's transform cancels in the wgrad product; else the study stops."""
    generator = torch.Generator().manual_seed(1)
    g, x = torch.randn(64, 24, generator=generator), torch.randn(64, 40, generator=generator)
    matrix = rht_matrix(layer_signs("check"))
    assert torch.allclose(hadamard_rows(g.t(), matrix) @ hadamard_rows(x.t(), matrix).t(), g.t() @ x, atol=1e-4), \
        "RHT does not cancel"
    assert not torch.allclose(hadamard_rows(g.t(), matrix), g.t()), "RHT is the identity"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="batches (each its own seed: data, RHT signs, SR draws)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    check_2d_quantizer()
    check_rht()
    per_seed = []  # seed -> variant -> gemm -> [per-layer errors]
    for seed in range(args.seeds):
        operands = capture_operands(seed)
        errors = {v: {k: [] for k in GEMMS} for v in VARIANTS}
        for variant in VARIANTS:
            generator = torch.Generator().manual_seed(1000 + seed)  # the same SR draws for every variant
            for fqn, x, g, w in operands:
                for k, e in gemm_errors(x, g, w, variant, layer_signs(fqn), generator).items():
                    errors[variant][k].append(e)
        per_seed.append(errors)
        print(f"seed {seed}: {len(operands)} layers", flush=True)
    lines = table(per_seed, [fqn for fqn, *_ in operands]) + per_layer_lines(per_seed, [fqn for fqn, *_ in operands])
    print("\n".join(lines))
    if args.out:
        date = datetime.date.today().isoformat()
        head = [f"# The NVFP4 recipe's pieces against each GEMM's error on SmolLM2 — {date}", "",
                f"Command: `python benchmarks/nvfp4_recipe_error.py --seeds {args.seeds} --out {args.out}`; machine "
                f"{platform.machine()}, torch {torch.__version__}; emulated (fake quantization, fp32 GEMMs).", ""]
        args.out.write_text("\n".join(head + lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"layers": [fqn for fqn, *_ in operands], "seeds": per_seed}))


def table(per_seed: list[dict], fqns: list[str]) -> list[str]:
    """Per variant and GEMM: the median over layers of the relative error, mean ± std over seeds, and the ratio to
    plain NVFP4's (paired by seed)."""
    lines = [f"Median over SmolLM2's {len(fqns)} linear layers of each GEMM's relative error; mean ± std over "
             f"{len(per_seed)} batches (seeds); in brackets, the ratio to plain `nvfp4` (paired by seed).", "",
             "| variant | forward | dgrad | wgrad |", "|---|---|---|---|"]
    for variant in VARIANTS:
        cells = []
        for k in GEMMS:
            medians = [statistics.median(s[variant][k]) for s in per_seed]
            ratios = [m / statistics.median(s["nvfp4"][k]) for m, s in zip(medians, per_seed)]
            spread = statistics.stdev(medians) if len(medians) > 1 else float("nan")
            cells.append(f"{statistics.fmean(medians):.4f} ± {spread:.4f} [{statistics.fmean(ratios):.3f}]")
        lines.append(f"| `{variant}` | " + " | ".join(cells) + " |")
    worst = per_seed[0]["nvfp4"]["wgrad"].index(max(per_seed[0]["nvfp4"]["wgrad"]))
    lines += ["", "The worst layer's relative error (the largest over the layers), mean over seeds:", "",
              f"| variant | forward | dgrad | wgrad | wgrad of `{fqns[worst]}` (plain nvfp4's worst, seed 0) |",
              "|---|---|---|---|---|"]
    for variant in VARIANTS:
        cells = [f"{statistics.fmean(max(s[variant][k]) for s in per_seed):.4f}" for k in GEMMS]
        cells.append(f"{statistics.fmean(s[variant]['wgrad'][worst] for s in per_seed):.4f}")
        lines.append(f"| `{variant}` | " + " | ".join(cells) + " |")
    return lines


def per_layer_lines(per_seed: list[dict], fqns: list[str]) -> list[str]:
    """Per layer, wgrad's error with the transform over the same format's without it (mean over seeds): how many
    layers it lowers, the median ratio, the worst layers."""
    lines = ["", f"Per layer (wgrad, the ratio to the same format without the transform, mean over the {len(per_seed)} "
             "seeds):", "", "| | layers where RHT lowers wgrad's error | median ratio | worst layers (ratio) |",
             "|---|---|---|---|"]
    for with_rht, plain, label in (("nvfp4+rht", "nvfp4", "NVFP4 + RHT / NVFP4"), ("mxfp4+rht", "mxfp4", "MXFP4 + RHT / MXFP4")):
        ratios = [statistics.fmean(s[with_rht]["wgrad"][i] / s[plain]["wgrad"][i] for s in per_seed)
                  for i in range(len(fqns))]
        worst = sorted(range(len(fqns)), key=lambda i: -ratios[i])[:4]
        names = ", ".join(f"{fqns[i].removeprefix('model.')} {ratios[i]:.2f}" for i in worst)
        lines.append(f"| {label} | {sum(r < 1 for r in ratios)} of {len(fqns)} | {statistics.median(ratios):.3f} | "
                     f"{names} |")
    return lines


if __name__ == "__main__":
    main()
