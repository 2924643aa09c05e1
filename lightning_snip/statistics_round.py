"""One statistics round, as the controller runs it and the benchmarks measure it: record a high-precision pass
over a slice of the batch (lightning_snip.stats), estimate LD and WD per (layer, format)
(lightning_snip.divergence) with a SNIPConfig's settings, and return them unclamped for the aggregate.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
import logging
import math
from collections.abc import Callable, Mapping

import torch

from lightning_snip.config import SNIPConfig
from lightning_snip.divergence import DivergenceResult, estimate_divergence
from lightning_snip.formats import Format
from lightning_snip.linear import SNIPLinear
from lightning_snip.probes import ForwardModeUnsupportedError
from lightning_snip.stats import Propagation, collect_stats

# The round's estimator settings, fixed by their studies (docs/configuration.md, "Removed options (2026-12-04)"):
NOISE_DRAWS = 2  # error-probe passes of LD's second-order term per FP4 format
WD_PROBES = 4  # forward-mode probes of WD's propagated term

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundSettings:
    """The estimator's settings of a round: fixed for users by their studies, varied by benchmarks by argument (never
    by patching this module). ``noise_draws``: error-probe passes of LD's second-order term per FP4 format;
    ``wd_probes``: forward-mode probes of WD's propagated term; ``group_layers``: the most layers of one shape batched
    into one call (None: the device's default, lightning_snip.groups). The rows a round takes are a user's setting,
    SNIPConfig.max_rows."""

    noise_draws: int = NOISE_DRAWS
    wd_probes: int = WD_PROBES
    group_layers: int | None = None

    def __post_init__(self) -> None:
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


def run_statistics_round(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], layers: Mapping[str, SNIPLinear],
                         config: SNIPConfig, *, optimizer=None, loss_scale: float = 1.0,
                         propagation: Propagation | None = None, first_order_history=None,
                         generator: Callable[[], torch.Generator] | torch.Generator | None = None,
                         on_exact: Callable[[], None] | None = None,
                         settings: RoundSettings | None = None) -> DivergenceResult:
    """One statistics round as the controller runs it: record (collect_stats; under fp16 a loss scale
    that overflows is lowered by 2^8 as often as it takes, down to 1, instead of losing the round),
    estimate LD and WD with ``config``'s settings, and return the result with LD unclamped (rounds and
    ranks are averaged before the planner's clamp at 0: clamping each one first would bias noisy layers
    upwards). The model's buffers are left as they were found.

    ``generator``: the random source of the curvature probes and stochastic rounding, or a function
    returning a fresh one: then an attempt repeated with exact propagation (where the model has no
    forward-mode derivatives, probes switch to exact once, loudly, and ``on_exact`` is called at once,
    so the caller keeps exact even if the repeat fails) draws what a round configured exact draws.
    ``propagation``: WD's propagated term (probe unless given); ``settings``: the estimator's (None: DEFAULT_ROUND,
    read at the call)."""
    cfg = config
    settings = DEFAULT_ROUND if settings is None else settings
    propagation = Propagation.PROBE if propagation is None else Propagation(propagation)
    result = None
    with buffers_restored(model):  # the recording pass and every noise re-run
        while result is None:
            stats = _collect(model, loss_fn, layers, optimizer, loss_scale, propagation)
            try:
                result = estimate_divergence(
                    stats, cfg.formats, recipe=cfg.recipe, noise_draws=settings.noise_draws,
                    first_order_history=first_order_history or {}, allowed=measured_formats(layers),
                    generator=generator() if callable(generator) else generator, probes=settings.wd_probes,
                    group_layers=settings.group_layers)
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
    return DivergenceResult(
        layers={fqn: dataclasses.replace(d, loss_divergence=d.unclamped_loss_divergence()) for fqn, d in result.layers.items()},
        loss=result.loss, used_adam=result.used_adam)


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


def probe_rel_stderr(result: DivergenceResult) -> float | None:
    """Median relative standard error of the probed propagated term over (layer, format); None when
    the round computed it exactly (no spread) or nothing was probed."""
    ratios = sorted(d.wd_propagated_stderr[f] / d.wd_propagated[f] for d in result.layers.values()
                    for f in d.wd_propagated_stderr if f is not Format.BF16 and d.wd_propagated.get(f, 0) > 0
                    and math.isfinite(d.wd_propagated_stderr[f]))
    if not ratios or ratios[-1] == 0:
        return None
    return ratios[len(ratios) // 2]


def round_generator(device: torch.device, step: int, rank: int) -> torch.Generator:
    """The curvature probes' random source for one round: a function of (step, rank) only, so a
    resumed run draws what the uninterrupted one drew, and ranks draw independently."""
    return torch.Generator(device=device).manual_seed(0x5A1B + 1_000_003 * step + rank)

