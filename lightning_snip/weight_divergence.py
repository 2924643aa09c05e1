"""WD, the backward weight divergence per (layer, format): how far the layer's FP4/FP8 dgrad and wgrad errors
move AdamW's next updates, relative to the updates' energy (docs/method.md section 5).

    WD = ( ||D_l(E_W)||^2 + sum_k ||D_k(J_kl(E_X))||^2 ) / sum_k ||u_k||^2

E_W, the wgrad error, deviates the layer's own update (the direct term); E_X, the dgrad error, flows upstream
(the propagated term: forward-mode probes, stats.Propagation.PROBE, or one vector-Jacobian product per layer,
EXACT). D_k(e) = u_k(g_k + e) - u_k(g_k) is AdamW's update deviation (adamw.AdamState), exact, not the method
text's linearization (wrong where v_hat is about 0). Under FSDP2 every sum over parameter elements is taken on
this rank's shard and summed over ranks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch

from lightning_snip import kernels
from lightning_snip.adamw import AdamState
from lightning_snip.formats import Format, Rounding
from lightning_snip.gemm import Kernel, bmm_fp32, kernel_for, operand_rounding, quantized_matmul
from lightning_snip.grid import random_bits
from lightning_snip.groups import quantize_stack, stack
from lightning_snip.quantize import padded_numel
from lightning_snip.round_inputs import RoundInputs, a_sharded_weight, read_scalars, round_groups, stacked_operands
from lightning_snip.sharding import all_reduce_sum, from_local_parts, is_sharded, local_part
from lightning_snip.stats import LayerStats, Propagation, RoundPrecision, Statistics

logger = logging.getLogger(__name__)


def backward_divergence(r: RoundInputs, valid: dict, metrics: dict, probes: int) -> dict:
    """WD's parts of every valid (layer, format) into ``metrics``; returns (fqn, format) -> the direct
    term's sum of squares (summed over ranks under FSDP2), before the division by the update energy."""
    stats, precision, generator = r.stats, r.precision, r.generator
    measured = [fqn for fqn, fmts in valid.items() if fmts]
    keys = [(fqn, f) for fqn in measured for f in valid[fqn]]
    bits = _GradientBits(r, keys, "g")
    input_errors = {}
    for group in round_groups(r, measured, valid):
        fmts = valid[group[0]]
        gs, ws = stacked_operands(r, group, "g"), stacked_operands(r, group, "w")
        w_ts = ws.transpose(1, 2).contiguous()  # dgrad's W, quantized along its dim 0: one copy for every format
        del ws
        gx_ref = bmm_fp32(gs, w_ts)
        errors = gx_ref.new_empty(len(group), len(fmts), *gx_ref.shape[1:])  # per layer: formats x rows x k
        for j, fmt in enumerate(fmts):
            torch.sub(_quantized_bmm(r, gs, w_ts, fmt, group, bits), gx_ref, out=errors[:, j])
        input_errors.update(zip(group, errors))
        del gs, w_ts, gx_ref, errors
    propagated = None
    if stats.propagation is Propagation.PROBE:
        propagated = _probe_propagated(stats, r.adam, input_errors, probes, generator, precision)
    # wgrad: the reference G^T X and each format's error E_W, a group of layers at a time; its stochastic
    # rounding draws in layer order, after the dgrad errors' (as one layer at a time drew them).
    bits = _GradientBits(r, keys, "g_t")
    direct = {}  # (fqn, format) -> the direct term's sum of squares over this rank's shard
    for group in round_groups(r, measured, valid):
        fmts = valid[group[0]]
        # wgrad's operands, quantized along the token axis: one contiguous copy each for every format
        g_ts = stacked_operands(r, group, "g").transpose(1, 2).contiguous()
        x_ts = stacked_operands(r, group, "x").transpose(1, 2).contiguous()
        gw_refs = bmm_fp32(g_ts, x_ts)
        e_ws = gw_refs.new_empty(len(group), len(fmts), *gw_refs.shape[1:])  # layers x formats x out x in
        for j, fmt in enumerate(fmts):
            torch.sub(_quantized_bmm(r, g_ts, x_ts, fmt, group, bits), gw_refs, out=e_ws[:, j])
        del g_ts, x_ts
        norms = torch.linalg.vector_norm(e_ws.flatten(2), dim=2).double()  # layers x formats
        energies = e_ws.pow(2).sum(dim=(2, 3)).double()
        ref_norms = torch.linalg.vector_norm(gw_refs.flatten(1), dim=1).double().clamp_min(1e-30)
        for i, fqn in enumerate(group):
            wgrad = (gw_refs[i], e_ws[i], [t for pair in zip(norms[i], energies[i]) for t in pair] + [ref_norms[i]])
            direct.update(_layer_backward_metrics(r, stats.layers[fqn], valid[fqn], input_errors.pop(fqn),
                                            None if propagated is None else propagated[fqn], wgrad, metrics[fqn]))
        del gw_refs, e_ws
    if stats.sharded and direct:  # one all-reduce for every layer's direct term
        like = a_sharded_weight(stats)
        summed = all_reduce_sum(torch.tensor(list(direct.values()), dtype=torch.float64, device=like.device), like)
        direct = dict(zip(direct, summed.cpu().tolist()))
    return direct


