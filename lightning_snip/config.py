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

from lightning_snip.formats import Choice, Format, Fp8Scaling, QuantRecipe
from lightning_snip.plan import Granularity
from lightning_snip.planner import DEFAULT_WEIGHT_DIVERGENCE_WEIGHT


DEFAULT_PINS = ("*lm_head=bf16",)
"""SNIPConfig's default pins: the LM head in bf16 (a model without an ``lm_head`` simply has none to pin). Beside
them, the default also pins the output head found by what it is, whatever its name (SNIPConfig.output_head_format)."""


class TargetScope(Choice):
    """What ``fp4_fraction`` is a share of.

    SWITCHABLE: the FLOPs of the layers a plan may change (converted and not pinned): what a user asking for
    "75% in FP4" means when the LM head is pinned in bf16; the whole model's share is reported beside it.
    A model whose pinned head is most of its FLOPs (a small model with a large vocabulary) trains at the
    defaults. MODEL: every converted layer's FLOPs, pinned ones included (the meaning until 2026-12-04).
    """

    SWITCHABLE = "switchable"
    MODEL = "model"


REMOVED_FIELDS = {
    "apply_delay": "a plan applies at the step after its round (budget.APPLY_DELAY)",
    "first_order_rows": "the first-order sample takes max_rows rows per step",
    "noise_draws": "fixed at 2 (statistics_round.NOISE_DRAWS)",
    "wd_probes": "fixed at 4 (statistics_round.WD_PROBES)",
    "aggregate_decay": "fixed at 0.5 (aggregate.DECAY)",
    "cost_budget": "the target is fp4_fraction (planner.solve_plan(cost_budget=) keeps the cost form)",
    "relative_cost": "the target is fp4_fraction (planner.solve_plan(relative_cost=) keeps the cost model)",
    **dict.fromkeys(("loss_estimator", "curvature_probe", "curvature_8bit", "noise_scale", "pricing", "drift_probes",
                     "class_shrinkage", "wd_propagation", "round_group_layers", "time_limit_seconds",
                     "fp4_grad_rounding"), "it lost its study"),
}
"""Settings removed on 2026-12-04 (issue 53) -> what the library does instead (docs/configuration.md, "Removed
options"): a config that still sets one fails with this, not a bare unknown-keyword error."""


def removed_field_message(name: str, prefix: str = "") -> str:
    return (f"{prefix}{name}: removed on 2026-12-04: {REMOVED_FIELDS[name]}; see docs/configuration.md, "
            "'Removed options (2026-12-04)'")


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


