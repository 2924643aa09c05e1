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
from dataclasses import dataclass

import torch

from lightning_snip import kernels
from lightning_snip.adamw import AdamState
from lightning_snip.formats import Format, Rounding
from lightning_snip.gemm import Kernel, bmm_fp32, kernel_for, operand_rounding, quantized_matmul
from lightning_snip.grid import random_bits
from lightning_snip.hadamard import hadamard_rows, rht_matrix
from lightning_snip.groups import quantize_stack, stack
from lightning_snip.quantize import padded_numel
from lightning_snip.round_inputs import RoundInputs, a_sharded_weight, read_scalars, round_groups, stacked_operands
from lightning_snip.sharding import all_reduce_sum, from_local_parts, is_sharded, local_part
from lightning_snip.stats import LayerStats, Propagation, RoundPrecision, Statistics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackwardParts:
    """WD of one (layer, format) and its parts, relative to the update energy sum_k ||u_k||^2."""

    wd_direct: float  # ||D_l(E_W)||^2: the layer's own update deviated by its wgrad error
    wd_propagated: float  # sum_k ||D_k(J_kl(E_X))||^2: the dgrad error's deviation of the updates upstream
    wd_propagated_stderr: float  # its standard error over the round's probes (Propagation.PROBE; 0 when exact)
    rel_error_wgrad: float  # ||E_W|| / ||G^T X|| (+inf: non-finite)
    abs_error_wgrad: float  # ||E_W||^2

    @property
    def weight_divergence(self) -> float:
        return self.wd_direct + self.wd_propagated


def backward_divergence(inputs: RoundInputs, valid: Mapping[str, Sequence[Format]], probes: int
                        ) -> dict[tuple[str, Format], BackwardParts]:
    """WD's parts of every valid (layer, format); the direct term summed over ranks under FSDP2."""
    stats, precision, generator = inputs.stats, inputs.precision, inputs.generator
    measured = [fqn for fqn, fmts in valid.items() if fmts]
    keys = [(fqn, f) for fqn in measured for f in valid[fqn]]
    bits = _GradientBits(inputs, keys, "g")
    input_errors = {}
    for group in round_groups(inputs, measured, valid):
        fmts = valid[group[0]]
        grads, weights = stacked_operands(inputs, group, "g"), stacked_operands(inputs, group, "w")
        weights_t = weights.transpose(1, 2).contiguous()  # dgrad's W, quantized along its dim 0: one copy for every format
        del weights
        reference = bmm_fp32(grads, weights_t)
        errors = reference.new_empty(len(group), len(fmts), *reference.shape[1:])  # per layer: formats x rows x k
        for j, fmt in enumerate(fmts):
            torch.sub(_quantized_bmm(inputs, grads, weights_t, fmt, group, bits, wgrad=False), reference,
                      out=errors[:, j])
        input_errors.update(zip(group, errors))
        del grads, weights_t, reference, errors
    propagated = None
    if stats.propagation is Propagation.PROBE:
        propagated = _probe_propagated(stats, inputs.adam, input_errors, probes, generator, precision)
    # wgrad: the reference G^T X and each format's error E_W, a group of layers at a time; its stochastic
    # rounding draws in layer order, after the dgrad errors' (as one layer at a time drew them).
    bits = _GradientBits(inputs, keys, "g_t")
    direct, rest = {}, {}  # (fqn, format) -> the direct term's sum of squares over this rank's shard; the other parts
    for group in round_groups(inputs, measured, valid):
        fmts = valid[group[0]]
        # wgrad's operands, quantized along the token axis: one contiguous copy each for every format
        grads_t = stacked_operands(inputs, group, "g").transpose(1, 2).contiguous()
        activations_t = stacked_operands(inputs, group, "x").transpose(1, 2).contiguous()
        references = bmm_fp32(grads_t, activations_t)
        weight_errors = references.new_empty(len(group), len(fmts), *references.shape[1:])  # layers x formats x out x in
        for j, fmt in enumerate(fmts):
            torch.sub(_quantized_bmm(inputs, grads_t, activations_t, fmt, group, bits, wgrad=True), references,
                      out=weight_errors[:, j])
        del grads_t, activations_t
        norms = torch.linalg.vector_norm(weight_errors.flatten(2), dim=2).double()  # layers x formats
        energies = weight_errors.pow(2).sum(dim=(2, 3)).double()
        reference_norms = torch.linalg.vector_norm(references.flatten(1), dim=1).double().clamp_min(1e-30)
        for i, fqn in enumerate(group):
            wgrad = (references[i], weight_errors[i],
                     [t for pair in zip(norms[i], energies[i]) for t in pair] + [reference_norms[i]])
            layer_direct, layer_rest = _layer_backward_parts(
                inputs, stats.layers[fqn], valid[fqn], input_errors.pop(fqn),
                None if propagated is None else propagated[fqn], wgrad)
            direct.update(layer_direct)
            rest.update(layer_rest)
        del references, weight_errors
    if stats.sharded and direct:  # one all-reduce for every layer's direct term
        like = a_sharded_weight(stats)
        summed = all_reduce_sum(torch.tensor(list(direct.values()), dtype=torch.float64, device=like.device), like)
        direct = dict(zip(direct, summed.cpu().tolist()))
    return {key: BackwardParts(wd_direct=direct[key] / inputs.denominator, **rest[key]) for key in direct}


