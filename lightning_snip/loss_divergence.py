"""LD, the forward loss divergence per (layer, format): the relative loss increase a layer's quantized forward
GEMM causes (docs/method.md section 4),

    dY = Q_p(X) Q_p(W)^T - X W^T,    LD = ( <G, dY> + 1/2 dY^T H dY ) / |loss|

The first-order term <G, dY> of one batch is mostly that batch's noise: it is averaged over the statistics
batch and the training batches sampled before the round (lightning_snip.first_order); with none sampled, the
batch's own term is shrunk by its sampling error (positive-part James-Stein). The second-order term comes
from the error probe (lightning_snip.curvature). LD is clamped at 0 for the planner (a negative estimate never
makes a format look better than bf16); rounds and ranks are averaged before that clamp.
"""

from __future__ import annotations

import math

import torch

from lightning_snip.curvature import error_probe_second_order, transferred_second_order
from lightning_snip.formats import Format
from lightning_snip.gemm import Kernel, bmm_fp32, kernel_for, quantized_matmul
from lightning_snip.groups import quantize_stack, stack
from lightning_snip.round_inputs import RoundInputs, a_sharded_weight, read_scalars, round_groups, stacked_operands
from lightning_snip.sharding import all_reduce_sum
from lightning_snip.stats import LayerStats


def combine_loss_divergence(*, first: float, first_stderr: float, first_accumulated: float | None, second: float,
                            clamp: bool = True) -> float:
    """LD from its parts (relative to the loss): the first-order term averaged over the sampled batches
    (``first_accumulated``) or, with none sampled, this batch's ``first`` shrunk by its standard error; plus
    the second-order term; clamped at 0 unless ``clamp`` is False."""
    if first_accumulated is not None:
        value = first_accumulated + second
    elif first == 0.0 or not math.isfinite(first_stderr):
        value = second
    else:
        value = first * max(0.0, 1.0 - (first_stderr / first) ** 2) + second
    return max(0.0, value) if clamp else value


def forward_divergence(r: RoundInputs, valid: dict, metrics: dict, noise_draws: int) -> None:
    """LD's parts of every valid (layer, format) into ``metrics`` (formats that turn out non-finite leave
    ``valid``)."""
    stats, generator = r.stats, r.generator
    # Layers of one shape (and the same formats) stacked: each quantizer and GEMM below runs once per
    # group, not once per layer (lightning_snip.groups; the same numbers).
    groups = round_groups(r, stats.layers, valid)
    # Y = X W^T of every layer, computed once: the reference of every format's dY. One format at a time
    # below, so the round holds one format's dY of every layer (the error probe injects them all at once).
    references, rms = {}, {}
    for group in groups:
        xs, ws = stacked_operands(r, group, "x"), stacked_operands(r, group, "w")
        ys = bmm_fp32(xs, ws)
        del xs, ws
        if valid.get(group[0]):  # (every layer's output RMS; the references of measured layers only)
            references[tuple(group)] = ys
        rms.update(zip(group, ys.pow(2).mean(dim=(1, 2)).sqrt()))
        del ys
    output_rms = dict(zip(stats.layers, read_scalars([rms[fqn] for fqn in stats.layers])))
    del rms
    # The FP4 formats first, so each layer's curvature along its FP4 errors is known when its 8-bit formats
    # come (transferred_second_order; stable sort: the configured order within each group).
    for fmt in sorted(r.formats, key=lambda f: not f.is_fp4):
        errors, scalars, finite = {}, {}, {}
        for group in groups:
            if fmt in valid.get(group[0], ()):  # (a group's layers share their formats)
                _output_errors(r, group, fmt, references[tuple(group)], errors, scalars, finite)
        keys = [(fqn, fmt) for fqn in stats.layers if (fqn, fmt) in errors]  # layer order: the probe's draws follow it
        output_errors = {key: errors[key] for key in keys}
        del errors
        _drop_non_finite(r, output_errors, fmt, valid, metrics, [finite[key] for key in keys])
        if fmt.is_fp4:
            second_order = error_probe_second_order(stats, output_errors, [fmt], noise_draws, generator)
        else:
            second_order = transferred_second_order(r, output_errors, fmt, metrics, noise_draws, generator)
        # Every layer's scalars of this format read with one device transfer (a sync per value made a GPU
        # round wait ~10x per layer and format).
        flat = [(key, i) for key in output_errors for i in range(len(scalars[key]))]
        values = {key: [] for key in output_errors}
        for (key, _), value in zip(flat, read_scalars([scalars[key][i] for key, i in flat])):
            values[key].append(value)
        for (fqn, _), dy in output_errors.items():
            _forward_metrics(r, stats.layers[fqn], fmt, values[fqn, fmt], dy.numel(), second_order[fqn, fmt],
                             output_rms[fqn], metrics[fqn])
        del output_errors, scalars


