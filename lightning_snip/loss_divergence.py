"""LD, the forward loss divergence per (layer, format): the relative loss increase a layer's quantized forward
GEMM causes (docs/method.md section 4),

    dY = Q_p(X) Q_p(W)^T - X W^T,    LD = ( <G, dY> + 1/2 dY^T H dY ) / |loss|

The first-order term <G, dY> of one batch is mostly that batch's noise: it is averaged over the statistics
batch and the training batches sampled before the round (lightning_snip.first_order); with none sampled, the
batch's own term is shrunk by its sampling error (positive-part James-Stein). The second-order term comes
from the error probe (lightning_snip.curvature). LD is clamped at 0 for the planner (a negative estimate never
makes a format look better than bf16, evidence.planning_value); rounds and ranks are averaged before it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lightning_snip.curvature import error_probe_second_order, transferred_second_order
from lightning_snip.formats import Format
from lightning_snip.gemm import Kernel, bmm_fp32, kernel_for, quantized_matmul
from lightning_snip.groups import quantize_stack, stack
from lightning_snip.round_inputs import RoundInputs, a_sharded_weight, read_scalars, round_groups, stacked_operands
from lightning_snip.sharding import all_reduce_sum


@dataclass(frozen=True)
class ForwardParts:
    """LD of one (layer, format) and its parts, relative to |loss| (docs/method.md section 4). LD is not clamped
    here: rounds and ranks are averaged first, and the planner clamps (evidence.planning_value)."""

    loss_divergence: float  # +inf: no estimate (a non-finite part)
    first_order: float  # this batch's <G, dY>
    first_stderr: float  # its sampling error over the samples
    # <G, dY> averaged over this batch and the sampled training batches before the round, its standard error
    # (None: no batch sampled before the round)
    first_accumulated: float | None
    first_accumulated_stderr: float | None
    second_order: float  # 1/2 dY^T H dY
    rel_error_forward: float  # ||dY|| / ||Y||
    abs_error_forward: float  # ||dY||^2


@dataclass
class ForwardEstimate:
    """LD's parts of a round's measured (layer, format) pairs, and the pairs it could not measure: ``dropped``,
    a non-finite output error (left out of the round: WD is not measured for it either), and ``invalid``, every
    pair whose LD is no estimate (the dropped ones and a non-finite LD), in the order they were found."""

    parts: dict[tuple[str, Format], ForwardParts] = field(default_factory=dict)
    dropped: set[tuple[str, Format]] = field(default_factory=set)
    invalid: list[tuple[str, Format]] = field(default_factory=list)


def combine_loss_divergence(*, first: float, first_stderr: float, first_accumulated: float | None,
                            second: float) -> float:
    """LD from its parts (relative to the loss), unclamped: the first-order term averaged over the sampled
    batches (``first_accumulated``) or, with none sampled, this batch's ``first`` shrunk by its standard error;
    plus the second-order term."""
    if first_accumulated is not None:
        return first_accumulated + second
    if first == 0.0 or not math.isfinite(first_stderr):
        return second
    return first * max(0.0, 1.0 - (first_stderr / first) ** 2) + second


def forward_divergence(inputs: RoundInputs, valid: Mapping[str, Sequence[Format]], noise_draws: int, *,
                       probe_scale: float = 1.0, antithetic: bool = False) -> ForwardEstimate:
    """LD's parts of every valid (layer, format); ``probe_scale`` and ``antithetic``: the error probe's
    (curvature.error_probe_second_order)."""
    stats, generator = inputs.stats, inputs.generator
    estimate = ForwardEstimate()
    # Layers of one shape (and the same formats) stacked: each quantizer and GEMM below runs once per
    # group, not once per layer (lightning_snip.groups; the same numbers).
    groups = round_groups(inputs, stats.layers, valid)
    # Y = X W^T of every layer, computed once: the reference of every format's dY. One format at a time
    # below, so the round holds one format's dY of every layer (the error probe injects them all at once).
    references, rms = {}, {}
    for group in groups:
        activations, weights = stacked_operands(inputs, group, "x"), stacked_operands(inputs, group, "w")
        outputs = bmm_fp32(activations, weights)
        del activations, weights
        if valid.get(group[0]):  # (every layer's output RMS; the references of measured layers only)
            references[tuple(group)] = outputs
        rms.update(zip(group, outputs.pow(2).mean(dim=(1, 2)).sqrt()))
        del outputs
    output_rms = dict(zip(stats.layers, read_scalars([rms[fqn] for fqn in stats.layers])))
    del rms
    # The FP4 formats first, so each layer's curvature along its FP4 errors is known when its 8-bit formats
    # come (transferred_second_order; stable sort: the configured order within each group).
    ordered = sorted(inputs.formats, key=lambda fmt: not fmt.is_fp4)
    for fmt in ordered:
        errors, scalars, finite = {}, {}, {}
        for group in groups:
            if fmt in valid.get(group[0], ()):  # (a group's layers share their formats)
                _output_errors(inputs, group, fmt, references[tuple(group)], errors, scalars, finite)
        keys = [(fqn, fmt) for fqn in stats.layers if (fqn, fmt) in errors]  # layer order: the probe's draws follow it
        output_errors = {key: errors[key] for key in keys}
        del errors
        _drop_non_finite(inputs, output_errors, [finite[key] for key in keys], estimate)
        if fmt.is_fp4:
            second_order = error_probe_second_order(stats, output_errors, [fmt], noise_draws, generator,
                                                    scale=probe_scale, antithetic=antithetic)
        else:
            second_order = transferred_second_order(inputs, output_errors, fmt, estimate.parts, ordered, noise_draws,
                                                    generator, scale=probe_scale, antithetic=antithetic)
        # Every layer's scalars of this format read with one device transfer (a sync per value made a GPU
        # round wait ~10x per layer and format).
        flat = [(key, i) for key in output_errors for i in range(len(scalars[key]))]
        values = {key: [] for key in output_errors}
        for (key, _), value in zip(flat, read_scalars([scalars[key][i] for key, i in flat])):
            values[key].append(value)
        for (fqn, _), output_error in output_errors.items():
            parts = _forward_parts(inputs, fqn, fmt, values[fqn, fmt], output_error.numel(), second_order[fqn, fmt],
                                   output_rms[fqn])
            if not math.isfinite(parts.loss_divergence) or not math.isfinite(parts.second_order):
                estimate.invalid.append((fqn, fmt))  # (a NaN curvature is no estimate, not free)
                parts = dataclasses.replace(parts, loss_divergence=math.inf)
            estimate.parts[fqn, fmt] = parts
        del output_errors, scalars
    return estimate


def _output_errors(inputs: RoundInputs, group: list[str], fmt: Format, outputs: torch.Tensor, errors: dict,
                   scalars: dict, finite: dict) -> None:
    """dY = Q(X) Q(W)^T - Y of a group's layers in ``fmt`` into ``errors`` (views of one stack), their
    finiteness (0-d bool tensors) into ``finite`` and the tensors of LD's parts into ``scalars``
    (_forward_parts reads them): per layer, the first-order term's sum and sampling variance, ||dY|| and
    ||dY||^2."""
    stats, recipe = inputs.stats, inputs.recipe
    activations, weights = stacked_operands(inputs, group, "x"), stacked_operands(inputs, group, "w")
    quantized_weights = quantize_stack(weights, fmt, recipe=recipe, is_weight=True)
    if kernel_for(fmt, activations.device) is Kernel.EMULATED:
        output_errors = bmm_fp32(quantize_stack(activations, fmt, recipe=recipe), quantized_weights) - outputs
    else:  # a native GEMM per layer (its own casts; shapes it does not take are emulated inside)
        output_errors = stack([quantized_matmul(x, w, fmt, recipe=recipe, b_is_weight=True, out_dtype=torch.float32)
                               for x, w in zip(activations, weights)]) - outputs
    del activations, weights, quantized_weights
    grads = stacked_operands(inputs, group, "g").float()
    first = _sums_and_variances((grads * output_errors).sum(-1), stats.layers[group[0]].num_samples)
    del grads
    norms = torch.linalg.vector_norm(output_errors.flatten(1), dim=1).double()
    energies = output_errors.pow(2).sum(dim=(1, 2)).double()
    if output_errors[0].numel():
        low, high = torch.aminmax(output_errors.flatten(1), dim=1)  # (as all_finite: NaN propagates into both)
        ok = torch.isfinite(low) & torch.isfinite(high)
    else:
        ok = torch.ones(len(group), dtype=torch.bool, device=output_errors.device)
    for i, fqn in enumerate(group):
        errors[fqn, fmt], finite[fqn, fmt] = output_errors[i], ok[i]
        scalars[fqn, fmt] = [*first[i], norms[i], energies[i]]


def _drop_non_finite(inputs: RoundInputs, output_errors: dict, finite: list[torch.Tensor],
                     estimate: ForwardEstimate) -> None:
    """A non-finite output error (a quantizer fault) leaves the round for that (layer, format) only: the
    error probe injects every layer's dY into one forward pass, where one NaN would make every layer's
    second-order term NaN. ``finite``: each error's finiteness, in ``output_errors``' order. Ranks agree on
    the set (their collectives follow it)."""
    stats = inputs.stats
    bad = torch.tensor([0.0 if ok else 1.0 for ok in read_scalars(finite)])  # one device sync, not one per layer
    if stats.sharded and len(bad):
        like = a_sharded_weight(stats)
        bad = all_reduce_sum(bad.to(like.device), like).cpu()
    for key, flag in zip(list(output_errors), bad.tolist()):
        if flag:
            del output_errors[key]
            estimate.dropped.add(key)
            estimate.invalid.append(key)


def _forward_parts(inputs: RoundInputs, fqn: str, fmt: Format, values: list[float], numel: int, second: float,
                   output_rms: float) -> ForwardParts:
    """LD and its parts for one layer and format, from the values of its scalars (_output_errors) and the
    numel of its dY."""
    norm = inputs.loss_norm
    first, first_stderr, error_norm, error_energy = values[0], math.sqrt(values[1]), values[2], values[3]
    # This batch and the sampled batches before the round: independent draws of the first-order term.
    history = inputs.first_order_history.get((fqn, fmt), ())
    batch_values = [*history, first]
    accumulated = sum(batch_values) / len(batch_values)
    accumulated_stderr = (math.sqrt(sum((v - accumulated) ** 2 for v in batch_values) / (len(batch_values) - 1)
                                    / len(batch_values)) if len(batch_values) > 1 else first_stderr)
    loss_divergence = combine_loss_divergence(first=first / norm, first_stderr=first_stderr / norm,
                                              first_accumulated=accumulated / norm if history else None,
                                              second=second / norm)
    return ForwardParts(
        loss_divergence=loss_divergence, first_order=first / norm, first_stderr=first_stderr / norm,
        first_accumulated=accumulated / norm if history else None,
        first_accumulated_stderr=accumulated_stderr / norm if history else None,
        second_order=second / norm, rel_error_forward=error_norm / max(output_rms * math.sqrt(numel), 1e-30),
        abs_error_forward=error_energy)


def _sums_and_variances(per_row: torch.Tensor, num_samples: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each layer of a group (``per_row``: layers x rows), the sum of its per-row contributions and
    the sum's sampling variance (inf with one unit), estimated from the spread of the per-sample sums
    (rows of a sample are contiguous and correlated; samples are independent); 0-d float64 tensors on the
    rows' device (read with the round's other scalars)."""
    length, rows = per_row.shape
    units = num_samples if 2 <= num_samples <= rows and rows % num_samples == 0 else rows
    per_unit = per_row.double().reshape(length, units, -1).sum(-1)
    if units < 2:
        return [(per_unit[i].sum(), torch.full((), math.inf, dtype=torch.float64, device=per_row.device))
                for i in range(length)]
    return [(per_unit[i].sum(), units * per_unit[i].var()) for i in range(length)]