class _GradientBits:
    """The random bits of the stochastic rounding of a gradient GEMM's gradient operand (``operand`` "g":
    dgrad's G; "g_t": wgrad's G^T) for _quantized_bmm's stacked quantizers: the draws quantized_matmul makes
    layer by layer, from the round's generator in ``keys``' order ((fqn, format) pairs, layer order), drawn
    only when a group needs them: a group takes its layers' bits and those of the layers before them are
    drawn and kept for their own groups (a group of one layer, as on a CPU, holds its own bits only). Only
    formats that round stochastically in emulation draw; none under the reference quantizers (they draw for
    themselves, one layer at a time)."""

    def __init__(self, inputs: RoundInputs, keys: list[tuple[str, Format]], operand: str) -> None:
        self._inputs, self._operand = inputs, operand
        reference = kernels.quantizer_mode() == "reference"
        self.keys = [] if reference else [
            (fqn, fmt) for fqn, fmt in keys if operand_rounding(fmt, inputs.recipe, True) is Rounding.STOCHASTIC
            and kernel_for(fmt, inputs.stats.layers[fqn].g.device) is Kernel.EMULATED]
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
                grad = self._inputs.stats.layers[fqn].g
                shape = tuple(grad.shape) if self._operand == "g" else (grad.shape[1], grad.shape[0])
                self._drawn[fqn, fmt] = random_bits(padded_numel(shape, fmt, 1), self._inputs.generator, grad.device)
        return [self._drawn.pop(key) for key in keys]


def _quantized_bmm(inputs: RoundInputs, grads: torch.Tensor, others: torch.Tensor, fmt: Format, group: list[str],
                   bits: _GradientBits, *, wgrad: bool) -> torch.Tensor:
    """Q(grads[i]) @ Q(others[i])^T in fp32 for a group's stacked gradient GEMM operands (dgrad: G and
    W^T, the weight's scales as the recipe has them; ``wgrad``: G^T and X^T, each layer's random Hadamard transform
    first where the recipe has one), as quantized_matmul(a_is_grad=True) gives them layer by layer: the stochastic
    rounding of the gradients from ``bits``, in one stacked quantizer call and one bmm. A native kernel, or
    the reference quantizers, run layer by layer and draw for themselves."""
    rounding = operand_rounding(fmt, inputs.recipe, True)
    signs = [inputs.stats.layer_modules[fqn].rht_signs for fqn in group] if wgrad else [None] * len(group)
    # (The layer-order draws of ``bits`` hold while nothing else draws from inputs.generator between its takes: a
    # native kernel's own draws below come from formats that never take bits, all of one device's layers
    # having the same kernel per format, and the reference quantizers take none.)
    if kernel_for(fmt, grads.device) is not Kernel.EMULATED or (
            rounding is Rounding.STOCHASTIC and not bits.draws((group[0], fmt))):
        return stack([quantized_matmul(a, b, fmt, recipe=inputs.recipe, a_is_grad=True, b_is_weight=not wgrad,
                                       hadamard=layer_signs, generator=inputs.generator, out_dtype=torch.float32)
                      for a, b, layer_signs in zip(grads, others, signs)])
    if wgrad and inputs.recipe.uses_hadamard(fmt):  # each layer's transform along the token axis
        matrices = torch.stack([rht_matrix(layer_signs, str(grads.device)) for layer_signs in signs])
        grads, others = hadamard_rows(grads, matrices), hadamard_rows(others, matrices)
    q_grads = quantize_stack(grads, fmt, recipe=inputs.recipe, is_grad=True, rounding=rounding,
                             bits=bits.take([(fqn, fmt) for fqn in group]) if rounding is Rounding.STOCHASTIC else None)
    return bmm_fp32(q_grads, quantize_stack(others, fmt, recipe=inputs.recipe, is_weight=not wgrad))


