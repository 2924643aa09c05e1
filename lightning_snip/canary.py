"""The plan canary: each layer's training GEMMs, as the applied plan runs them, checked on one slice of a batch.

The statistics round quantizes through its own path (gemm.quantized_matmul, called by the estimators), so a
fault on the training path alone (SNIPLinear's autograd function and the GEMMs it calls: a native FP4/FP8 kernel
on a GPU, an all-zero block) is invisible to it, and the loss shows such a fault late or never. The canary runs
right after a plan is applied and at every later round, before the step's own forward:

1. one high-precision forward and backward of a ``CANARY_ROWS``-row slice of the batch records each checked
   layer's input X and output gradient G (no parameter's ``.grad`` is touched: the gradients are taken with
   ``torch.autograd.grad`` with respect to the layers' outputs);
2. per layer, from (X, W, G), three versions of its three GEMMs: the training path (SNIPLinear's autograd
   function in the layer's formats, exactly as a training step calls it), the statistics path
   (gemm.quantized_matmul in the same formats: what the round's estimates assume), and high precision;
3. per GEMM direction, the training path's error against high precision is compared with the statistics path's
   on the same operands: the forward output's relative error, and for the backward the relative errors of dX
   and dW and the cosine between the planned and the high-precision weight gradient. A direction whose
   training path is more than ``RATIO`` times as far from high precision as the statistics path (plus a small
   floor, for stochastic rounding's own spread), or is not finite, fails.

The comparison is the round's prediction made on the canary's own operands: the same quantizers the round
priced the format with, on the same rows, so it is as tight as numerics allow (a native kernel differs from the
emulation by its accumulation order, far below the floor). Written by hand: torchao checks its kernels against
references in its tests, not inside a training run.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from lightning_snip.convert import apply_plan, high_precision, layer_assignment
from lightning_snip.formats import Format
from lightning_snip.gemm import quantized_matmul
from lightning_snip.linear import SNIPLinear, _SNIPLinearFunction
from lightning_snip.plan import BACKWARD, FORWARD, Granularity, gemm_key
from lightning_snip.rng import token_for
from lightning_snip.sharding import dense, is_sharded
from lightning_snip.statistics_round import buffers_restored

logger = logging.getLogger(__name__)

CANARY_ROWS = 128  # token rows of the slice the canary runs
RATIO = 3.0  # a training path this many times as far from high precision as the statistics path fails
FLOOR = 0.02  # plus this (relative error, 1 - cosine): stochastic rounding's spread between two draws


@dataclass(frozen=True)
class GemmCheck:
    """One layer's GEMM direction: its format, the training path's and the statistics path's distance from high
    precision (the larger of its measures, each a relative error or 1 - cosine), and whether it failed."""

    fqn: str
    direction: str
    format: Format
    training: float
    statistics: float
    detail: str

    @property
    def failed(self) -> bool:
        return not math.isfinite(self.training) or self.training > RATIO * self.statistics + FLOOR

    @property
    def ratio(self) -> float:
        """How many times as far from high precision the training path is as the statistics path (>= 0)."""
        if not math.isfinite(self.training):
            return math.inf
        return self.training / max(self.statistics, FLOOR / RATIO)


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    error = torch.linalg.vector_norm((value.double() - reference.double()).flatten())
    return float(error / torch.linalg.vector_norm(reference.double().flatten()).clamp_min(1e-30))


def _cosine_distance(value: torch.Tensor, reference: torch.Tensor) -> float:
    """1 - cosine (0 for the same direction, 2 for the opposite; 1 for a zero ``value``)."""
    a, b = value.double().flatten(), reference.double().flatten()
    norms = torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)
    if not torch.isfinite(norms):
        return math.inf
    return 1.0 - float(torch.dot(a, b) / norms) if norms > 0 else 1.0


def record_operands(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], layers: Mapping[str, SNIPLinear]
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """fqn -> (X, G) of one high-precision forward and backward of ``loss_fn`` (a sliced batch), rows flattened.
    The model's buffers, formats and parameter gradients are left as they were."""
    outputs: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}

    def hook(fqn):
        def record(module, args, output):
            inputs[fqn] = args[0].detach()
            outputs[fqn] = output
        return record

    handles = [layer.register_forward_hook(hook(fqn)) for fqn, layer in layers.items()]
    try:
        with high_precision(layers):
            loss = loss_fn()
            names = [fqn for fqn in layers if fqn in outputs and outputs[fqn].requires_grad]
            grads = torch.autograd.grad(loss, [outputs[fqn] for fqn in names], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return {fqn: (inputs[fqn].reshape(-1, layers[fqn].in_features),
                  grad.detach().reshape(-1, layers[fqn].out_features))
            for fqn, grad in zip(names, grads) if grad is not None}


def check_layer(layer: SNIPLinear, fqn: str, x: torch.Tensor, g: torch.Tensor, generator: torch.Generator,
                formats: tuple[Format, Format] | None = None) -> list[GemmCheck]:
    """The checks of ``layer``'s GEMM directions that are not bf16 (in ``formats``, (forward, backward), or the
    layer's own), from its recorded X and G."""
    forward_format, backward_format = formats or (layer.format, layer.backward_format or layer.format)
    if forward_format is Format.BF16 and backward_format is Format.BF16:
        return []
    recipe = layer.recipe
    weight = dense(layer.weight.detach()) if is_sharded(layer.weight) else layer.weight.detach()
    dtype = g.dtype if g.dtype in (torch.bfloat16, torch.float16) else x.dtype
    x, weight, g = x.to(dtype), weight.to(dtype), g.to(dtype)
    # the training path: SNIPLinear's autograd function, as a step calls it (on the Parameter itself where the step
    # multiplies it as it is: fp32, unsharded; autograd.grad leaves its .grad alone)
    own = layer.weight if (layer.weight.dtype == dtype and layer.weight.requires_grad and not is_sharded(layer.weight)) else None
    with torch.enable_grad():
        x_leaf, w_leaf = x.clone().requires_grad_(True), own if own is not None else weight.clone().requires_grad_(True)
        y_train = _SNIPLinearFunction.apply(x_leaf, w_leaf, None, forward_format, backward_format, recipe,
                                            token_for(generator), None, layer.rht_signs)
        dx_train, dw_train = torch.autograd.grad(y_train, (x_leaf, w_leaf), grad_outputs=g)
    y_train = y_train.detach()
    y_ref, dx_ref, dw_ref = x.float() @ weight.float().t(), g.float() @ weight.float(), g.float().t() @ x.float()
    checks = []
    if forward_format is not Format.BF16:
        y_stat = quantized_matmul(x, weight, forward_format, recipe=recipe, b_is_weight=True, out_dtype=torch.float32)
        train, stat = _relative_error(y_train, y_ref), _relative_error(y_stat, y_ref)
        checks.append(GemmCheck(fqn, FORWARD, forward_format, train, stat,
                                f"output relative error {train:.3g} (the round's path {stat:.3g})"))
    if backward_format is not Format.BF16:
        dx_stat = quantized_matmul(g, weight.t(), backward_format, recipe=recipe, a_is_grad=True, b_is_weight=True,
                                   generator=generator, out_dtype=torch.float32)
        dw_stat = quantized_matmul(g.t(), x.t(), backward_format, recipe=recipe, a_is_grad=True, generator=generator,
                                   hadamard=layer.rht_signs, out_dtype=torch.float32)
        measures = {
            "dgrad relative error": (_relative_error(dx_train, dx_ref), _relative_error(dx_stat, dx_ref)),
            "wgrad relative error": (_relative_error(dw_train, dw_ref), _relative_error(dw_stat, dw_ref)),
            "wgrad 1 - cosine": (_cosine_distance(dw_train, dw_ref), _cosine_distance(dw_stat, dw_ref)),
        }
        # the measure on which the training path stands furthest beyond its prediction decides
        name, (train, stat) = max(measures.items(), key=lambda item: (
            math.inf if not math.isfinite(item[1][0]) else item[1][0] - RATIO * item[1][1]))
        checks.append(GemmCheck(fqn, BACKWARD, backward_format, train, stat, f"{name} {train:.3g} (the round's path "
                                f"{stat:.3g})"))
    return checks


def run_canary(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], layers: Mapping[str, SNIPLinear], *,
               seed: int) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[GemmCheck]]:
    """Record the operands of ``layers`` (the unpinned, not all-bf16 ones) and check each; (operands, checks).
    ``seed`` seeds the stochastic rounding of both paths (the training's own random streams are not drawn)."""
    checked = {fqn: layer for fqn, layer in layers.items() if layer.pinned is None
               and (layer.format is not Format.BF16 or (layer.backward_format or layer.format) is not Format.BF16)}
    if not checked:
        return {}, []
    devices = [torch.device(p.device) for p in model.parameters()][:1]
    fork = torch.random.fork_rng(devices=[d for d in devices if d.type == "cuda"]) if devices else contextlib.nullcontext()
    with fork:
        operands = record_operands(model, loss_fn, checked)
    generator = torch.Generator(device=next(iter(operands.values()))[0].device if operands else "cpu").manual_seed(seed)
    checks = [c for fqn, (x, g) in operands.items() for c in check_layer(checked[fqn], fqn, x, g, generator)]
    return operands, checks


