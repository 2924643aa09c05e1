"""Plan: an immutable fqn -> Format mapping with its FLOPs accounting. Pure Python (no torch)."""

from __future__ import annotations

import dataclasses

import enum
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from lightning_snip.formats import DEFAULT_RELATIVE_COST, Choice, Format


class Granularity(Choice):
    """What a plan gives a format to: a layer (its three GEMMs), or each GEMM direction of a layer
    (the forward GEMM; the backward ones, dgrad and wgrad, together)."""

    LAYER = "layer"
    GEMM = "gemm"


FORWARD, BACKWARD = "forward", "backward"


def gemm_key(fqn: str, direction: str) -> str:
    """A per-GEMM plan's key for one layer's forward or backward GEMMs: ``<fqn>:<direction>``."""
    return f"{fqn}:{direction}"


def split_key(key: str) -> tuple[str, str | None]:
    """(fqn, FORWARD | BACKWARD) for a per-GEMM key, (key, None) for a layer key."""
    fqn, sep, direction = key.rpartition(":")
    if sep and fqn and direction in (FORWARD, BACKWARD):
        return fqn, direction
    return key, None


class SolveStatus(enum.Enum):
    OPTIMAL = "optimal"  # proven optimal by the solver
    FEASIBLE = "feasible"  # meets every constraint; the solver ran out of time before proving optimality
    HEURISTIC = "heuristic"  # a baseline policy or a hand-made plan: meets the target, no optimality claim


