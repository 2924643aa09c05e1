"""One statistics round, the pipe from a training batch to the evidence the planner reads: slice the batch, record
a high-precision pass over it (lightning_snip.stats), estimate LD (lightning_snip.loss_divergence) and WD
(lightning_snip.weight_divergence) per (layer, format), and reduce them over data-parallel ranks
(lightning_snip.divergence), with a SNIPConfig's settings and a RoundSettings' draws and probes. LD leaves the
round unclamped: rounds and ranks are averaged first, and the planner clamps it (evidence.planning_value).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import torch

from lightning_snip.collective import SINGLE_PROCESS, Collective
from lightning_snip.config import SNIPConfig
from lightning_snip.divergence import DivergenceResult, LayerDivergence, reduce_result
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.linear import SNIPLinear
from lightning_snip.loss_divergence import ForwardEstimate, forward_divergence
from lightning_snip.probes import ForwardModeUnsupportedError
from lightning_snip.round_inputs import RoundInputs, a_sharded_weight, all_finite
from lightning_snip.sharding import all_reduce_sum, is_sharded
from lightning_snip.stats import Propagation, RoundPrecision, Statistics, collect_stats, slice_batch
from lightning_snip.weight_divergence import BackwardParts, backward_divergence, update_energy

# The round's estimator settings, fixed by their studies (docs/configuration.md, "Removed options (2026-12-04)"):
NOISE_DRAWS = 2  # error-probe draws of LD's second-order term per FP4 format
WD_PROBES = 4  # forward-mode probes of WD's propagated term
PROBE_SCALE = 1.0  # the error probe's injected errors, as a multiple of the quantization errors
ANTITHETIC = False  # each error-probe draw also with its signs negated (a central difference; two passes a draw)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundSettings:
    """The estimator's settings of a round: fixed for users by their studies, varied by benchmarks by argument (never
    by patching this module). ``noise_draws``: error-probe draws of LD's second-order term per FP4 format;
    ``wd_probes``: forward-mode probes of WD's propagated term; ``group_layers``: the most layers of one shape batched
    into one call (None: the device's default, lightning_snip.groups); ``probe_scale`` and ``antithetic``: the error
    probe's (curvature.error_probe_second_order). The rows a round takes are a user's setting, SNIPConfig.max_rows."""

    noise_draws: int = NOISE_DRAWS
    wd_probes: int = WD_PROBES
    group_layers: int | None = None
    probe_scale: float = PROBE_SCALE
    antithetic: bool = ANTITHETIC

    def __post_init__(self) -> None:
        if isinstance(self.probe_scale, bool) or not isinstance(self.probe_scale, (int, float)) or not (
                math.isfinite(self.probe_scale) and 0 < self.probe_scale <= 1):
            raise ValueError(f"probe_scale: expected a number in (0, 1], got {self.probe_scale!r}")
        if not isinstance(self.antithetic, bool):
            raise ValueError(f"antithetic: expected a bool, got {self.antithetic!r}")
        for name in ("noise_draws", "wd_probes", "group_layers"):
            value = getattr(self, name)
            if not (value is None and name == "group_layers") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: expected a positive int{' or None' if name == 'group_layers' else ''}, "
                                 f"got {value!r}")


DEFAULT_ROUND = RoundSettings()  # what a round takes unless given its own (the test suite's conftest lowers its draws)


def measured_formats(layers: Mapping[str, SNIPLinear]) -> dict[str, frozenset[Format]]:
    """fqn -> the formats a round measures the layer in: those its shape allows, and a pinned layer only
    in its pin (bf16: none). A plan never moves a pinned layer, so its other formats' LD and WD were
    never used (the planner, the evidence, the gradient-noise guard skip pinned layers): they read +inf,
    and a large pinned LM head costs the round nothing."""
    return {fqn: frozenset({layer.pinned}) if layer.pinned is not None else layer.allowed_formats
            for fqn, layer in layers.items()}


def run_statistics_round(model: torch.nn.Module, batch, loss_of: Callable[[object], torch.Tensor],
                         layers: Mapping[str, SNIPLinear], config: SNIPConfig, *, optimizer=None, loss_scale: float = 1.0,
                         propagation: Propagation | None = None, first_order_history=None,
                         generator: Callable[[], torch.Generator] | torch.Generator | None = None,
                         on_exact: Callable[[], None] | None = None, settings: RoundSettings | None = None,
                         collective: Collective = SINGLE_PROCESS) -> DivergenceResult | None:
    """One statistics round: ``batch`` sliced to ``config.max_rows`` rows (``loss_of(sliced)`` is its loss),
    recorded (collect_stats; under fp16 a loss scale that overflows is lowered by 2^8 as often as it takes, down
    to 1, instead of losing the round), LD and WD estimated with ``config``'s formats and recipe, and the result
    averaged over ``collective``'s ranks: None when the round failed on another rank; this rank's failure is
    raised after every rank has reached the average (each sends NaN for a failed round). The model's buffers are
    left as they were found.

    ``generator``: the random source of the curvature probes and stochastic rounding, or a function
    returning a fresh one: then an attempt repeated with exact propagation (where the model has no
    forward-mode derivatives, probes switch to exact once, loudly, and ``on_exact`` is called at once,
    so the caller keeps exact even if the repeat fails) draws what a round configured exact draws.
    ``propagation``: WD's propagated term (probe unless given); ``settings``: the estimator's (None: DEFAULT_ROUND,
    read at the call)."""
    failure, result = None, None
    try:
        sliced = slice_batch(batch, config.max_rows)
        result = _estimated_round(model, lambda: loss_of(sliced), layers, config, optimizer, loss_scale,
                                  propagation, first_order_history, generator, on_exact,
                                  DEFAULT_ROUND if settings is None else settings)
    except Exception as err:  # noqa: BLE001 - re-raised below, once every rank has reached the average
        if collective.world_size <= 1:
            raise
        failure = err
    reduced = reduce_result(result, list(layers), config.candidate_formats, collective)
    if failure is not None:
        raise failure
    return reduced


def _estimated_round(model, loss_fn, layers, config: SNIPConfig, optimizer, loss_scale: float, propagation,
                     first_order_history, generator, on_exact, settings: RoundSettings) -> DivergenceResult:
    """This rank's round: record, then estimate; probes switch to exact once where the model has no forward-mode
    derivatives."""
    propagation = Propagation.PROBE if propagation is None else Propagation(propagation)
    result = None
    with buffers_restored(model):  # the recording pass and every noise re-run
        while result is None:
            stats = _collect(model, loss_fn, layers, optimizer, loss_scale, propagation)
            try:
                result = estimate_divergence(
                    stats, config.candidate_formats, recipe=config.recipe, noise_draws=settings.noise_draws,
                    first_order_history=first_order_history or {}, allowed=measured_formats(layers),
                    generator=generator() if callable(generator) else generator, probes=settings.wd_probes,
                    group_layers=settings.group_layers, probe_scale=settings.probe_scale,
                    antithetic=settings.antithetic)
            except ForwardModeUnsupportedError as err:
                if stats.sharded or propagation is Propagation.EXACT:
                    raise
                # Once, loudly, and for the rest of the run: not a failure per round.
                logger.warning("SNIP: %s. Switching WD's propagated term to exact vector-Jacobian products for "
                               "the rest of the run (one per layer: a round's cost grows with depth squared).", err)
                propagation = Propagation.EXACT
                if on_exact is not None:
                    on_exact()
            finally:
                stats.release()
    return replace(result, probe_rel_stderr=probe_rel_stderr(result))


def _collect(model, loss_fn, layers, optimizer, loss_scale: float, propagation: Propagation):
    while True:
        stats = collect_stats(model, loss_fn, layers=layers, optimizer=optimizer, loss_scale=loss_scale,
                              propagation=propagation)
        finite = all(torch.isfinite(s.g).all() for s in stats.layers.values())
        if finite or loss_scale <= 1.0:
            return stats
        stats.release()
        loss_scale = max(1.0, loss_scale / 256.0)


@contextlib.contextmanager
def buffers_restored(module: torch.nn.Module):
    """The round's forward passes leave the module's buffers as they found them (BatchNorm running
    statistics, counters a forward updates); attributes outside buffers are the module's own."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


_warned_no_adam = False


def estimate_divergence(
    stats: Statistics,
    formats: Iterable[Format],
    *,
    recipe: QuantRecipe = QuantRecipe(),
    noise_draws: int = NOISE_DRAWS,
    first_order_history: Mapping[tuple[str, Format], list[float]] | None = None,
    allowed: Mapping[str, Iterable[Format]] | None = None,
    generator: torch.Generator | None = None,
    probes: int = WD_PROBES,
    precision: RoundPrecision = RoundPrecision.TRAINING,
    group_layers: int | None = None,
    probe_scale: float = PROBE_SCALE,
    antithetic: bool = ANTITHETIC,
) -> DivergenceResult:
    """The round's estimate: LD and WD for every recorded layer and each of ``formats`` (LD unclamped).

    Args:
        stats: a statistics pass (its graph is used for the VJPs and the noise passes).
        formats: candidate low-precision formats (bf16 gets 0 for both metrics).
        noise_draws: error-probe passes per FP4 format averaged for LD's second-order term.
        first_order_history: (fqn, format) -> the first-order terms of other batches
            (first_order.FirstOrderTerms), averaged with this round's.
        allowed: fqn -> formats the layer supports; others get +inf (never chosen).
        generator: the random source of the curvature probes and stochastic rounding.
        probes: forward-mode probes of WD's propagated term when ``stats`` was collected with
            Propagation.PROBE (relative standard error per layer <= sqrt(2 / probes)).
        precision: the dtype of the round's GEMM operands (RoundPrecision).
        group_layers: the most layers of one shape whose quantizers and GEMMs run as one batched call
            (lightning_snip.groups: the same numbers, fewer launches); None: the device's default.
        probe_scale, antithetic: the error probe's (curvature.error_probe_second_order).

    A layer whose sample holds NaN/Inf, or whose metric comes out non-finite, gets +inf for its
    low-precision formats (the planner then keeps it high) and a warning naming it.
    """
    global _warned_no_adam
    _check_group_layers(group_layers)
    formats = [f for f in dict.fromkeys(formats) if f is not Format.BF16]
    precision = RoundPrecision(precision)
    valid, invalid = _valid_formats(stats, formats, allowed)
    used_adam = all(a is not None for a in stats.param_adam.values())
    if not used_adam and not _warned_no_adam:
        logger.warning("weight divergence: optimizer keeps no Adam moments for every parameter; using plain gradient errors (A = 1)")
        _warned_no_adam = True
    # this rank's part of each state, once (FSDP2: the moments' local shards)
    adam = {name: state.local() if used_adam and (state := stats.param_adam.get(name)) is not None else None
            for name in stats.param_names}
    inputs = RoundInputs(
        stats=stats, formats=tuple(formats), recipe=recipe, adam=adam,
        denominator=update_energy(stats, adam, precision) or 1.0, loss_norm=abs(stats.loss) if stats.loss else 1.0,
        first_order_history=first_order_history or {}, generator=generator, precision=precision,
        group_layers=group_layers)
    forward = forward_divergence(inputs, valid, noise_draws, probe_scale=probe_scale, antithetic=antithetic)
    invalid.extend(forward.invalid)
    # Backward (WD) of what the forward kept: the dgrad errors E_X of every (layer, format), drawn before any
    # propagation (one order of stochastic-rounding draws for both Propagation modes), then each layer's wgrad error.
    measured = {fqn: [f for f in fmts if (fqn, f) not in forward.dropped] for fqn, fmts in valid.items()}
    backward = backward_divergence(inputs, measured, probes)
    layers = {fqn: _layer_divergence(fqn, formats, valid.get(fqn), forward, backward, invalid) for fqn in stats.layers}
    if invalid:
        # One line per round, not one per layer (a GPU round once printed 199 of them).
        shown = ", ".join(f"{fqn} ({fmt.value})" for fqn, fmt in invalid[:6])
        logger.warning("non-finite statistics or divergence: %d (layer, format) marked invalid and left out of plans: "
                       "%s%s", len(invalid), shown, ", ..." if len(invalid) > 6 else "")
    return DivergenceResult(layers=layers, loss=stats.loss, used_adam=used_adam)


_FORWARD_FIELDS = ("first_order", "first_stderr", "first_accumulated", "first_accumulated_stderr", "second_order",
                   "rel_error_forward", "abs_error_forward")
_BACKWARD_FIELDS = ("wd_direct", "wd_propagated", "wd_propagated_stderr", "rel_error_wgrad", "abs_error_wgrad")


def _layer_divergence(fqn: str, formats: list[Format], measured: list[Format] | None, forward: ForwardEstimate,
                      backward: Mapping[tuple[str, Format], BackwardParts], invalid: list) -> LayerDivergence:
    """One layer's LayerDivergence from its named parts: WD = direct + propagated; a format the layer does not
    allow, or whose parts are not finite, +inf (a non-finite one joins ``invalid``); ``measured`` None: the layer's
    sample was not finite (only LD and WD, +inf)."""
    inf = {fmt: math.inf for fmt in formats}
    if measured is None:
        return LayerDivergence(loss_divergence={Format.BF16: 0.0, **inf}, weight_divergence={Format.BF16: 0.0, **inf})
    fields = {name: {Format.BF16: 0.0} for name in ("loss_divergence", "weight_divergence",
                                                     *_FORWARD_FIELDS, *_BACKWARD_FIELDS)}
    for fmt in formats:
        loss_divergence = weight_divergence = math.inf
        if fmt in measured and (fqn, fmt) not in forward.dropped:
            forward_parts, backward_parts = forward.parts[fqn, fmt], backward[fqn, fmt]
            for name in _FORWARD_FIELDS:
                if (value := getattr(forward_parts, name)) is not None:
                    fields[name][fmt] = value
            for name in _BACKWARD_FIELDS:
                fields[name][fmt] = getattr(backward_parts, name)
            loss_divergence, weight_divergence = forward_parts.loss_divergence, backward_parts.weight_divergence
            if not (math.isfinite(loss_divergence) and math.isfinite(weight_divergence)):
                if (fqn, fmt) not in invalid:
                    invalid.append((fqn, fmt))
                loss_divergence = weight_divergence = math.inf
        fields["loss_divergence"][fmt], fields["weight_divergence"][fmt] = loss_divergence, weight_divergence
    return LayerDivergence(**fields)


def _check_group_layers(group_layers: int | None) -> None:
    """estimate_divergence's ``group_layers``: None (the device's default, groups.layer_groups) or an int >= 1."""
    if group_layers is not None and (not isinstance(group_layers, int) or isinstance(group_layers, bool)
                                     or group_layers < 1):
        raise ValueError(f"group_layers: invalid value {group_layers!r}; allowed: an integer >= 1, or None")


def _valid_formats(stats: Statistics, formats: list[Format], allowed) -> tuple[dict[str, list[Format]], list]:
    """fqn -> the formats to measure for each layer whose sample is finite (on every rank), and the
    (fqn, format) candidates of the others (invalid)."""
    finite = {fqn: bool(all_finite(s.x) and all_finite(s.g)
                        and all_finite(s.weight.to_local() if is_sharded(s.weight) else s.weight))
              for fqn, s in stats.layers.items()}
    if stats.sharded and finite:
        # Every rank runs the same all-gathers below, layer by layer: agree on which layers take part.
        like = a_sharded_weight(stats)
        flags = all_reduce_sum(torch.tensor([float(not f) for f in finite.values()], device=like.device), like)
        finite = {fqn: float(flag) == 0.0 for fqn, flag in zip(finite, flags.cpu())}
    valid, invalid = {}, []
    for fqn in stats.layers:
        if finite[fqn]:
            valid[fqn] = formats if allowed is None else [f for f in formats if f in set(allowed[fqn])]
        else:
            invalid.extend((fqn, f) for f in formats if allowed is None or f in set(allowed[fqn]))
    return valid, invalid


def probe_rel_stderr(result: DivergenceResult) -> float | None:
    """Median relative standard error of the probed propagated term over (layer, format); None when
    the round computed it exactly (no spread) or nothing was probed."""
    ratios = sorted(layer.wd_propagated_stderr[f] / layer.wd_propagated[f] for layer in result.layers.values()
                    for f in layer.wd_propagated_stderr if f is not Format.BF16 and layer.wd_propagated.get(f, 0) > 0
                    and math.isfinite(layer.wd_propagated_stderr[f]))
    if not ratios or ratios[-1] == 0:
        return None
    return ratios[len(ratios) // 2]


def round_generator(device: torch.device, step: int, rank: int) -> torch.Generator:
    """The curvature probes' random source for one round: a function of (step, rank) only, so a
    resumed run draws what the uninterrupted one drew, and ranks draw independently."""
    return torch.Generator(device=device).manual_seed(0x5A1B + 1_000_003 * step + rank)

