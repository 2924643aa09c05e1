"""Number formats a switchable linear layer can run in, the knobs of their recipe, and their cost model.

No torch here: the planner and Plan use this module, and a plan can be solved offline from saved
metrics. The quantizers are in lightning_snip.quantize (and the grid maths and kernels beneath it).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


class _ByNameOrValue(enum.EnumMeta):
    """OmegaConf (Hydra) reads an enum-typed config field by member name (``Granularity["GEMM"]``);
    configs and command lines write the value (``snip.granularity=gemm``). Both are accepted: the
    name as it is, the value case-insensitively. (Written by hand: OmegaConf has no by-value hook.)"""

    def __getitem__(cls, name):
        try:
            return super().__getitem__(name)
        except KeyError:
            if isinstance(name, str):
                for member in cls:
                    if member.value == name.strip().lower():
                        return member
            raise


class Choice(enum.Enum, metaclass=_ByNameOrValue):
    """A configuration choice: an Enum whose value is the name configs and logs use."""

    @classmethod
    def parse(cls, value, *, field_name: str):
        """A member from itself, its value (case-insensitive) or its name; else ValueError naming the
        field, the bad value and the allowed values."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value]
            except KeyError:
                pass
        valid = ", ".join(m.value for m in cls)
        raise ValueError(f"{field_name}: invalid value {value!r}; allowed: {valid}")

    def __str__(self) -> str:
        return self.value


class Format(Choice):
    """A GEMM operand format. The value is the name used in configs and plans."""

    BF16 = "bf16"
    FP8 = "fp8"
    MXFP8 = "mxfp8"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"

    @classmethod
    def parse(cls, value: "Format | str", *, field_name: str = "format") -> "Format":
        """Turn a name (case-insensitive) or a Format into a Format; raise ValueError naming the field."""
        if isinstance(value, Format):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        valid = ", ".join(f.value for f in cls)
        raise ValueError(f"{field_name}: unknown format {value!r}; valid formats are: {valid}")

    @property
    def is_fp4(self) -> bool:
        return self in (Format.MXFP4, Format.NVFP4)

    @property
    def block_size(self) -> int | None:
        """Elements per shared scale along the contraction axis, or None for per-row/tensor scaling."""
        return _BLOCK_SIZES.get(self)


_BLOCK_SIZES = {Format.MXFP8: 32, Format.MXFP4: 32, Format.NVFP4: 16}

FP4_FORMATS = frozenset(f for f in Format if f.is_fp4)

DEFAULT_RELATIVE_COST: Mapping[Format, float] = MappingProxyType(
    {Format.BF16: 1.0, Format.FP8: 0.5, Format.MXFP8: 0.5, Format.MXFP4: 0.25, Format.NVFP4: 0.25}
)


def hadamard_backward_cost(in_features: int, out_features: int) -> float:
    """The price of the NVFP4 recipe's random Hadamard transform per FLOP of a layer's backward GEMMs (dgrad and
    wgrad, 4 T in out FLOPs for T tokens), in the cost model's units (a bf16 GEMM FLOP = 1.0): a 16x16 matmul per
    16 tokens on both wgrad operands, X (T x in) and G (T x out), 32 T (in + out) FLOPs, priced at the bf16 rate
    (Transformer Engine and torchao run it as a bf16 matmul fused with the amax: the hardware path, not this library's
    unfused fp32 transform; in units where bf16 = 1, as DEFAULT_RELATIVE_COST). 8 (in + out) / (in out): 0.028 on
    a 576 x 576 layer (11% of its FP4 backward's 0.25), 0.004 at 4096 x 4096. The recipe's 2D weight scales cost no
    GEMM time (one quantized weight serves the forward and the dgrad) and are not priced."""
    return 8.0 * (in_features + out_features) / (in_features * out_features)


class Rounding(Choice):
    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


class Fp8Scaling(Choice):
    """torchao.float8 scaling granularity for the FP8 format."""

    ROWWISE = "rowwise"  # one scale per row of the contraction axis (torchao's AXISWISE)
    TENSORWISE = "tensorwise"
    AUTO = "auto"  # SNIPConfig's choice only: the faster of the two on the run's device, resolved at fit start

    @classmethod
    def resolved(cls) -> tuple["Fp8Scaling", ...]:
        """The scalings a QuantRecipe can hold (AUTO is resolved to one of them before a recipe exists)."""
        return tuple(m for m in cls if m is not cls.AUTO)