def _key(fqn: str, direction: str, granularity: Granularity) -> str:
    return gemm_key(fqn, direction) if granularity is Granularity.GEMM else fqn


@dataclass(frozen=True)
class CanaryVerdict:
    """What one canary found: ``checks`` (this rank's), ``failed`` (the checks that failed on some rank), and
    ``restore``, plan key -> the format each failed key goes back to (checked itself where it is not bf16)."""

    checks: list[GemmCheck]
    failed: list[GemmCheck]
    restore: dict[str, Format]

    @property
    def worst_ratio(self) -> float:
        return max((c.ratio for c in self.checks), default=0.0)

    @property
    def reason(self) -> str:
        """The failed GEMM directions, one clause each: layer, direction, format and what disagreed."""
        first: dict[tuple[str, str], GemmCheck] = {}  # (the first check of each direction)
        for check in self.failed:
            first.setdefault((check.fqn, check.direction), check)
        return "; ".join(f"{c.fqn} {c.direction} in {c.format.value}: {c.detail}" for c in first.values())


def _failed_on_any_rank(pairs: list[tuple[str, str]], checks: list[GemmCheck],
                        all_sum: Callable[[torch.Tensor], torch.Tensor]) -> set[tuple[str, str]]:
    """The (fqn, direction) pairs that failed on this rank or another (``pairs``: the same order on every rank)."""
    failed = {(c.fqn, c.direction) for c in checks if c.failed}
    flags = torch.tensor([float(pair in failed) for pair in pairs], dtype=torch.float64)
    total = all_sum(flags) if pairs else flags
    return {pair for pair, flag in zip(pairs, total.tolist()) if flag > 0}


