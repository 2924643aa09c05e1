"""SNIPConfig: the callback's settings, a frozen keyword-only dataclass (the library's schema).

The Hydra app (lightning_snip.train) composes it with its own model, data and trainer configs;
every field can be overridden on the command line, e.g. ``snip.fp4_fraction=0.8 snip.interval=20``.
Choices are typed as their Enums (formats.Choice: OmegaConf takes ``snip.initial_format=fp8`` by
value); a library user may pass the names as strings too, which ``__post_init__`` (run by
OmegaConf.to_object) turns into the Enums. Errors name the field as this class has it
(``fp4_fraction: ...``); the app adds its ``snip.`` prefix. Each default is written here only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_snip.divergence import Curvature8Bit, CurvatureProbe, LossEstimator
from lightning_snip.drift import Pricing
from lightning_snip.stats import Propagation
from lightning_snip.formats import CostModel, Format, Fp8Scaling, QuantRecipe, Rounding
from lightning_snip.plan import Granularity
from lightning_snip.planner import DEFAULT_WEIGHT_DIVERGENCE_WEIGHT

FP8_SCALING_AUTO = "auto"  # SNIPConfig.fp8_scaling: the faster FP8 scaling on the run's device

DEFAULT_PINS = ("*lm_head=bf16",)
"""SNIPConfig's default pins: the LM head in bf16 (a model without an ``lm_head`` simply has none to pin)."""


def _parse_pins(pins, field_name: str = "pins") -> dict[str, str]:
    """Pins as a mapping glob -> format, from a mapping or a list of "glob=format" strings."""
    if isinstance(pins, Mapping):
        return {str(k): v for k, v in pins.items()}
    if isinstance(pins, str) or not isinstance(pins, Sequence):
        raise ValueError(f"{field_name}: invalid value {pins!r}; allowed: a mapping glob -> format, or a list of "
                         "'glob=format' strings such as ['*lm_head=bf16']")
    out = {}
    for i, item in enumerate(pins):
        pattern, sep, fmt = str(item).rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"{field_name}[{i}]: {item!r} is not 'glob=format'; e.g. '*lm_head=bf16'")
        out[pattern.strip()] = fmt.strip()
    return out


def check_field(condition: bool, name: str, value, allowed: str) -> None:
    """Raise ValueError naming the field, the bad value and what is allowed, unless ``condition``."""
    if not condition:
        raise ValueError(f"{name}: invalid value {value!r}; allowed: {allowed}")


def _parse_fp8_scaling(value):
    """An Fp8Scaling (as Choice.parse reads it: its value or its name, any case), or "auto": resolved on the
    run's device (lightning_snip.callback.resolve_fp8_scaling)."""
    if isinstance(value, str) and not isinstance(value, Fp8Scaling) and value.strip().lower() == FP8_SCALING_AUTO:
        return FP8_SCALING_AUTO
    try:
        return Fp8Scaling.parse(value, field_name="fp8_scaling")
    except ValueError:
        raise ValueError(f"fp8_scaling: invalid value {value!r}; allowed: rowwise, tensorwise or auto") from None


def _check_counts_and_targets(cfg: "SNIPConfig") -> None:
    """SNIPConfig's integer counts, its FP4 target and its positive numbers (the first checks of __post_init__)."""
    for name in ("interval", "max_rows", "first_order_rows", "wd_probes", "drift_probes"):
        value = getattr(cfg, name)
        check_field(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, value, "an integer > 0")
    for name in ("warmup_steps", "apply_delay", "noise_draws", "first_order_steps"):
        value = getattr(cfg, name)
        check_field(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name, value, "an integer >= 0")
    check_field(cfg.max_consecutive_failures is None or (isinstance(cfg.max_consecutive_failures, int) and not isinstance(
        cfg.max_consecutive_failures, bool) and cfg.max_consecutive_failures > 0),
        "max_consecutive_failures", cfg.max_consecutive_failures, "an integer > 0, or null (never raise)")
    check_field(cfg.round_group_layers is None or (isinstance(cfg.round_group_layers, int) and not isinstance(
        cfg.round_group_layers, bool) and cfg.round_group_layers > 0),
        "round_group_layers", cfg.round_group_layers, "an integer > 0, or null (the device's default)")
    check_field(cfg.apply_delay < cfg.interval, "apply_delay", cfg.apply_delay, f"an integer < interval ({cfg.interval})")
    if (cfg.fp4_fraction is None) == (cfg.cost_budget is None):
        raise ValueError(
            f"fp4_fraction / cost_budget: set exactly one (the other null); got "
            f"fp4_fraction={cfg.fp4_fraction!r}, cost_budget={cfg.cost_budget!r}"
        )
    if cfg.fp4_fraction is not None:
        check_field(0.0 <= cfg.fp4_fraction <= 1.0, "fp4_fraction", cfg.fp4_fraction, "a number in [0, 1]")
    if cfg.cost_budget is not None:
        check_field(cfg.cost_budget > 0 and math.isfinite(cfg.cost_budget), "cost_budget", cfg.cost_budget, "a number > 0")
    for name in ("noise_scale", "time_limit_seconds"):
        value = getattr(cfg, name)
        check_field(value > 0, name, value, "a number > 0")