def _output_errors(r: RoundInputs, group: list[str], fmt: Format, ys: torch.Tensor, errors: dict, scalars: dict,
                   finite: dict) -> None:
    """dY = Q(X) Q(W)^T - Y of a group's layers in ``fmt`` into ``errors`` (views of one stack), their
    finiteness (0-d bool tensors) into ``finite`` and the tensors of LD's parts into ``scalars``
    (_forward_metrics reads them): per layer, the first-order term's sum and sampling variance, ||dY|| and
    ||dY||^2."""
    stats, recipe = r.stats, r.recipe
    xs, ws = stacked_operands(r, group, "x"), stacked_operands(r, group, "w")
    q_w = quantize_stack(ws, fmt, recipe=recipe)
    if kernel_for(fmt, xs.device) is Kernel.EMULATED:
        dys = bmm_fp32(quantize_stack(xs, fmt, recipe=recipe), q_w) - ys
    else:  # a native GEMM per layer (its own casts; shapes it does not take are emulated inside)
        dys = stack([quantized_matmul(x, w, fmt, recipe=recipe, out_dtype=torch.float32) for x, w in zip(xs, ws)]) - ys
    del xs, ws, q_w
    gs = stacked_operands(r, group, "g").float()
    first = _sums_and_variances((gs * dys).sum(-1), stats.layers[group[0]].num_samples)
    del gs
    norms = torch.linalg.vector_norm(dys.flatten(1), dim=1).double()
    energies = dys.pow(2).sum(dim=(1, 2)).double()
    if dys[0].numel():
        low, high = torch.aminmax(dys.flatten(1), dim=1)  # (as all_finite: NaN propagates into both)
        ok = torch.isfinite(low) & torch.isfinite(high)
    else:
        ok = torch.ones(len(group), dtype=torch.bool, device=dys.device)
    for i, fqn in enumerate(group):
        errors[fqn, fmt], finite[fqn, fmt] = dys[i], ok[i]
        scalars[fqn, fmt] = [*first[i], norms[i], energies[i]]


def _drop_non_finite(r: RoundInputs, output_errors: dict, fmt: Format, valid: dict, metrics: dict,
                     finite: list[torch.Tensor]) -> None:
    """A non-finite output error (a quantizer fault) leaves the round for that (layer, format) only: the
    error probe injects every layer's dY into one forward pass, where one NaN would make every layer's
    second-order term NaN. ``finite``: each error's finiteness, in ``output_errors``' order. Ranks agree on
    the set (their collectives follow it)."""
    stats = r.stats
    bad = torch.tensor([0.0 if ok else 1.0 for ok in read_scalars(finite)])  # one device sync, not one per layer
    if stats.sharded and len(bad):
        like = a_sharded_weight(stats)
        bad = all_reduce_sum(bad.to(like.device), like).cpu()
    for (fqn, _), flag in zip(list(output_errors), bad.tolist()):
        if flag:
            del output_errors[fqn, fmt]
            valid[fqn] = [f for f in valid[fqn] if f is not fmt]
            metrics[fqn]["loss_divergence"][fmt] = metrics[fqn]["weight_divergence"][fmt] = math.inf
            r.invalid.append((fqn, fmt))


def _forward_metrics(r: RoundInputs, s: LayerStats, fmt: Format, values: list[float], numel: int, second: float,
                     y_rms: float, metrics: dict) -> None:
    """LD and its parts for one layer and format into ``metrics``, from the values of its scalars
    (_output_errors) and the numel of its dY."""
    norm = r.loss_norm
    first, first_se, dy_norm, abs_y = values[0], math.sqrt(values[1]), values[2], values[3]
    # This batch and the sampled batches before the round: independent draws of the first-order term.
    history = r.first_order_history.get((s.fqn, fmt), ())
    batch_values = [*history, first]
    first_acc = sum(batch_values) / len(batch_values)
    first_acc_se = (math.sqrt(sum((v - first_acc) ** 2 for v in batch_values) / (len(batch_values) - 1) / len(batch_values))
                    if len(batch_values) > 1 else first_se)
    ld = combine_loss_divergence(first=first / norm, first_stderr=first_se / norm,
                                 first_accumulated=first_acc / norm if history else None, second=second / norm)
    if not math.isfinite(ld) or not math.isfinite(second):  # max(0, nan) is 0: a NaN curvature is no estimate, not free
        r.invalid.append((s.fqn, fmt))
        ld = math.inf
    metrics["loss_divergence"][fmt] = ld
    metrics["first_order"][fmt], metrics["second_order"][fmt] = first / norm, second / norm
    metrics["first_stderr"][fmt] = first_se / norm
    if history:
        metrics["first_accumulated"][fmt], metrics["first_accumulated_stderr"][fmt] = first_acc / norm, first_acc_se / norm
    metrics["rel_error_forward"][fmt] = dy_norm / max(y_rms * math.sqrt(numel), 1e-30)
    metrics["abs_error_forward"][fmt] = abs_y


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

