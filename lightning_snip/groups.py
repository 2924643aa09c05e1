"""Layers of one shape, stacked: the statistics round's per-layer quantizers and GEMMs as one batched
call per group of layers instead of one call per layer.

A round on a GPU is bound by kernel launches (25,232 kernels in a 540 ms round of 29 layers, 80% of it
the host launching them: benchmarks/results/gpu_check_2026-11-30_nvidia_h200.md), and a model repeats a
few layer shapes block after block. torch has the batched GEMM (torch.bmm, gemm.bmm_fp32), and every
format but NVFP4 and tensorwise FP8 scales its operands row by row, so a stack of layers quantizes as one
tall matrix with the same numbers; nothing groups a model's layers by shape: written here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import torch

from lightning_snip.formats import Format, Fp8Scaling, QuantRecipe, Rounding
from lightning_snip.quantize import fake_quantize

# The most layers stacked into one batched call: launches fall by up to this factor.
MAX_GROUP_LAYERS = 16
# The most bytes a group's stacked round tensors hold at once (working_bytes, summed over its layers); a layer
# over it is a group of its own. The layer-by-layer round holds one layer's; stacked, a group holds up to
# this much more: a bound that does not grow with the model (16 layers of width 4096 would hold 3.6-17 GiB).
MAX_GROUP_BYTES = 1 << 30


def working_bytes(s, formats: int) -> int:
    """An upper estimate of the bytes of one layer's part of its group's stacked round tensors at their
    peak (the wgrad errors): fp32 copies of X and G, three each (stacked, transposed for wgrad, quantized),
    and of W, ``formats`` + 3 (stacked, quantized, wgrad's reference, one error per format). ``s``: a
    LayerStats."""
    return 4 * (3 * (s.x.numel() + s.g.numel()) + (formats + 3) * s.weight.numel())


def default_group_layers(device: torch.device | str) -> int:
    """The round's layers per group on ``device`` (layer_groups' ``max_layers=None``):
    MAX_GROUP_LAYERS on an accelerator, where a round is bound by launches; 1 on a CPU, which launches
    nothing and is bound by arithmetic and its caches: stacked, each layer's operands are copied once more
    and the round's element-wise passes run over tensors 16x larger than its cache (measured on 2 cores:
    the grouped round 0.95-1.11x the layer-by-layer one, benchmarks/results/stats_cost_2026-12-03.md)."""
    return 1 if torch.device(device).type == "cpu" else MAX_GROUP_LAYERS


def layer_groups(stats, fqns: Iterable[str], precision, *, max_layers: int | None = MAX_GROUP_LAYERS,
                 extra_key: Callable[[str], Hashable] | None = None, layer_bytes: Callable[[str], int] | None = None,
                 max_bytes: int = MAX_GROUP_BYTES) -> list[list[str]]:
    """``fqns`` in groups of at most ``max_layers`` layers whose round operands (X, G, W: shapes, dtypes,
    device) agree and whose rows split into the same samples, so that they stack; ``extra_key``: fqn ->
    a further key to agree on (the formats a layer is measured in); ``layer_bytes``: fqn -> its part of a
    group's memory (working_bytes), the group's sum at most ``max_bytes`` (a layer over it alone). Groups
    (a shape's later ones too) come in the order of their first member, members in ``fqns``'s order. With
    ``max_layers`` 1, and under FSDP2 (each weight is all-gathered alone, in the same order on every rank),
    each layer is a group of its own, in ``fqns``'s order. ``max_layers`` None: default_group_layers of the
    statistics' device."""
    if max_layers is None:
        max_layers = default_group_layers(next((s.x.device for s in stats.layers.values()), "cpu"))
    if max_layers < 1:
        raise ValueError(f"max_layers: invalid value {max_layers!r}; allowed: an integer >= 1")
    if max_layers == 1 or stats.sharded:
        return [[fqn] for fqn in fqns]
    # Each group enters the output when it opens, so groups (a shape's later ones too) come in the order of
    # their first member: the layers between a group's first and last member are drawn for (stochastic
    # rounding, in layer order) before it runs, so a group waits for few others.
    out: list[list[str]] = []
    open_groups: dict[Hashable, tuple[list[str], list[int]]] = {}  # key -> (its last group, [that group's bytes])
    for fqn in fqns:
        s = stats.layers[fqn]
        dtype = s.operand_dtype(precision)
        key = (tuple(s.x.shape), tuple(s.g.shape), tuple(s.weight.shape), dtype, s.x.device, s.num_samples,
               s.leading_sample_dim, None if extra_key is None else extra_key(fqn))
        size = 0 if layer_bytes is None else layer_bytes(fqn)
        group, held = open_groups.get(key, (None, [0]))
        if group is None or len(group) == max_layers or held[0] + size > max_bytes:
            group, held = open_groups[key] = ([], [0])
            out.append(group)
        group.append(fqn)
        held[0] += size
    return out


def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, without the copy for a single tensor (a view with a leading dimension of 1)."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def row_scaled(fmt: Format, recipe: QuantRecipe) -> bool:
    """Whether ``fmt``'s scales depend on one row of an operand only (FP8 rowwise, MXFP8, MXFP4), so that
    rows of stacked layers quantize as they do layer by layer; NVFP4's per-tensor scale and tensorwise FP8
    see the whole operand."""
    if fmt is Format.FP8:
        return recipe.fp8_scaling is Fp8Scaling.ROWWISE
    return fmt in (Format.MXFP8, Format.MXFP4)


def quantize_stack(t: torch.Tensor, fmt: Format, *, recipe: QuantRecipe, is_grad: bool = False,
                   rounding: Rounding = Rounding.NEAREST, bits: list[torch.Tensor] | None = None,
                   is_weight: bool = False) -> torch.Tensor:
    """fake_quantize of each slice t[i] (contraction axis last), for a stack (L, rows, k): one call on the
    stack as a (L * rows, k) matrix where the format's scales are row by row (row_scaled), else slice by
    slice. Stochastic rounding takes each slice's random bits, drawn by the caller (``bits``: grid.random_bits
    of quantize.padded_numel per slice, in the order it would have drawn them), and the fused quantizers.
    ``is_weight``: the slices are layers' weights (NVFP4's 16x16 tile scales where the recipe says)."""
    by_rows = row_scaled(fmt, recipe)
    if is_weight and recipe.weight_scales_2d(fmt):
        return stack([fake_quantize(part, fmt, axis=1, recipe=recipe, scales_2d=True) for part in t])
    if (rounding is Rounding.STOCHASTIC) != (bits is not None):
        raise ValueError("bits: each slice's random bits are needed for (and only for) stochastic rounding, got "
                         f"rounding={rounding.value} and {'no ' if bits is None else ''}bits")
    if bits is not None and len(bits) != len(t):
        raise ValueError(f"bits: expected the random bits of {len(t)} slices, got {len(bits)}")
    if by_rows:
        length, rows, cols = t.shape
        return fake_quantize(t.reshape(length * rows, cols), fmt, axis=1, recipe=recipe, is_grad=is_grad,
                             rounding=rounding, bits=None if bits is None else stack(bits)
                             ).reshape(length, rows, cols)
    return stack([fake_quantize(part, fmt, axis=1, recipe=recipe, is_grad=is_grad, rounding=rounding,
                                bits=None if bits is None else bits[i]) for i, part in enumerate(t)])