class _GradientBits:
    """The random bits of the stochastic rounding of a gradient GEMM's gradient operand (``operand`` "g":
    dgrad's G; "g_t": wgrad's G^T) for _quantized_bmm's stacked quantizers: the draws quantized_matmul makes
    layer by layer, from the round's generator in ``keys``' order ((fqn, format) pairs, layer order), drawn
    only when a group needs them: a group takes its layers' bits and those of the layers before them are
    drawn and kept for their own groups (a group of one layer, as on a CPU, holds its own bits only). Only
    formats that round stochastically in emulation draw; none under the reference quantizers (they draw for
    themselves, one layer at a time)."""

    def __init__(self, r: RoundInputs, keys: list[tuple[str, Format]], operand: str) -> None:
        self._r, self._operand = r, operand
        reference = kernels.quantizer_mode() == "reference"
        self.keys = [] if reference else [
            (fqn, fmt) for fqn, fmt in keys if operand_rounding(fmt, r.recipe, True) is Rounding.STOCHASTIC
            and kernel_for(fmt, r.stats.layers[fqn].g.device) is Kernel.EMULATED]
        self._drawing = set(self.keys)
        self._next = 0  # self.keys[: self._next] are drawn
        self._drawn: dict[tuple[str, Format], torch.Tensor] = {}

    def draws(self, key: tuple[str, Format]) -> bool:
        """Whether ``key``'s gradient operand is rounded from these bits."""
        return key in self._drawing

    def take(self, keys: list[tuple[str, Format]]) -> list[torch.Tensor]:
        """The bits of ``keys`` (each taken once), drawing in order up to the last of them."""
        for key in keys:
            if key not in self._drawing:
                raise KeyError(f"{key!r} rounds without these bits")
            while key not in self._drawn:
                if self._next == len(self.keys):
                    raise KeyError(f"{key!r}'s bits were already taken")
                fqn, fmt = self.keys[self._next]
                self._next += 1
                s = self._r.stats.layers[fqn]
                shape = tuple(s.g.shape) if self._operand == "g" else (s.g.shape[1], s.g.shape[0])
                self._drawn[fqn, fmt] = random_bits(padded_numel(shape, fmt, 1), self._r.generator, s.g.device)
        return [self._drawn.pop(key) for key in keys]


def _quantized_bmm(r: RoundInputs, grads: torch.Tensor, others: torch.Tensor, fmt: Format, group: list[str],
                   bits: _GradientBits) -> torch.Tensor:
    """Q(grads[i]) @ Q(others[i])^T in fp32 for a group's stacked gradient GEMM operands (dgrad: G and
    W^T; wgrad: G^T and X^T), as quantized_matmul(a_is_grad=True) gives them layer by layer: the stochastic
    rounding of the gradients from ``bits``, in one stacked quantizer call and one bmm. A native kernel, or
    the reference quantizers, run layer by layer and draw for themselves."""
    rounding = operand_rounding(fmt, r.recipe, True)
    # (The layer-order draws of ``bits`` hold while nothing else draws from r.generator between its takes: a
    # native kernel's own draws below come from formats that never take bits, all of one device's layers
    # having the same kernel per format, and the reference quantizers take none.)
    if kernel_for(fmt, grads.device) is not Kernel.EMULATED or (
            rounding is Rounding.STOCHASTIC and not bits.draws((group[0], fmt))):
        return stack([quantized_matmul(a, b, fmt, recipe=r.recipe, a_is_grad=True, generator=r.generator,
                                       out_dtype=torch.float32) for a, b in zip(grads, others)])
    q_grads = quantize_stack(grads, fmt, recipe=r.recipe, is_grad=True, rounding=rounding,
                             bits=bits.take([(fqn, fmt) for fqn in group]) if rounding is Rounding.STOCHASTIC else None)
    return bmm_fp32(q_grads, quantize_stack(others, fmt, recipe=r.recipe))