def _check_counts_and_targets(cfg: "SNIPConfig") -> None:
    """SNIPConfig's integer counts, its FP4 target and its positive numbers (the first checks of __post_init__)."""
    for name in ("interval", "max_rows"):
        value = getattr(cfg, name)
        check_field(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, value, "an integer > 0")
    for name in ("warmup_steps", "first_order_steps"):
        value = getattr(cfg, name)
        check_field(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name, value, "an integer >= 0")
    check_field(cfg.max_consecutive_failures is None or (isinstance(cfg.max_consecutive_failures, int) and not isinstance(
        cfg.max_consecutive_failures, bool) and cfg.max_consecutive_failures > 0),
        "max_consecutive_failures", cfg.max_consecutive_failures, "an integer > 0, or null (never raise)")
    check_field(isinstance(cfg.fp4_fraction, (int, float)) and not isinstance(cfg.fp4_fraction, bool)
                and 0.0 <= cfg.fp4_fraction <= 1.0, "fp4_fraction", cfg.fp4_fraction, "a number in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class SNIPConfig:
    """SNIPCallback settings, by group; docs/configuration.md gives each one's meaning and the study behind
    its default.

    Schedule: the first statistics round at ``warmup_steps``, its plan applied at the next step (the solve runs
        in a background thread meanwhile); the next rounds at least ``interval`` steps apart and as far apart as keeps SNIP's measured time within
        ``overhead_budget`` of training's (null: every ``interval`` steps; lightning_snip.budget);
        ``replan=False`` freezes the initial plan (no rounds).
    Target: ``fp4_fraction`` of the linear FLOPs in FP4, as a share of the switchable (unpinned) layers' FLOPs
        (``target_scope=switchable``) or of every converted layer's (``model``); ``granularity``: a format
        per layer's GEMM direction (``gemm``: forward, and dgrad + wgrad) or per layer (``layer``).
    Formats: the ``candidate_formats`` a plan chooses among (bf16 always possible), ``initial_format``
        until the first plan, the ``include`` / ``exclude`` globs of the nn.Linear layers converted, ``pins``
        (glob=format kept fixed; default: the LM head in bf16, by its name or found by what it is) and
        ``extra_pins`` added to them, and the FP8 scaling (``rowwise``, ``tensorwise`` or ``auto``: the faster
        on the run's GPU). The NVFP4 training recipe's knobs: ``wgrad_hadamard``, the FP4 formats whose wgrad GEMM
        takes the random Hadamard transform, and ``nvfp4_weight_scales_2d``, NVFP4 weights with 16x16 tile scales
        (lightning_snip.formats.QuantRecipe).
    Estimator: ``max_rows`` token rows per round (and per step of LD's first-order sample, taken on up to
        ``first_order_steps`` steps before each round: fewer as the budget requires); the objective LD +
        ``weight_divergence_weight`` x WD. The estimator's other settings are fixed by their studies
        (lightning_snip.statistics_round, lightning_snip.aggregate).
    Guard: ``plan_canary`` checks each layer's training GEMMs against the round's path right after a plan
        is applied and at every round, and puts a layer that disagrees back at once (lightning_snip.canary);
        ``spike_threshold`` (null: off) reverts a plan whose loss, after it, rises above the trend before it
        (a CUSUM reaching two steps at that many standard deviations, or a longer smaller rise, confirmed on the
        same batch), or goes non-finite (lightning_snip.spike_guard);
        ``noise_guard_threshold`` (null: off) keeps FP4 out of the backward of a layer whose weight
        gradient is below that multiple of its FP4 error; ``max_consecutive_failures`` rounds or solves in a
        row that gave no plan stop the run (null: never).
    """

    # schedule
    interval: int = 100
    warmup_steps: int = 50
    replan: bool = True
    overhead_budget: float | None = 0.02
    # target
    fp4_fraction: float = 0.75
    target_scope: TargetScope = TargetScope.SWITCHABLE
    granularity: Granularity = Granularity.GEMM
    # formats
    candidate_formats: tuple[Format, ...] = (Format.FP8, Format.NVFP4)  # nvfp4 from a study: docs/configuration.md
    initial_format: Format = Format.FP8
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    pins: Any = field(default_factory=lambda: list(DEFAULT_PINS))  # Any: a list (as overrides write it) or a mapping
    extra_pins: Any = field(default_factory=list)
    fp8_scaling: Fp8Scaling = Fp8Scaling.ROWWISE  # AUTO: the faster on the run's device, resolved at fit start
    # the NVFP4 training recipe's knobs (QuantRecipe): the wgrad GEMM's random Hadamard transform, 2D weight scales
    wgrad_hadamard: tuple[Format, ...] = (Format.MXFP4, Format.NVFP4)
    nvfp4_weight_scales_2d: bool = True
    # estimator
    max_rows: int = 1024
    first_order_steps: int = 32
    weight_divergence_weight: float = DEFAULT_WEIGHT_DIVERGENCE_WEIGHT
    # guard
    spike_threshold: float | None = 6.0
    plan_canary: bool = True
    noise_guard_threshold: float | None = None
    max_consecutive_failures: int | None = 3

    def __new__(cls, *args, **kwargs):
        removed = [name for name in kwargs if name in REMOVED_FIELDS]
        if removed:
            raise TypeError(removed_field_message(removed[0]))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _check_counts_and_targets(self)
        for name, choice in (("granularity", Granularity), ("target_scope", TargetScope)):
            object.__setattr__(self, name, choice.parse(getattr(self, name), field_name=name))
        object.__setattr__(self, "fp8_scaling", Fp8Scaling.parse(self.fp8_scaling, field_name="fp8_scaling"))
        check_field(self.noise_guard_threshold is None or (
            isinstance(self.noise_guard_threshold, (int, float)) and not isinstance(self.noise_guard_threshold, bool)
            and 0 < self.noise_guard_threshold < math.inf), "noise_guard_threshold", self.noise_guard_threshold,
            "a finite number > 0 (1.732, sqrt(3), is the rule's), or null (the guard off)")
        check_field(isinstance(self.replan, bool), "replan", self.replan, "true or false")
        check_field(isinstance(self.plan_canary, bool), "plan_canary", self.plan_canary, "true or false")
        check_field(self.overhead_budget is None or (
            isinstance(self.overhead_budget, (int, float)) and not isinstance(self.overhead_budget, bool)
            and 0 < self.overhead_budget < 1), "overhead_budget", self.overhead_budget,
            "a number in (0, 1) (a share of training time, 0.02 = 2%), or null (rounds every interval steps)")
        check_field(self.spike_threshold is None or (
            isinstance(self.spike_threshold, (int, float)) and not isinstance(self.spike_threshold, bool)
            and 0 < self.spike_threshold < math.inf), "spike_threshold", self.spike_threshold,
            "a finite number > 0 (standard deviations), or null (the guard off)")
        check_field(isinstance(self.weight_divergence_weight, (int, float)) and not isinstance(
            self.weight_divergence_weight, bool) and 0 <= self.weight_divergence_weight < math.inf,
            "weight_divergence_weight", self.weight_divergence_weight, "a finite number >= 0")
        for name, example in (("candidate_formats", "['fp8', 'mxfp4']"), ("include", "['*layers.*']"), ("exclude", "['*lm_head']")):
            value = getattr(self, name)  # (a bare string would be read as its characters)
            check_field(not isinstance(value, str) and isinstance(value, Sequence), name, value, f"a list, e.g. {example}")
            if name != "candidate_formats":
                check_field(all(isinstance(glob, str) for glob in value), name, value, f"a list of glob strings, e.g. {example}")
        object.__setattr__(self, "candidate_formats", tuple(Format.parse(f, field_name="candidate_formats")
                                                           for f in self.candidate_formats))
        object.__setattr__(self, "initial_format", Format.parse(self.initial_format, field_name="initial_format"))
        check_field(not isinstance(self.wgrad_hadamard, str) and isinstance(self.wgrad_hadamard, Sequence),
                    "wgrad_hadamard", self.wgrad_hadamard, "a list of FP4 formats, e.g. ['mxfp4', 'nvfp4'], or []")
        hadamard = tuple(dict.fromkeys(Format.parse(f, field_name="wgrad_hadamard") for f in self.wgrad_hadamard))
        check_field(all(f.is_fp4 for f in hadamard), "wgrad_hadamard", [f.value for f in hadamard],
                    "FP4 formats only (mxfp4, nvfp4), or []")
        object.__setattr__(self, "wgrad_hadamard", hadamard)
        check_field(isinstance(self.nvfp4_weight_scales_2d, bool), "nvfp4_weight_scales_2d",
                    self.nvfp4_weight_scales_2d, "true or false")
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
        extra = self.extra_pin_globs
        for pattern, fmt in pin_formats.items():
            Format.parse(fmt, field_name=f"{'extra_pins' if pattern in extra else 'pins'}[{pattern}]")

    @property
    def pin_formats(self) -> dict[str, str]:
        """``pins`` and ``extra_pins`` as one mapping glob -> format name."""
        pins, extra = _parse_pins(self.pins), _parse_pins(self.extra_pins, field_name="extra_pins")
        return {**{glob: fmt for glob, fmt in pins.items() if glob not in extra}, **extra}  # (extra_pins after pins)

    @property
    def extra_pin_globs(self) -> frozenset[str]:
        """The globs ``extra_pins`` pins (an error about them names that field)."""
        return frozenset(_parse_pins(self.extra_pins, field_name="extra_pins"))

    @property
    def optional_pins(self) -> frozenset[str]:
        """The globs of ``pins`` that may match no layer: the default pins' while ``pins`` is the default
        (and extra_pins does not restate them); every pin a user wrote must match one."""
        if not self._default_pins:
            return frozenset()
        return frozenset(_parse_pins(self.pins)) - frozenset(_parse_pins(self.extra_pins, field_name="extra_pins"))

    @property
    def output_head_format(self) -> Format | None:
        """bf16 while ``pins`` is the default: the model's output head, found by what it is whatever its name
        (GPT-NeoX's ``embed_out``, a Llama-style ``output``; lightning_snip.convert.find_output_head), is then
        pinned beside ``*lm_head`` unless a pin matches it. None once ``pins`` is written: a user who wrote
        pins gets exactly those (``extra_pins`` adds to the default and keeps it), and a setup warning where they
        leave that head switchable."""
        return Format.BF16 if self._default_pins else None

    @property
    def _default_pins(self) -> bool:
        # (A list equal to the default, as the app's schema holds it, is the default.)
        return isinstance(self.pins, tuple) and self.pins == DEFAULT_PINS

    @property
    def recipe(self) -> QuantRecipe:
        if self.fp8_scaling is Fp8Scaling.AUTO:
            raise RuntimeError("fp8_scaling: 'auto' has no recipe until it is resolved on the run's device "
                               "(SNIPCallback does at fit start; elsewhere call lightning_snip.callback.resolve_fp8_scaling)")
        return QuantRecipe(fp8_scaling=self.fp8_scaling, wgrad_hadamard=self.wgrad_hadamard,
                           nvfp4_weight_scales_2d=self.nvfp4_weight_scales_2d)