class Fp8Dtype(Choice):
    """Element type of FP8 gradient operands (grid.fp8_dtype gives the torch dtype)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"


@dataclass(frozen=True, kw_only=True)
class QuantRecipe:
    """How each format quantizes: the knobs that are not the format itself.

    Args:
        fp8_scaling: rowwise (default) or tensorwise scales for Format.FP8.
        fp8_grad_dtype: element type of gradient operands under FP8 / MXFP8.
        fp4_grad_rounding: rounding of gradient operands in FP4 GEMMs (stochastic is unbiased).
        wgrad_hadamard: the FP4 formats whose wgrad GEMM takes the random Hadamard transform of the NVFP4 recipe
            on both operands along the token axis (lightning_snip.hadamard): NVFP4, the recipe's, and MXFP4
            (measured: its median layer's wgrad error 16% lower, 204 of 211 SmolLM2 layers,
            benchmarks/results/nvfp4_recipe_error_2026-12-06.md).
        nvfp4_weight_scales_2d: NVFP4 weights with one E4M3 scale per 16x16 tile (the recipe's), so the forward
            and the dgrad GEMM see one quantized weight; False: 1x16 blocks along each GEMM's contraction axis.
    """

    fp8_scaling: Fp8Scaling = Fp8Scaling.ROWWISE
    fp8_grad_dtype: Fp8Dtype = Fp8Dtype.E4M3
    fp4_grad_rounding: Rounding = Rounding.STOCHASTIC
    wgrad_hadamard: tuple[Format, ...] = (Format.MXFP4, Format.NVFP4)
    nvfp4_weight_scales_2d: bool = True

    @property
    def key(self) -> str:
        """The recipe as one string (from_key inverts it): what compiled graphs guard on and custom
        operators take (SNIPLinear, gemm.opaque_quantized_matmul)."""
        hadamard = "+".join(f.value for f in self.wgrad_hadamard)
        return (f"{self.fp8_scaling.value},{self.fp8_grad_dtype.value},{self.fp4_grad_rounding.value},"
                f"{hadamard},{int(self.nvfp4_weight_scales_2d)}")

    def uses_hadamard(self, fmt: "Format") -> bool:
        """Whether ``fmt``'s wgrad GEMM takes the random Hadamard transform."""
        return fmt in self.wgrad_hadamard

    def weight_scales_2d(self, fmt: "Format") -> bool:
        """Whether ``fmt`` quantizes weights with 16x16 tile scales (NVFP4 under ``nvfp4_weight_scales_2d``)."""
        return fmt is Format.NVFP4 and self.nvfp4_weight_scales_2d

    @classmethod
    def from_key(cls, key: str) -> "QuantRecipe":
        return _recipe_from_key(key)

    def __post_init__(self) -> None:
        for name, enum_type in (
            ("fp8_scaling", Fp8Scaling),
            ("fp8_grad_dtype", Fp8Dtype),
            ("fp4_grad_rounding", Rounding),
        ):
            value = getattr(self, name)
            if not isinstance(value, enum_type):
                try:
                    object.__setattr__(self, name, enum_type(value))
                except ValueError:
                    valid = ", ".join(e.value for e in enum_type if e is not Fp8Scaling.AUTO)
                    raise ValueError(f"{name}: invalid value {value!r}; valid: {valid}") from None
        if isinstance(self.wgrad_hadamard, str) or not isinstance(self.wgrad_hadamard, (tuple, list, frozenset, set)):
            raise ValueError(f"wgrad_hadamard: expected a list of FP4 formats, e.g. ['mxfp4', 'nvfp4'], got "
                             f"{self.wgrad_hadamard!r}")
        formats = []
        for value in self.wgrad_hadamard:
            try:
                fmt = Format.parse(value, field_name="wgrad_hadamard")
            except (ValueError, TypeError):
                fmt = None
            if fmt is None or not fmt.is_fp4:
                raise ValueError(f"wgrad_hadamard: invalid value {value!r}; allowed: FP4 formats (mxfp4, nvfp4)")
            formats.append(fmt)
        object.__setattr__(self, "wgrad_hadamard", tuple(sorted(set(formats), key=lambda f: f.value)))
        if not isinstance(self.nvfp4_weight_scales_2d, bool):
            raise ValueError(f"nvfp4_weight_scales_2d: expected True or False, got {self.nvfp4_weight_scales_2d!r}")
        if self.fp8_scaling is Fp8Scaling.AUTO:
            raise ValueError("fp8_scaling: 'auto' is SNIPConfig's choice, resolved on the run's device; a QuantRecipe "
                             "takes rowwise or tensorwise (lightning_snip.callback.resolve_fp8_scaling)")


@dataclass(frozen=True)
class CostModel:
    """Relative GEMM cost of each format (bf16 = 1.0), a hardware throughput model."""

    relative_cost: Mapping[Format, float] = field(default_factory=lambda: dict(DEFAULT_RELATIVE_COST))

    def __post_init__(self) -> None:
        costs = {Format.parse(k, field_name="relative_cost"): float(v) for k, v in self.relative_cost.items()}
        missing = [f.value for f in Format if f not in costs]
        if missing:
            costs = {**DEFAULT_RELATIVE_COST, **costs}
        for fmt, cost in costs.items():
            if not cost > 0 or cost != cost:
                raise ValueError(f"relative_cost[{fmt.value}]: must be a positive number, got {cost!r}")
        object.__setattr__(self, "relative_cost", MappingProxyType(costs))

    def cost(self, fmt: Format) -> float:
        return self.relative_cost[fmt]


@functools.lru_cache(maxsize=None)
def _recipe_from_key(key: str) -> QuantRecipe:
    # Cached: the compiled backward's opaque GEMM (gemm.opaque_quantized_matmul) parses it every call.
    scaling, grad_dtype, rounding, hadamard, scales_2d = key.split(",")
    return QuantRecipe(fp8_scaling=scaling, fp8_grad_dtype=grad_dtype, fp4_grad_rounding=rounding,
                       wgrad_hadamard=tuple(hadamard.split("+")) if hadamard else (),
                       nvfp4_weight_scales_2d=bool(int(scales_2d)))