def _layer_backward_metrics(r: RoundInputs, s: LayerStats, fmts, input_errors: torch.Tensor, propagated, wgrad,
                      metrics: dict) -> dict[tuple[str, Format], float]:
    """WD's parts for one layer and its valid formats, into ``metrics``; returns its direct term's
    sum of squares per format (over this rank's shard under FSDP2: summed over ranks before WD is
    formed). ``input_errors``: E_X per format (formats x rows x k); ``propagated``: the probes'
    (estimates, standard errors), or None for the exact vector-Jacobian products; ``wgrad``: the
    reference G^T X, E_W per format (formats x m x k) and the 0-d tensors ||E_W||, ||E_W||^2 per format
    and ||G^T X||."""
    gw_ref, e_ws, norms = wgrad
    weight_name = s.weight_name or s.fqn + ".weight"
    if propagated is not None:
        propagated_by_format, propagated_stderr = propagated
    else:
        # One batched vector-Jacobian product carries every format's dgrad error upstream.
        upstream = r.stats.propagate_input_grad(s.fqn, input_errors)
        propagated_by_format = torch.zeros(len(fmts), dtype=torch.float64)  # sum_k ||D_k(J_kl(E_X))||^2
        for name, deltas in upstream.items():
            propagated_by_format += _update_deviation(r, name, deltas).pow(2).reshape(len(fmts), -1).sum(1).double().cpu()
        propagated_stderr = torch.zeros(len(fmts), dtype=torch.float64)
        del upstream
    # A frozen weight (no gradient) has no update to deviate: only its propagated error counts.
    own_grad = gw_ref if r.stats.is_recomputed(weight_name) else r.stats.param_grad(weight_name, r.precision)
    # per format: the direct term's sum of squares, then every norm; read with one transfer
    scalars = [_update_deviation(r, weight_name, e_w, own_grad).pow(2).sum().double() if own_grad is not None
               else torch.zeros((), dtype=torch.float64, device=e_w.device) for e_w in e_ws]
    values = read_scalars(scalars + norms)
    direct = {}
    for i, fmt in enumerate(fmts):
        direct_sum, (e_w_norm, abs_w) = values[i], values[len(fmts) + 2 * i: len(fmts) + 2 * i + 2]
        direct[s.fqn, fmt] = direct_sum
        metrics["wd_propagated"][fmt] = float(propagated_by_format[i]) / r.denominator
        metrics["wd_propagated_stderr"][fmt] = float(propagated_stderr[i]) / r.denominator
        rel_w = e_w_norm / values[-1]
        metrics["rel_error_wgrad"][fmt] = rel_w if math.isfinite(rel_w) else math.inf  # as LD/WD: non-finite = invalid
        metrics["abs_error_wgrad"][fmt] = abs_w
    return direct