def check_plan(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], layers: Mapping[str, SNIPLinear],
               granularity: Granularity, before: Mapping[str, Format], *, seed: int,
               all_sum: Callable[[torch.Tensor], torch.Tensor] = lambda values: values) -> CanaryVerdict:
    """Run the canary on the formats in force and decide, identically on every rank (``all_sum`` sums over ranks),
    what each failed GEMM direction goes back to: its format in ``before`` (plan key -> format before the last
    switch) when that differs and passes the canary on the same operands, else bf16 (the reference itself)."""
    granularity = Granularity(granularity)
    operands, checks = run_canary(model, loss_fn, layers, seed=seed)
    pairs = [(fqn, d) for fqn, layer in layers.items() if layer.pinned is None for d in (FORWARD, BACKWARD)]
    failed_pairs = _failed_on_any_rank(pairs, checks, all_sum)
    if not failed_pairs:
        return CanaryVerdict(checks, [], {})
    restore: dict[str, Format] = {}
    for fqn, direction in sorted(failed_pairs):
        layer = layers[fqn]
        current = layer.format if direction == FORWARD else (layer.backward_format or layer.format)
        fallback = before.get(_key(fqn, direction, granularity), Format.BF16)
        restore[_key(fqn, direction, granularity)] = fallback if fallback is not current else Format.BF16
    # a fallback that is not bf16 is checked on the same operands before it is trusted (both may be broken)
    trial = {}
    for fqn in {fqn for fqn, _ in failed_pairs}:
        formats = (restore.get(_key(fqn, FORWARD, granularity), layers[fqn].format),
                   restore.get(_key(fqn, BACKWARD, granularity), layers[fqn].backward_format or layers[fqn].format))
        if fqn in operands and any(f is not Format.BF16 for f in formats):
            trial[fqn] = formats
    generator = torch.Generator(device=next(iter(operands.values()))[0].device if operands else "cpu").manual_seed(seed + 1)
    retried = [c for fqn, formats in trial.items()
               for c in check_layer(layers[fqn], fqn, *operands[fqn], generator, formats=formats)]
    for fqn, direction in _failed_on_any_rank(pairs, retried, all_sum):
        restore[_key(fqn, direction, granularity)] = Format.BF16
    if granularity is Granularity.GEMM:  # a plan sets both directions of a layer: the other one as it is
        for fqn in {fqn for fqn, _ in failed_pairs}:
            restore.setdefault(gemm_key(fqn, FORWARD), layers[fqn].format)
            restore.setdefault(gemm_key(fqn, BACKWARD), layers[fqn].backward_format or layers[fqn].format)
    failed = [c for c in checks if (c.fqn, c.direction) in failed_pairs]
    return CanaryVerdict(checks, failed, restore)


def plan_cost(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], layers: Mapping[str, SNIPLinear],
              granularity: Granularity, previous: Mapping[str, str], *,
              all_sum: Callable[[torch.Tensor], torch.Tensor] = lambda values: values, world_size: int = 1) -> float:
    """``loss_fn()`` (a sliced batch's loss) under the formats in force minus under ``previous`` (plan key ->
    format name), forward only, averaged over ranks: what the plan's formats cost on this batch (the loss watch's
    measure, lightning_snip.spike_guard). The model's formats, buffers and random state are left as they were;
    both passes draw the same random numbers (dropout)."""
    current = {key: fmt for key, fmt in layer_assignment(layers, Granularity(granularity)).items() if key in previous}
    losses, failure = [0.0, 0.0], None
    with torch.no_grad(), buffers_restored(model):
        rng = torch.random.get_rng_state()
        try:
            losses[0] = float(loss_fn())
            apply_plan(model, previous)
            torch.random.set_rng_state(rng)
            losses[1] = float(loss_fn())
        except Exception as err:  # noqa: BLE001 - raised below on every rank, after the ranks' one collective
            failure = err
        finally:
            apply_plan(model, current)
            torch.random.set_rng_state(rng)
    # (a failure on one rank is every rank's: each takes the same fallback, and no rank skips the sum)
    total = all_sum(torch.tensor([*losses, float(failure is not None)], dtype=torch.float64))
    if failure is not None:
        raise failure
    if total[2] > 0:
        raise RuntimeError(f"the measure failed on {int(total[2])} other rank(s)")
    return float(total[0] - total[1]) / world_size