@dataclass(frozen=True, kw_only=True)
class SNIPConfig:
    """SNIPCallback settings.

    Args:
        interval: steps between statistics rounds (each followed by a new plan).
        warmup_steps: first statistics round at this step; until then the initial format.
        apply_delay: a plan solved from the statistics of step t is applied at step t + apply_delay.
        fp4_fraction: share of linear FLOPs to run in FP4 (or give cost_budget instead).
        cost_budget: relative GEMM cost budget (all-bf16 = 1.0), instead of fp4_fraction.
        candidate_formats: formats the planner may choose among (bf16 is always possible).
        initial_format: format of unpinned layers until the first plan.
        include / exclude: fqn globs selecting the nn.Linear layers to switch.
        pins: fqn glob -> format kept fixed (the LM head in bf16 by default): a mapping, or a list of
            "glob=format" strings (the form Hydra overrides can write: ``snip.pins=[]`` clears them,
            ``'snip.pins=["*lm_head=bf16","*.attn.q=fp8"]'`` replaces them). A pin you write must match
            a converted layer (setup fails naming it); the default one may match none (a model whose
            head is not called ``lm_head``).
        extra_pins: more pins in the same forms, added to ``pins``: how one is added from the command
            line without restating the defaults (``'snip.extra_pins=["*.attn.q=fp8"]'``); an
            extra pin wins over a ``pins`` entry with the same glob.
        max_rows: token rows in a statistics round (bounds its memory and time).
        curvature_probe: how LD's second-order term is estimated: error (the default: noise_draws
            passes per candidate format injecting each layer's own quantization error with a random
            sign per (layer, sample); one per layer for 2-D inputs, and where the first round finds
            the samples interacting), error_layer (one sign per layer, the method text's), fisher
            (the per-token empirical Fisher: no pass, a 20-27% cheaper round, steadier rounds, but a
            worse aggregate on the demo model) or gaussian (isotropic noise). See
            lightning_snip.divergence.CurvatureProbe.
        curvature_8bit: the 8-bit formats' (fp8, mxfp8) second-order term under the error probes:
            transfer (the default: each layer's curvature along its FP4 errors, no pass of their own;
            half the curvature passes at the default candidates) or probe (noise_draws passes per
            8-bit format too, the round until 2026-12-02). See lightning_snip.divergence.Curvature8Bit.
        noise_draws / noise_scale: curvature passes of the loss divergence (error, gaussian).
        round_group_layers: the most layers of one shape whose round quantizers and GEMMs run stacked as
            one batched call (the same numbers, fewer launches; lightning_snip.groups); 1: one layer at a
            time; null (the default): 16 on a GPU, 1 on a CPU (groups.default_group_layers).
        loss_estimator: how LD combines its first- and second-order terms (accumulated | batch |
            second_order | shrunk | momentum; lightning_snip.divergence.LossEstimator).
        first_order_steps: training steps before each statistics round whose batches also sample LD's
            first-order term (the ``accumulated`` estimator averages them with the round's own); at
            most the interval - 1 steps since the previous round.
        first_order_rows: token rows of each such step's batch sampled (spread over the batch). 1024
            by measurement (benchmarks/results/first_order_rows_2026-11-30.md): the term's noise
            was mostly the row sample; 256 -> 1024 rows raised LD's out-of-sample ranking per round
            from 0.52-0.83 to 0.62-0.90 and its round agreement from 0.44-0.75 to 0.59-0.91, at about
            8-11% wall on emulated FP4 steps (256: ~3%), 25% against high-precision steps (256: 6.5%),
            at interval 100. An upper bound: rows are strided, so n/2 to n are sampled.
        wd_propagation: how WD's propagated term is computed: probe (forward-mode random probes, a
            round's cost linear in depth, one module's parameters of extra memory at a time) or exact
            (one vector-Jacobian product per layer: quadratic in depth, holds the round's graph and a
            copy of every gradient; for small models). See lightning_snip.stats.Propagation.
        wd_probes: forward-mode probes per round (probe): the propagated term's relative standard
            error per layer and round is at most sqrt(2 / wd_probes); rounds are aggregated after.
            4 by measurement: 8 ranked layers within 0.024 of 4 out of sample, at 1.3-1.4x the
            round's cost (benchmarks/results/round_settings_2026-11-30.md); 2 cost 0.85x the round
            and lose 0.025 of WD's ranking per round, 0.046 of its round agreement and 0.011 of the
            aggregate (round_settings_2026-12-03_probes.md).
        pricing: what a forward GEMM in a low format costs the plan: one_step (its LD) or horizon (LD +
            weight_divergence_weight x the forward error's drift of AdamW's updates over the interval,
            lightning_snip.drift.Pricing; the aggregate and TensorBoard's loss_divergence then hold
            that sum). horizon did not rank the benchmark's runs better (issue 33): not the default.
        drift_probes: shifted re-runs of the statistics slice per round under pricing=horizon.
        aggregate_decay: EMA decay of LD and WD over statistics rounds, in [0, 1); plans are solved on
            the aggregate (0: the last round alone). See lightning_snip.aggregate.
        class_shrinkage: how far each layer's aggregated LD and WD move toward the mean of its class
            (the same module in the first / inner / last blocks of its stack, per format;
            evidence.layer_classes) before the solve, in [0, 1]: 0 plans on each layer's own estimates,
            1 on the class means (evidence.shrink_to_class_means). Measured: no gain in training (issue 33).
        weight_divergence_weight: lambda in LD + lambda * WD (default 0.1, by measurement; the method
            text's 1 prices FP4 backward GEMMs too high: planner.DEFAULT_WEIGHT_DIVERGENCE_WEIGHT).
        time_limit_seconds: ILP solver limit; the best feasible plan is used after it.
        fp8_scaling: rowwise | tensorwise | auto (the faster of the two on the run's GPU, timed at fit
            start on the model's layer shapes where the GPU has FP8 GEMMs; rowwise where FP8 is
            emulated; lightning_snip.gemm.choose_fp8_scaling). fp4_grad_rounding: stochastic | nearest.
        relative_cost: format -> GEMM cost relative to bf16, overriding the defaults.
        granularity: layer (a format per layer) or gemm (a forward and a backward format per layer;
            the forward is 1/3 of a layer's GEMM FLOPs, dgrad + wgrad 2/3; LD prices the forward,
            WD the backward).
        replan: False freezes the initial plan (no statistics rounds): a fixed-precision run with
            the same layers converted, e.g. a baseline or the overhead reference.
        max_consecutive_failures: after this many statistics rounds or solves in a row failed, the
            callback raises with the cause (a run that can never plan stops early); null: warn and
            keep training on the last good plan, however many fail.
        noise_guard: the gradient-noise guard. Every round logs, per layer, the ratio of its weight
            gradient's norm to the norm of the error its FP4 backward adds (best FP4 candidate);
            with the guard on, a layer whose ratio is below ``noise_guard_threshold`` gets a
            non-FP4 backward at the next plan (the whole layer at granularity layer). Rule from
            Chmiel et al., "FP4 All the Way" (2025): FP4 training stops helping once the gradient
            norm falls below about sqrt(3) times the quantization noise.
        noise_guard_threshold: that threshold (sqrt(3) by default).
    """

    interval: int = 100
    warmup_steps: int = 50
    apply_delay: int = 1
    fp4_fraction: float | None = 0.75
    cost_budget: float | None = None
    candidate_formats: tuple[Format, ...] = (Format.FP8, Format.MXFP4)
    initial_format: Format = Format.FP8
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    pins: Any = field(default_factory=lambda: list(DEFAULT_PINS))  # Any: a list (as overrides write it) or a mapping
    extra_pins: Any = field(default_factory=list)
    max_rows: int = 1024
    curvature_probe: CurvatureProbe = CurvatureProbe.ERROR
    curvature_8bit: Curvature8Bit = Curvature8Bit.TRANSFER
    noise_draws: int = 2
    noise_scale: float = 0.1
    round_group_layers: int | None = None
    loss_estimator: LossEstimator = LossEstimator.ACCUMULATED
    first_order_steps: int = 32
    first_order_rows: int = 1024
    wd_propagation: Propagation = Propagation.PROBE
    wd_probes: int = 4
    pricing: Pricing = Pricing.ONE_STEP
    drift_probes: int = 4
    aggregate_decay: float = 0.5
    class_shrinkage: float = 0.0
    weight_divergence_weight: float = DEFAULT_WEIGHT_DIVERGENCE_WEIGHT
    time_limit_seconds: float = 10.0
    fp8_scaling: Any = Fp8Scaling.ROWWISE  # Any: an Fp8Scaling or "auto"
    fp4_grad_rounding: Rounding = Rounding.STOCHASTIC
    relative_cost: dict[str, float] = field(default_factory=dict)
    granularity: Granularity = Granularity.LAYER
    replan: bool = True
    max_consecutive_failures: int | None = 3
    noise_guard: bool = False
    noise_guard_threshold: float = math.sqrt(3.0)

    def __post_init__(self) -> None:
        _check_counts_and_targets(self)
        for name, choice in (("granularity", Granularity), ("curvature_probe", CurvatureProbe),
                             ("curvature_8bit", Curvature8Bit),
                             ("loss_estimator", LossEstimator), ("wd_propagation", Propagation), ("pricing", Pricing),
                             ("fp4_grad_rounding", Rounding)):
            object.__setattr__(self, name, choice.parse(getattr(self, name), field_name=name))
        object.__setattr__(self, "fp8_scaling", _parse_fp8_scaling(self.fp8_scaling))
        check_field(isinstance(self.aggregate_decay, (int, float)) and 0.0 <= self.aggregate_decay < 1.0,
                    "aggregate_decay", self.aggregate_decay, "a number in [0, 1)")
        check_field(isinstance(self.class_shrinkage, (int, float)) and not isinstance(self.class_shrinkage, bool)
                    and 0.0 <= self.class_shrinkage <= 1.0, "class_shrinkage", self.class_shrinkage, "a number in [0, 1]")
        check_field(isinstance(self.noise_guard, bool), "noise_guard", self.noise_guard, "true or false")
        check_field(isinstance(self.noise_guard_threshold, (int, float)) and not isinstance(self.noise_guard_threshold, bool)
                    and 0 < self.noise_guard_threshold < math.inf, "noise_guard_threshold", self.noise_guard_threshold,
                    "a finite number > 0")
        check_field(self.weight_divergence_weight >= 0, "weight_divergence_weight", self.weight_divergence_weight, "a number >= 0")
        object.__setattr__(self, "candidate_formats", tuple(Format.parse(f, field_name="candidate_formats")
                                                           for f in self.candidate_formats))
        object.__setattr__(self, "initial_format", Format.parse(self.initial_format, field_name="initial_format"))
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        # Kept as given (a list stays a list: TrainConfig's default instance is Hydra's schema, and a
        # list there is what lets an override replace the pins instead of merging into them).
        object.__setattr__(self, "pins", tuple(self.pins) if isinstance(self.pins, list) else self.pins)
        object.__setattr__(self, "extra_pins", tuple(self.extra_pins) if isinstance(self.extra_pins, list) else self.extra_pins)
        pin_formats = self.pin_formats
        candidates = self.candidate_formats
        check_field(bool(candidates), "candidate_formats", self.candidate_formats, "at least one of bf16, fp8, mxfp8, mxfp4, nvfp4")
        if self.fp4_fraction and not any(f.is_fp4 for f in candidates):
            raise ValueError(f"candidate_formats: {[f.value for f in candidates]} holds no FP4 format, but "
                             f"fp4_fraction={self.fp4_fraction}")
        for pattern, fmt in pin_formats.items():
            Format.parse(fmt, field_name=f"pins[{pattern}]")
        self.cost_model  # validates relative_cost

    @property
    def pin_formats(self) -> dict[str, str]:
        """``pins`` and ``extra_pins`` as one mapping glob -> format name."""
        return {**_parse_pins(self.pins), **_parse_pins(self.extra_pins, field_name="extra_pins")}

    @property
    def extra_pin_globs(self) -> frozenset[str]:
        """The globs ``extra_pins`` pins (an error about them names that field)."""
        return frozenset(_parse_pins(self.extra_pins, field_name="extra_pins"))

    @property
    def optional_pins(self) -> frozenset[str]:
        """The globs of ``pins`` that may match no layer: the default pins' while ``pins`` is the default
        (and extra_pins does not restate them); every pin a user wrote must match one."""
        if not (isinstance(self.pins, tuple) and self.pins == DEFAULT_PINS):
            return frozenset()
        return frozenset(_parse_pins(self.pins)) - frozenset(_parse_pins(self.extra_pins, field_name="extra_pins"))

    @property
    def formats(self) -> tuple[Format, ...]:
        """The candidate formats (``candidate_formats``)."""
        return self.candidate_formats

    @property
    def recipe(self) -> QuantRecipe:
        if self.fp8_scaling == FP8_SCALING_AUTO:
            raise RuntimeError("fp8_scaling: 'auto' has no recipe until it is resolved on the run's device "
                               "(SNIPCallback does at fit start; elsewhere call lightning_snip.callback.resolve_fp8_scaling)")
        return QuantRecipe(fp8_scaling=self.fp8_scaling, fp4_grad_rounding=self.fp4_grad_rounding)

    @property
    def cost_model(self) -> CostModel:
        return CostModel(self.relative_cost)