def _layer_backward_parts(inputs: RoundInputs, layer: LayerStats, fmts, input_errors: torch.Tensor, propagated,
                          wgrad) -> tuple[dict[tuple[str, Format], float], dict[tuple[str, Format], dict]]:
    """WD's parts for one layer and its valid formats: per format, its direct term's sum of squares (over this
    rank's shard under FSDP2: summed over ranks before WD is formed) and its other parts (BackwardParts' fields).
    ``input_errors``: E_X per format (formats x rows x k); ``propagated``: the probes' (estimates, standard
    errors), or None for the exact vector-Jacobian products; ``wgrad``: the reference G^T X, E_W per format
    (formats x m x k) and the 0-d tensors ||E_W||, ||E_W||^2 per format and ||G^T X||."""
    reference, weight_errors, norms = wgrad
    weight_name = layer.weight_name or layer.fqn + ".weight"
    if propagated is not None:
        propagated_by_format, propagated_stderr = propagated
    else:
        # One batched vector-Jacobian product carries every format's dgrad error upstream.
        upstream = inputs.stats.propagate_input_grad(layer.fqn, input_errors)
        propagated_by_format = torch.zeros(len(fmts), dtype=torch.float64)  # sum_k ||D_k(J_kl(E_X))||^2
        for name, deltas in upstream.items():
            propagated_by_format += _update_deviation(inputs, name, deltas).pow(2).reshape(len(fmts), -1).sum(1).double().cpu()
        propagated_stderr = torch.zeros(len(fmts), dtype=torch.float64)
        del upstream
    # A frozen weight (no gradient) has no update to deviate: only its propagated error counts.
    own_grad = reference if inputs.stats.is_recomputed(weight_name) else inputs.stats.param_grad(weight_name, inputs.precision)
    # per format: the direct term's sum of squares, then every norm; read with one transfer
    scalars = [_update_deviation(inputs, weight_name, error, own_grad).pow(2).sum().double() if own_grad is not None
               else torch.zeros((), dtype=torch.float64, device=error.device) for error in weight_errors]
    values = read_scalars(scalars + norms)
    direct, rest = {}, {}
    for i, fmt in enumerate(fmts):
        error_norm, error_energy = values[len(fmts) + 2 * i: len(fmts) + 2 * i + 2]
        direct[layer.fqn, fmt] = values[i]
        relative = error_norm / values[-1]
        rest[layer.fqn, fmt] = dict(
            wd_propagated=float(propagated_by_format[i]) / inputs.denominator,
            wd_propagated_stderr=float(propagated_stderr[i]) / inputs.denominator,
            rel_error_wgrad=relative if math.isfinite(relative) else math.inf,  # as LD/WD: non-finite = invalid
            abs_error_wgrad=error_energy)
    return direct, rest


def _update_deviation(inputs: RoundInputs, name: str, delta: torch.Tensor, grad: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """D(delta): the deviation of parameter ``name``'s next update when its gradient is off by delta
    (``grad``: the slice's gradient of ``name`` when the caller has it)."""
    adam = inputs.adam.get(name)
    like = inputs.stats.parameter(name)
    if adam is None:
        return local_part(delta.float(), like)
    grad = inputs.stats.param_grad(name, inputs.precision) if grad is None else grad
    # FSDP2: this rank's shard of the error and gradient, with its shard of the moments.
    return adam.update_deviation(local_part(grad, like), local_part(delta, like))


def update_energy(stats: Statistics, adam: Mapping[str, AdamState | None],
                   precision: RoundPrecision = RoundPrecision.TRAINING) -> float:
    """sum_k ||u_k||^2, one parameter at a time: AdamW's next update (its moments advanced by the
    slice's own gradient), or the gradient itself without Adam moments. ``adam``: parameter name -> this rank's
    state (AdamState.local()).

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
            parts.append(state.next_update_energy(grad).double())
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
    slice's gradient (gradient operands in ``precision``; 1 without moments; ``adam``: this rank's states, as
    update_energy takes them), computed once for all seeds.
    FSDP2: every rank draws the whole parameter's signs, scales its shard by its shard of the moments, and
    one all-gather joins the shards."""
    like = stats.parameter(name)
    state = adam.get(name)
    scale = 1.0
    if state is not None:
        grad = stats.param_grad(name, precision)
        scale = state.update_sensitivity(None if grad is None else local_part(grad, like))
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

