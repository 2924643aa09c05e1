"""LD's second-order term 1/2 dY^T H dY per (layer, format), probed along the quantization errors themselves.

The error probe (docs/method.md section 4) injects every layer's error dY(l, p) at once, with a random sign per
layer and, where the model's samples are independent (checked once per model), per sample of its rows: the
cross-layer terms vanish in expectation and each one is a sum of independent per-sample terms. The 8-bit formats
(fp8, mxfp8) take no pass of their own: each layer's curvature along its FP4 errors, times the 8-bit error's
energy (quantization errors of the same GEMM, 4-5 bits finer). Studies of the probes that lost (isotropic noise,
one sign per layer, the empirical Fisher, the 8-bit formats probed) are in benchmarks/README.md.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Mapping

import torch

from lightning_snip.formats import Format
from lightning_snip.round_inputs import RoundInputs, a_sharded_weight, read_scalars
from lightning_snip.sharding import all_reduce_sum
from lightning_snip.stats import LayerStats, Statistics

logger = logging.getLogger(__name__)


def _sign_units(layer: LayerStats) -> int:
    """How many independent signs the error probe gives a layer's rows: one per sample where its input
    had a leading sample dimension over token dimensions (rows of a sample contiguous), else one."""
    n, rows = layer.num_samples, layer.num_rows
    return n if layer.leading_sample_dim and 2 <= n <= rows and rows % n == 0 else 1


_independent_samples: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _samples_independent(stats: Statistics, output_errors, keys, units) -> bool:
    """Whether the leading dimension of the per-sample layers' inputs indexes independent samples: one
    pass injecting every such layer's error into the rows of its first sample only; where the samples
    are independent (a batch-first causal LM: the forward pass never mixes samples, the loss is a sum
    over them) no other sample's output gradient changes, bit for bit. A sequence-first layout, windows
    or attention heads folded into the leading dimension, or a loss that couples samples (pairs of a
    preference loss, in-batch negatives) change them, and a sign per sample would drop real terms: the
    probe then keeps one sign per layer. Measured once per model (the first round; one extra pass) and
    remembered; under FSDP2 the ranks agree (one all-reduce)."""
    per_sample = [(key, n) for key, n in zip(keys, units) if n > 1]
    if not per_sample:
        return True
    anchor = next(iter(stats.layer_modules.values()), None)
    if anchor is not None and anchor in _independent_samples:
        return _independent_samples[anchor]
    noise, first_rows = {}, {}
    for (fqn, f), n in per_sample:
        dy = output_errors[fqn, f]
        first_rows[fqn] = dy.shape[0] // n
        part = torch.zeros_like(dy)
        part[: first_rows[fqn]] = dy[: first_rows[fqn]]
        noise[fqn] = part
    noisy = stats.output_grads_with_noise(noise)
    inside, outside = [], []
    for (fqn, _), _ in per_sample:
        delta = noisy[fqn].float() - stats.layers[fqn].g.float()
        inside.append(delta[: first_rows[fqn]].pow(2).sum().double())
        outside.append(delta[first_rows[fqn]:].pow(2).sum().double())
    del noise, noisy
    inside_v, outside_v = read_scalars(inside), read_scalars(outside)
    scale = max(inside_v)
    # A change outside the first sample above 1e-4 of the largest inside it (in norm): roundoff is far
    # below, interacting samples measured 0.1-0.8 of it.
    leaking = [fqn for ((fqn, _), _), out in zip(per_sample, outside_v) if out > 1e-8 * scale]
    flag = torch.tensor([float(bool(leaking)), float(scale > 0)], dtype=torch.float64)
    if stats.sharded:
        like = a_sharded_weight(stats)
        flag = all_reduce_sum(flag.to(like.device), like).cpu()
    if flag[1] == 0:  # no layer's error changed anything: nothing measured, not remembered
        return True
    independent = bool(flag[0] == 0)
    if not independent:
        logger.warning(
            "error probe: the samples of a round interact: injecting layer errors into the first sample's rows "
            "changed the output gradients of other samples (at %s%s: a sequence-first layout, windows or heads "
            "folded into the batch dimension, or a loss that couples samples); the probe keeps one sign per layer "
            "for this model", ", ".join(leaking[:4]) or "another rank's layers",
            ", ..." if len(leaking) > 4 else "")
    if anchor is not None:
        _independent_samples[anchor] = independent
    return independent


def error_probe_second_order(stats: Statistics, output_errors, formats, draws: int, generator, *,
                              per_sample: bool = True, scale: float = 1.0, antithetic: bool = False) -> dict:
    """1/2 dY^T H dY per (layer, format): inject eps h dY(l, p) into every layer for one format at a
    time, eps = +-1 independent per layer and (``per_sample``, where _samples_independent) per sample
    of its rows, h = ``scale``, read 1/2 sum_rows eps <h dY(l, p), G'_l - G_l> / h^2, average over draws.
    ``antithetic``: G'_l - G_l is the central difference (G'(+eps) - G'(-eps)) / 2 of the draw and its negation
    (two passes per draw), which cancels the gradient change's even orders in the injected errors: the noise
    that every other layer's error adds to a layer's term. A scale below 1 keeps the injected errors in the
    range where the quadratic term is what the pass measures: at 1, with every layer's FP4 error in at once,
    SmolLM2's probe summed to 2.4x the loss change its layers make one at a time, on the same batch
    (benchmarks/results/ld_variance_2026-12-06.md)."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a finite number > 0, got {scale!r}")
    totals = {key: 0.0 for key in output_errors}
    if draws <= 0:
        return totals
    terms = {key: [] for key in output_errors}  # device scalars, read with one transfer at the end
    for fmt in formats:
        keys = [key for key in output_errors if key[1] is fmt]
        if not keys:
            continue
        units = [_sign_units(stats.layers[fqn]) if per_sample else 1 for fqn, _ in keys]
        if not _samples_independent(stats, output_errors, keys, units):
            units = [1] * len(keys)
        device = output_errors[keys[0]].device
        for _ in range(draws):
            # every sign of the draw in one call, moved to the errors' device once (one sync per draw)
            drawn = torch.rand(sum(units), generator=generator,
                               device=generator.device if generator is not None else device) < 0.5
            drawn = (drawn.float() * 2 - 1).to(device)
            noise = {}
            for (fqn, f), signs, n in zip(keys, drawn.split(units), units):
                dy = output_errors[fqn, f]
                noise[fqn] = (signs * scale).repeat_interleave(dy.shape[0] // n).unsqueeze(1) * dy
            noisy = stats.output_grads_with_noise(noise)
            opposite = stats.output_grads_with_noise({fqn: -v for fqn, v in noise.items()}) if antithetic else None
            for fqn, f in keys:
                delta_g = (noisy[fqn].float() - (opposite[fqn].float() if antithetic else stats.layers[fqn].g.float())
                           ) / (2.0 if antithetic else 1.0)
                # (eps h dY) . (G' - G) = eps h <dY, G' - G> row by row
                terms[fqn, f].append((noise[fqn] * delta_g).sum().double())
            del noise, noisy, opposite
    flat = [(key, t) for key, ts in terms.items() for t in ts]
    for (key, _), value in zip(flat, read_scalars([t for _, t in flat])):
        totals[key] += 0.5 * value / draws / scale ** 2
    return totals


def transferred_second_order(inputs: RoundInputs, output_errors: dict, fmt: Format, parts: Mapping, ordered, draws: int,
                             generator, *, scale: float = 1.0, antithetic: bool = False) -> dict:
    """1/2 dY^T H dY of an 8-bit format as q_l ||dY||^2, q_l the layer's curvature along its FP4 errors this
    round (sum of their probed second-order terms / sum of their ||dY||^2: ``parts``, (fqn, format) ->
    loss_divergence.ForwardParts of the formats measured so far, in the order ``ordered``). Layers with no FP4
    format probed this round (only 8-bit formats allowed, or their FP4 errors non-finite) get the error probe
    for ``fmt``, their errors alone."""
    stats, quotient = inputs.stats, {}
    for fqn, _ in output_errors:
        # (a non-finite probed term is no curvature to transfer: the 8-bit format is probed instead)
        probed = [parts[fqn, f] for f in ordered if f.is_fp4 and (fqn, f) in parts
                  and parts[fqn, f].abs_error_forward > 0 and math.isfinite(parts[fqn, f].second_order)]
        if probed:  # parts hold second / |loss| (loss_divergence.ForwardParts): back to the loss's units
            quotient[fqn] = (sum(p.second_order * inputs.loss_norm for p in probed)
                             / sum(p.abs_error_forward for p in probed))
    keys = [key for key in output_errors if key[0] in quotient]
    energies = read_scalars([output_errors[key].pow(2).sum().double() for key in keys])
    out = {key: quotient[key[0]] * e for key, e in zip(keys, energies)}
    rest = {key: dy for key, dy in output_errors.items() if key[0] not in quotient}
    if rest:
        out.update(error_probe_second_order(stats, rest, [fmt], draws, generator, scale=scale, antithetic=antithetic))
    return out