def _update_deviation(r: RoundInputs, name: str, delta: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    """D(delta): the deviation of parameter ``name``'s next update when its gradient is off by delta
    (``grad``: the slice's gradient of ``name`` when the caller has it)."""
    adam = r.adam.get(name)
    like = r.stats.parameter(name)
    if adam is None:
        return local_part(delta.float(), like)
    grad = r.stats.param_grad(name, r.precision) if grad is None else grad
    # FSDP2: this rank's shard of the error and gradient, with its shard of the moments.
    return adam.local().update_deviation(local_part(grad, like), local_part(delta, like))


def update_energy(stats: Statistics, adam: Mapping[str, AdamState | None],
                   precision: RoundPrecision = RoundPrecision.TRAINING) -> float:
    """sum_k ||u_k||^2, one parameter at a time: AdamW's next update (its moments advanced by the
    slice's own gradient), or the gradient itself without Adam moments.

    WD perturbs the next AdamW step, the one that takes this batch's gradient: its moments include
    that gradient (the method text reads them before it, docs/method.md section 5; measured, that let one
    batch with unusually large gradients dominate a round: WD's two-round agreement fell to 0.16-0.36)."""
    parts, like = [], None  # one device sync at the end, not one per parameter
    for name in stats.param_names:
        grad = stats.param_grad(name, precision)
        param = stats.parameter(name)
        like = param if is_sharded(param) else like
        if grad is not None:  # FSDP2: this rank's shard of it, with its shard of the moments
            grad = local_part(grad, param)
        state = adam.get(name)
        if state is not None:
            parts.append(state.local().next_update_energy(grad).double())
        elif grad is not None:
            parts.append(grad.pow(2).sum().double())
    total = math.fsum(read_scalars(parts))
    if like is not None:
        total = float(all_reduce_sum(torch.tensor([total], dtype=torch.float64, device=like.device), like))
    return total


def _probe_propagated(stats: Statistics, adam: Mapping[str, AdamState | None], input_errors: Mapping[str, torch.Tensor],
                      probes: int, generator: torch.Generator | None, precision: RoundPrecision = RoundPrecision.TRAINING
                      ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """sum_k ||Lambda_k J_kl^T E_X(l, p)||^2 for every layer l and format p from ``probes`` forward-mode
    passes (stats.Propagation.PROBE): parameter tangents Lambda * r with random signs r, read
    <t_l, E_X(l, p)> at each layer's input; the mean of its square over probes, and its standard error.

    Lambda_k = dD_k/de at 0 (AdamState.update_sensitivity; 1 without Adam moments): the exact D of
    the EXACT mode is not linear, and a probe needs a linear map. Signs, not Gaussians: a smaller
    variance, 2 (||a||^4 - sum a_i^4) instead of 2 ||a||^4 per probe."""
    if probes < 1:
        raise ValueError(f"probes: invalid value {probes!r}; allowed: an integer >= 1")
    index = {name: i for i, name in enumerate(stats.param_names)}
    # Accumulated on the errors' device and read once at the end: no device sync per layer and probe.
    sums = {fqn: torch.zeros(len(e), dtype=torch.float64, device=e.device) for fqn, e in input_errors.items()}
    squares = {fqn: torch.zeros(len(e), dtype=torch.float64, device=e.device) for fqn, e in input_errors.items()}
    # Seeds from the round generator's seed, without drawing from it: the stochastic rounding of the
    # gradient GEMMs after the probes sees the same draws in both Propagation modes.
    base = (generator.initial_seed() if generator is not None else int(torch.randint(0, 2**62, ()))) * 0x9E3779B1
    seeds = [(base + 0x632BE5AB * (probe + 1)) % 2**62 for probe in range(probes)]

    def tangents_of(name: str, param: torch.Tensor, which: range) -> torch.Tensor:
        # Regenerated from (probe, parameter), not stored: the same tangent wherever the parameter
        # is used (tied weights), one module's tangents in memory at a time.
        return sign_tangents(stats, adam, name, index[name], [seeds[k] for k in which], precision)

    def measure(fqn: str, tangent: torch.Tensor) -> torch.Tensor | None:
        if fqn not in input_errors:
            return None
        return (input_errors[fqn] * tangent).sum(dim=(1, 2)).double().pow(2)

    per_probe, touched = stats.input_tangents(tangents_of, measure, probes, layers=input_errors)
    for values in per_probe:  # in probe order, as one pass per probe summed them
        for fqn, value in values.items():
            sums[fqn] += value
            squares[fqn] += value.pow(2)
    missing = [n for n in stats.param_names if n not in touched and stats.has_grad(n)]
    if missing:
        logger.warning("weight divergence: parameters %s have gradients but were not used by the module that "
                       "registers them; their share of the propagated term is missing (exact propagation, "
                       "collect_stats(propagation=Propagation.EXACT), covers them)", missing[:5])
    out = {}
    for fqn in input_errors:
        mean = sums[fqn].cpu() / probes
        squares[fqn] = squares[fqn].cpu()
        var = (squares[fqn] / probes - mean.pow(2)).clamp_min(0) * probes / max(probes - 1, 1)
        out[fqn] = (mean, (var / probes).sqrt() if probes > 1 else torch.full_like(mean, math.inf))
    return out


def sign_tangents(stats: Statistics, adam: Mapping[str, AdamState | None], name: str, index: int,
                  seeds: Sequence[int], precision: RoundPrecision = RoundPrecision.TRAINING) -> torch.Tensor:
    """Lambda r of parameter ``name`` (the ``index``-th of stats.param_names) for each of ``seeds``, stacked
    (len(seeds) x the parameter's shape): random signs r drawn from (seed, index), not from a shared stream,
    so the same tangent comes back wherever the parameter is used, times AdamW's update sensitivity at the
    slice's gradient (gradient operands in ``precision``; 1 without moments), computed once for all seeds.
    FSDP2: every rank draws the whole parameter's signs, scales its shard by its shard of the moments, and
    one all-gather joins the shards."""
    like = stats.parameter(name)
    state = adam.get(name)
    scale = 1.0
    if state is not None:
        grad = stats.param_grad(name, precision)
        scale = state.local().update_sensitivity(None if grad is None else local_part(grad, like))
    out = None  # one (len(seeds), *shape) tensor filled in place: no list of copies to stack
    for i, seed in enumerate(seeds):
        draw = torch.Generator(device=like.device).manual_seed((seed + 7919 * index) % 2**63)
        signs = torch.randint(0, 2, like.shape, generator=draw, device=like.device, dtype=torch.int8)
        tangent = from_local_parts((2.0 * local_part(signs, like) - 1.0) * scale, like)
        if out is None:
            out = tangent.new_empty((len(seeds), *tangent.shape))
        out[i] = tangent
        del tangent
    return out