@dataclass(frozen=True, eq=False)
class Plan(Mapping[str, Format]):
    """A format per layer, with each layer's FLOPs per step and the cost model it was made under.

    Args:
        formats: fqn -> Format.
        flops: fqn -> FLOPs of the layer's three GEMMs per step (6 * tokens * m * k); sets the weight
            of each layer in ``fp4_fraction`` and ``relative_cost``.
        relative_cost: Format -> GEMM cost relative to bf16.
        policy: who made it ("snip", "random", ...).
        status, objective, solve_seconds: what the solver reported.
        extra_cost: key -> Format -> relative cost per FLOP the layer's recipe adds to the format's own there (the
            RHT on an FP4 wgrad: formats.hadamard_backward_cost); in ``relative_gemm_cost``.
        noise_guarded: fqn -> the FP4 formats the gradient-noise guard kept out of the layer's
            backward (SNIPConfig.noise_guard_threshold; at granularity layer, out of the whole layer); the table
            marks these layers.
    """

    formats: Mapping[str, Format]
    flops: Mapping[str, float]
    relative_cost: Mapping[Format, float] = field(default_factory=lambda: dict(DEFAULT_RELATIVE_COST))
    policy: str = "snip"
    status: SolveStatus = SolveStatus.HEURISTIC
    objective: float | None = None
    solve_seconds: float = 0.0
    noise_guarded: Mapping[str, tuple[Format, ...]] = field(default_factory=dict)
    extra_cost: Mapping[str, Mapping[Format, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        formats = {fqn: Format.parse(f, field_name=f"formats[{fqn}]") for fqn, f in self.formats.items()}
        flops = {fqn: float(v) for fqn, v in self.flops.items()}
        if set(formats) != set(flops):
            raise ValueError(f"flops: must list exactly the planned layers; differs on {sorted(set(formats) ^ set(flops))}")
        costs = {Format.parse(k, field_name="relative_cost"): float(v) for k, v in self.relative_cost.items()}
        object.__setattr__(self, "formats", MappingProxyType(formats))
        object.__setattr__(self, "flops", MappingProxyType(flops))
        object.__setattr__(self, "relative_cost", MappingProxyType(costs))
        extra = {key: {Format.parse(f, field_name=f"extra_cost[{key}]"): float(v) for f, v in per.items()}
                 for key, per in self.extra_cost.items()}
        bad = {key: per for key, per in extra.items() if key not in formats or not all(0 <= v < float("inf") for v in per.values())}
        if bad:
            raise ValueError(f"extra_cost: must be finite numbers >= 0 for planned keys, got {dict(list(bad.items())[:3])}")
        object.__setattr__(self, "extra_cost", MappingProxyType({k: MappingProxyType(v) for k, v in extra.items()}))
        guarded = self.noise_guarded
        if not isinstance(guarded, Mapping):  # a plain collection of fqns: every FP4 format
            guarded = {fqn: tuple(f for f in Format if f.is_fp4) for fqn in guarded}
        object.__setattr__(self, "noise_guarded", MappingProxyType(
            {fqn: tuple(Format.parse(f, field_name=f"noise_guarded[{fqn}]") for f in fmts) for fqn, fmts in guarded.items()}))

    def __getitem__(self, fqn: str) -> Format:
        return self.formats[fqn]

    def __iter__(self) -> Iterator[str]:
        return iter(self.formats)

    def __len__(self) -> int:
        return len(self.formats)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Plan):
            return dict(self.formats) == dict(other.formats)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    @property
    def fp4_fraction(self) -> float:
        """Share of the planned layers' linear FLOPs that run in an FP4 format."""
        total = self.total_flops
        return sum(self.flops[f] for f, fmt in self.formats.items() if fmt.is_fp4) / total if total else 0.0

    @property
    def relative_gemm_cost(self) -> float:
        """GEMM cost of the plan relative to running every planned layer in bf16."""
        total = self.total_flops
        return sum(self.flops[f] * (self.relative_cost[fmt] + self.extra_cost.get(f, {}).get(fmt, 0.0))
                   for f, fmt in self.formats.items()) / total if total else 0.0

    def count(self, fmt: Format) -> int:
        return sum(1 for f in self.formats.values() if f is fmt)

    def changes_from(self, other: "Plan | None") -> list[str]:
        """fqns whose format differs from ``other`` (all of them when other is None)."""
        if other is None:
            return list(self.formats)
        return [f for f, fmt in self.formats.items() if other.formats.get(f) is not fmt]

    def to_json(self) -> str:
        return json.dumps(
            {
                "formats": {f: fmt.value for f, fmt in self.formats.items()},
                "flops": dict(self.flops),
                "relative_cost": {fmt.value: c for fmt, c in self.relative_cost.items()},
                "policy": self.policy,
                "status": self.status.value,
                "objective": self.objective,
                "solve_seconds": self.solve_seconds,
                "noise_guarded": {fqn: [f.value for f in fmts] for fqn, fmts in self.noise_guarded.items()},
                "extra_cost": {key: {f.value: v for f, v in per.items()} for key, per in self.extra_cost.items()},
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        return cls(
            formats=data["formats"],
            flops=data["flops"],
            relative_cost=data["relative_cost"],
            policy=data["policy"],
            status=SolveStatus(data["status"]),
            objective=data["objective"],
            solve_seconds=data["solve_seconds"],
            noise_guarded=data.get("noise_guarded", {}),  # absent in plans saved before the guard
            extra_cost=data.get("extra_cost", {}),  # absent in plans saved before the RHT was priced
        )

    def table(self, *, max_rows: int | None = None) -> str:
        """A fixed-width text table: one row per layer, then the totals. With more rows than
        ``max_rows``, the rows in the plan's most common format (unless noise-guarded) are counted in
        one line instead (a 211-layer model's plan shows the exceptions)."""
        width = max([len("layer")] + [len(f) for f in self.formats])
        total = self.total_flops or 1.0
        lines = [f"{'layer':<{width}}  format  flops share", f"{'-' * width}  ------  -----------"]
        common = None
        if max_rows is not None and len(self.formats) > max_rows:
            common = max(Format, key=lambda f: sum(v is f for v in self.formats.values()))
        shown = []
        for key, fmt in self.formats.items():
            fqn, direction = split_key(key)
            mark = ""
            if fqn in self.noise_guarded and direction != FORWARD:
                kept_out = "/".join(f.value for f in self.noise_guarded[fqn])
                mark = f"  (noise guard: no {kept_out}{' backward' if direction == BACKWARD else ''})"
            if fmt is common and not mark:
                continue
            shown.append(key)
            lines.append(f"{key:<{width}}  {fmt.value:<6}  {100 * self.flops[key] / total:10.2f}%" + mark)
        if common is not None:
            rows = [k for k, v in self.formats.items() if v is common and k not in shown]
            share = sum(self.flops[k] for k in rows) / total
            lines.append(f"{f'(the other {len(rows)} rows)':<{width}}  {common.value:<6}  {100 * share:10.2f}%")
        counts = ", ".join(f"{fmt.value} {self.count(fmt)}" for fmt in Format if self.count(fmt))
        per_gemm = any(split_key(key)[1] is not None for key in self.formats)
        lines.append(
            f"policy {self.policy} ({self.status.value}); {'GEMM directions' if per_gemm else 'layers'}: {counts}; "
            f"FP4 FLOPs fraction "
            f"{self.fp4_fraction:.3f}; relative GEMM cost {self.relative_gemm_cost:.3f}"
            + (f"; noise guard: {len(self.noise_guarded)} layer{'s' if len(self.noise_guarded) != 1 else ''}"
               if self.noise_guarded else "")
        )
        return "\n".join(lines)


def reverted_plan(plan: Plan | None, formats: Mapping[str, str]) -> Plan | None:
    """``plan`` with ``formats`` (plan key -> format name) put back (its other keys as they were)."""
    if plan is None:
        return None
    return dataclasses.replace(plan, formats={**plan.formats, **{
        key: Format(fmt) for key, fmt in formats.items() if key in plan.formats}})
