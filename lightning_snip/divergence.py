"""Forward loss divergence LD and backward weight divergence WD per (layer, format).

docs/method.md sections 4 and 5. For layer l with recorded X, G, W and candidate format p:

    dY     = Q_p(X) Q_p(W)^T - X W^T
    LD     = <G, dY> + 1/2 kappa_l ||dY||^2,   kappa_l = <d_l, G'_l - G_l> / ||d_l||^2
             (G' from a pass with independent Gaussian noise d_l added to every layer's output)
    E_W    = Q_p(G)^T Q_p(X) - G^T X                     (wgrad error, this layer)
    E_X    = Q_p(G) Q_p(W) - G W                         (dgrad error, flows upstream)
    WD     = ( ||D_l(E_W)||^2 + sum_k ||D_k(J_kl(E_X))||^2 ) / sum_k ||u_k||^2

with u_k = lr m_hat_k / (sqrt(v_hat_k) + eps), AdamW's next update (its moments advanced by the
statistics batch's own gradient g_k, AdamState.after) and D_k(e) = u_k(g_k + e) - u_k(g_k), how far
that update moves when the gradient is off by e (AdamState.update_deviation), k over every trainable
parameter upstream of l (embeddings and norms too). The method text linearizes D_k(e) as
c_k A_k * e, A_k = 1/(sqrt(v_hat_k) + eps), c_k = lr (1 - beta1)/(1 - beta1^t); that is wrong where
v_hat is about 0 (1/eps amplifies the error; measured: bf16 rounding noise in the propagated term of
an embedding made WD 10-100x larger). Without Adam moments D(e) = e and u = g (plain gradient
errors). LD is normalized by the loss (a relative loss increase) so LD + lambda * WD adds two
dimensionless numbers.

Under FSDP2 (DTensor weights and AdamW state) every sum over parameter elements (the update energy,
the direct terms) is taken on this rank's shard and summed over ranks with one all-reduce (the sums
of squares are additive), weights are all-gathered one layer at a time, and each probe's tangent is
built from this rank's shard of AdamW's moments and all-gathered: with the same data on every rank the
numbers equal the unsharded ones up to float rounding (tests/test_fsdp.py); with different data, each
shard's part of a sum comes from its own rank's batch (an estimate of the same expectation as DDP's
average over ranks).

Where LD departs from the method text (LossEstimator; the default is ACCUMULATED): a plan needs the
*expected* loss increase, and one batch's first-order term <G, dY> is mostly that batch's noise
(signed, with a sampling error larger than its mean). ACCUMULATED averages the first-order term over
the statistics batch and the ``first_order_steps`` (32) training batches before the round
(FirstOrderSampler, 1024 rows of each), adds the round's second-order term (the error probe,
CurvatureProbe), and clamps at 0 so that no format looks better than high precision; the callback
then plans from an average over rounds (lightning_snip.aggregate). Measured out of sample (truths on
held-out batches no round saw; benchmarks/results/divergence_fidelity_*.md, first_order_rows_*.md,
curvature_signs_*.md), the method text's one-batch LD ranked layers at 0.31-0.72 (the demo and an
8-block model, mxfp4 and nvfp4) and two of its rounds agreed at -0.04-0.48; ACCUMULATED ranks at
0.62-0.92 per round, agrees at 0.59-0.91 between rounds, and the callback's aggregate of 4 rounds
ranks at 0.75-0.96 (medians over 4 rounds, 3 seeds); on Hugging Face's LlamaForCausalLM (6 blocks,
3 seeds) one batch ranks at 0.44-0.69, ACCUMULATED at 0.84-0.91 per round and 0.86-0.94 aggregated.
MOMENTUM (the weight part taken from AdamW's first moment) ranked at only 0.22-0.44 and is an option,
not the default.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from lightning_snip.adamw import AdamState
from lightning_snip.drift import DriftTerms, drift_terms, output_grad_tangents, sign_tangents
from lightning_snip.formats import Choice, Format, QuantRecipe, Rounding
from lightning_snip import kernels
from lightning_snip.gemm import Kernel, bmm_fp32, kernel_for, mm_fp32, operand_rounding, quantized_matmul
from lightning_snip.grid import random_bits
from lightning_snip.quantize import padded_numel
from lightning_snip.groups import (MAX_GROUP_LAYERS, default_group_layers, layer_groups, quantize_stack, stack,
                                   working_bytes)
from lightning_snip.sharding import all_reduce_sum, dense, is_sharded, local_part
from lightning_snip.stats import LayerStats, Propagation, RoundPrecision, Statistics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerDivergence:
    """One layer's metrics for each candidate format (bf16 is 0 by definition)."""

    loss_divergence: Mapping[Format, float]
    weight_divergence: Mapping[Format, float]
    first_order: Mapping[Format, float] = field(default_factory=dict)
    second_order: Mapping[Format, float] = field(default_factory=dict)
    wd_direct: Mapping[Format, float] = field(default_factory=dict)
    wd_propagated: Mapping[Format, float] = field(default_factory=dict)
    # Standard error of wd_propagated over the round's probes (Propagation.PROBE; 0 when exact).
    wd_propagated_stderr: Mapping[Format, float] = field(default_factory=dict)
    rel_error_forward: Mapping[Format, float] = field(default_factory=dict)
    rel_error_wgrad: Mapping[Format, float] = field(default_factory=dict)
    curvature: float = 0.0
    # Parts of the first-order term (relative to the loss), their sampling errors over the batch's
    # samples, the momentum form of the weight part, and absolute local error energies.
    first_weight: Mapping[Format, float] = field(default_factory=dict)
    first_activation: Mapping[Format, float] = field(default_factory=dict)
    first_stderr: Mapping[Format, float] = field(default_factory=dict)
    first_activation_stderr: Mapping[Format, float] = field(default_factory=dict)
    first_weight_momentum: Mapping[Format, float] = field(default_factory=dict)
    first_weight_momentum_stderr: Mapping[Format, float] = field(default_factory=dict)
    first_accumulated: Mapping[Format, float] = field(default_factory=dict)
    first_accumulated_stderr: Mapping[Format, float] = field(default_factory=dict)
    abs_error_forward: Mapping[Format, float] = field(default_factory=dict)
    abs_error_wgrad: Mapping[Format, float] = field(default_factory=dict)
    # The forward error's drift of AdamW's updates (lightning_snip.drift; only with drift_probes > 0).
    drift: Mapping[Format, "DriftTerms"] = field(default_factory=dict)

    def loss_divergence_as(self, estimator: "LossEstimator", *, clamp: bool = True) -> dict[Format, float]:
        """LD of every format under ``estimator`` from this round's parts (see LossEstimator).
        ``clamp=False`` keeps negative values: averages over rounds or ranks must be taken before
        the clamp, which would otherwise bias noisy layers upwards."""
        estimator = LossEstimator(estimator)
        out = {}
        for fmt, ld in self.loss_divergence.items():
            if fmt is Format.BF16 or not math.isfinite(ld) or fmt not in self.second_order:
                out[fmt] = ld
                continue
            out[fmt] = _combine_loss_divergence(
                estimator, first=self.first_order[fmt], first_stderr=self.first_stderr[fmt],
                first_activation=self.first_activation[fmt], first_activation_stderr=self.first_activation_stderr[fmt],
                first_weight_momentum=self.first_weight_momentum.get(fmt),
                first_weight_momentum_stderr=self.first_weight_momentum_stderr.get(fmt, math.inf),
                first_accumulated=self.first_accumulated.get(fmt),
                first_accumulated_stderr=self.first_accumulated_stderr.get(fmt, math.inf),
                second=self.second_order[fmt], clamp=clamp)
        return out


@dataclass(frozen=True)
class DivergenceResult:
    """Per (fqn, format) LD and WD, normalized so the planner can add them; plus the loss."""

    layers: Mapping[str, LayerDivergence]
    loss: float
    used_adam: bool

    def as_dict(self) -> dict:
        return {
            "loss": self.loss,
            "used_adam": self.used_adam,
            "layers": {
                fqn: {
                    "loss_divergence": {f.value: v for f, v in d.loss_divergence.items()},
                    "weight_divergence": {f.value: v for f, v in d.weight_divergence.items()},
                    "rel_error_wgrad": {f.value: v for f, v in d.rel_error_wgrad.items()},
                }
                for fqn, d in self.layers.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "DivergenceResult":
        layers = {
            fqn: LayerDivergence(
                loss_divergence={Format(k): float(v) for k, v in d["loss_divergence"].items()},
                weight_divergence={Format(k): float(v) for k, v in d["weight_divergence"].items()},
                rel_error_wgrad={Format(k): float(v) for k, v in d.get("rel_error_wgrad", {}).items()},
            )
            for fqn, d in data["layers"].items()
        }
        return cls(layers=layers, loss=float(data["loss"]), used_adam=bool(data["used_adam"]))


_warned_no_adam = False


class CurvatureProbe(Choice):
    """How the second-order term 1/2 dY^T H_Y dY of LD is estimated.

    GAUSSIAN: isotropic noise d_l in every layer's output; kappa_l = <d_l, G' - G>/||d_l||^2 and the
        term is 1/2 kappa_l ||dY||^2 (the curvature along a random direction, one pass per draw).
    ERROR: the quantization error itself with a random sign per layer *and sample*, eps_ls dY_s(l, p),
        in every layer at once; the term is 1/2 sum_s eps_ls <dY_s, G'_s - G_s> (the curvature along
        dY; one pass per draw and format). Cross-layer terms vanish in expectation because the signs
        are independent, but not in one draw. Where the forward pass never mixes samples and the loss
        is a sum over them (a batch-first causal LM), the Hessian has no term between two samples, and
        a sign per (layer, sample) keeps the expectation exact while each cross-layer term becomes a
        sum of independent per-sample terms, not the square of their sum. Measured on the fidelity
        benchmark's rounds (benchmarks/results/curvature_signs_2026-12-01.md, 12 cases): LD per round
        +0.017 and round agreement +0.028 on average, the aggregate unchanged, at equal cost; the
        probe's noise against the exact one-layer term fell 16-25% on an 8-block model and not
        beyond draw noise on the 4-block demo. Rows share a sign per sample where the layer's input
        had a leading dimension over token dimensions (3-D and up); a 2-D input (rows that may be
        tokens of one sequence: a flattened MLP input, an expert's routed tokens) keeps one sign for
        the layer, and so does a slice of one sample (a sequence longer than ``max_rows`` is cut to
        one prefix: then nothing changes). The first round checks that the leading dimension indexes
        independent samples (_samples_independent: one pass) and otherwise keeps one sign per layer.
    ERROR_LAYER: ERROR with one sign per layer for all rows (the method text's probe; the default until
        2026-12-01), without the check.
    FISHER: the empirical Fisher of the per-token losses in place of the Hessian, no pass at all: for a
        loss that is the mean of N per-token losses l_i (an LM's; N = the slice's token rows), the
        token's gradient is N G_i and 1/2 dY^T H dY ~ 1/2 (1/N) sum_i (N G_i . dY_i)^2
        = 1/2 N sum_i (G_i . dY_i)^2. Exact where each l_i = -log(a . y_i) (its Hessian is its
        gradient's outer product); it ignores the curvature between tokens (attention) and the part
        of the Hessian the Fisher lacks, and it is deterministic for a batch. Measured against ERROR
        (benchmarks/results/round_settings_2026-11-30.md, 12 rounds): the round 20-27% cheaper, LD
        per round ranks layers closer to the out-of-sample truth (+0.02-0.03, all 4 model/format
        pairs) and two rounds agree more (+0.05-0.12), but the aggregate over rounds that plans come
        from ranks worse on the demo model (-0.066 / -0.055; equal on the deeper one): its bias
        does not average out, ERROR's noise does. ERROR stays the default.
    """

    GAUSSIAN = "gaussian"
    ERROR = "error"
    ERROR_LAYER = "error_layer"
    FISHER = "fisher"


class LossEstimator(Choice):
    """How LD combines its first-order term F = <G, dY> and second-order term S = 1/2 dY^T H dY.

    BATCH: F + S of the statistics batch (the method text read literally).
    SECOND_ORDER: S alone.
    SHRUNK: F shrunk towards 0 by its sampling error over the batch's samples, F * max(0, 1 - se^2/F^2)
        (positive-part James-Stein), + S.
    MOMENTUM: the weight part of F taken in expectation, <m_hat, Q(W) - W> with AdamW's first moment
        m_hat (a running mean of recent batches' gradients), shrunk by its own noise (per element
        Var(m_hat) = (v_hat - m_hat^2) (1 - b1)(1 - b1^2t) / ((1 + b1)(1 - b1^t)^2), the variance of an
        EMA of independent gradients; a diagonal approximation: the covariance between elements is
        ignored), + the activation part of F shrunk as in SHRUNK, + S. Without Adam moments it falls
        back to SHRUNK.
    ACCUMULATED: F averaged over the statistics batch and the batches of the training steps before
        the round (FirstOrderSampler), + S: an unbiased estimate of the expected increase, whose
        noise falls like 1/sqrt(batches). (Shrinking that mean by its standard error ranked worse
        out of sample.) With no sampled steps it falls back to SHRUNK.
    Every estimator is clamped at 0: a negative estimate never makes a layer look better than
    high precision.
    """

    BATCH = "batch"
    SECOND_ORDER = "second_order"
    SHRUNK = "shrunk"
    MOMENTUM = "momentum"
    ACCUMULATED = "accumulated"


class Curvature8Bit(Choice):
    """LD's second-order term of the 8-bit formats (FP8, MXFP8) under the error probes.

    TRANSFER (the default since 2026-12-02, night): no curvature pass of their own. Each layer's
    curvature along its FP4 errors this round (their probed 1/2 dY^T H dY over ||dY||^2) times the
    8-bit format's ||dY||^2: quantization errors of the same GEMM, the second one 4-5 bits finer, so
    the quotient along one stands for the other. It halves the curvature passes at the default
    candidates (fp8, mxfp4). Measured on the deep8 demo and SmolLM2: 8-bit second-order terms are
    ~5% of the FP4 ones; plans solved on rounds with it priced out of sample like those solved with
    the probe (benchmarks/results/curvature_8bit_2026-12-02.md). Layers with no FP4 format in the
    round get the probe.
    PROBE: noise_draws error-probe passes per 8-bit format too (the round until then).
    """

    TRANSFER = "transfer"
    PROBE = "probe"


def _shrink(value: float, stderr: float) -> float:
    if value == 0.0 or not math.isfinite(stderr):
        return 0.0
    return value * max(0.0, 1.0 - (stderr / value) ** 2)


def _combine_loss_divergence(estimator: LossEstimator, *, first: float, first_stderr: float, first_activation: float,
                             first_activation_stderr: float, first_weight_momentum: float | None,
                             first_weight_momentum_stderr: float, first_accumulated: float | None = None,
                             first_accumulated_stderr: float = math.inf, second: float, clamp: bool = True) -> float:
    if estimator is LossEstimator.BATCH:
        value = first + second
    elif estimator is LossEstimator.SECOND_ORDER:
        value = second
    elif estimator is LossEstimator.ACCUMULATED and first_accumulated is not None:
        value = first_accumulated + second
    elif estimator in (LossEstimator.SHRUNK, LossEstimator.ACCUMULATED) or first_weight_momentum is None:
        value = _shrink(first, first_stderr) + second
    else:
        value = (_shrink(first_weight_momentum, first_weight_momentum_stderr)
                 + _shrink(first_activation, first_activation_stderr) + second)
    return max(0.0, value) if clamp else value


def estimate_divergence(
    stats: Statistics,
    formats: Iterable[Format],
    *,
    recipe: QuantRecipe = QuantRecipe(),
    noise_draws: int = 2,
    noise_scale: float = 0.1,
    curvature_probe: CurvatureProbe = CurvatureProbe.ERROR,
    loss_estimator: LossEstimator = LossEstimator.ACCUMULATED,
    first_order_history: Mapping[tuple[str, Format], list[float]] | None = None,
    allowed: Mapping[str, Iterable[Format]] | None = None,
    generator: torch.Generator | None = None,
    probes: int = 4,
    precision: RoundPrecision = RoundPrecision.TRAINING,
    drift_probes: int = 0,
    curvature_8bit: Curvature8Bit = Curvature8Bit.TRANSFER,
    group_layers: int | None = None,
) -> DivergenceResult:
    """LD and WD for every recorded layer and each of ``formats``.

    Args:
        stats: a statistics pass (its graph is used for the VJPs and the noise passes).
        formats: candidate low-precision formats (bf16 gets 0 for both metrics).
        noise_draws: noise-injected passes averaged for the curvature.
        noise_scale: (GAUSSIAN probe) noise std relative to each layer output's RMS.
        curvature_probe: see CurvatureProbe (``noise_draws`` and ``noise_scale`` do not apply to FISHER);
            ERROR ranked layers better than GAUSSIAN on the demo model
            (benchmarks/results/divergence_fidelity_*.md).
        loss_estimator: how LD combines its terms (see LossEstimator); every part is kept in the
            result, so ``LayerDivergence.loss_divergence_as`` gives the others from the same round.
        first_order_history: (fqn, format) -> the first-order terms of other batches (from
            ``FirstOrderTerms``), averaged with this round's for the ACCUMULATED estimator.
        allowed: fqn -> formats the layer supports; others get +inf (never chosen).
        probes: forward-mode probes of WD's propagated term when ``stats`` was collected with
            Propagation.PROBE (relative standard error per layer <= sqrt(2 / probes)); 4, as the
            callback's ``wd_probes`` (8 until 2026-12-01, when the callback had used 4 since 2026-11-30).
        precision: the dtype of the round's GEMM operands (RoundPrecision: as the training GEMMs
            ran, bf16 under bf16-mixed; or fp32).
        drift_probes: shifted re-runs of the slice measuring each forward error's drift of AdamW's
            updates (lightning_snip.drift; LayerDivergence.drift); 0 measures none.
        curvature_8bit: the 8-bit formats' second-order term under the error probes (Curvature8Bit).
        group_layers: the most layers of one shape whose quantizers and GEMMs run as one batched call
            (lightning_snip.groups: the same numbers, fewer launches); 1: one layer at a time (before
            2026-12-03); None: groups.default_group_layers of the statistics' device (1 on a CPU).

    A layer whose sample holds NaN/Inf, or whose metric comes out non-finite, gets +inf for its
    low-precision formats (the planner then keeps it high) and a warning naming it.
    """
    global _warned_no_adam
    group_layers = _resolved_group_layers(stats, group_layers)
    formats = [f for f in dict.fromkeys(formats) if f is not Format.BF16]
    curvature_probe = CurvatureProbe(curvature_probe)
    precision = RoundPrecision(precision)
    valid, invalid = _valid_formats(stats, formats, allowed)
    used_adam = all(a is not None for a in stats.param_adam.values())
    if not used_adam and not _warned_no_adam:
        logger.warning("weight divergence: optimizer keeps no Adam moments for every parameter; using plain gradient errors (A = 1)")
        _warned_no_adam = True
    adam = {name: stats.param_adam.get(name) if used_adam else None for name in stats.param_names}
    r = _RoundInputs(
        stats=stats, formats=tuple(formats), recipe=recipe, adam=adam, denominator=1.0,
        loss_norm=abs(stats.loss) if stats.loss else 1.0, loss_estimator=LossEstimator(loss_estimator),
        first_order_history=first_order_history or {}, generator=generator, invalid=invalid, precision=precision,
        group_layers=group_layers,
    )
    metrics = _initial_metrics(stats, formats, valid)
    r = dataclasses.replace(r, denominator=update_energy(stats, adam, precision) or 1.0)
    tangents = []
    if drift_probes:  # seeded from the round generator's seed without drawing from it (as the WD probes)
        seed = generator.initial_seed() if generator is not None else int(torch.randint(0, 2**62, ()))
        tangents = output_grad_tangents(stats, adam, drift_probes, seed, r.denominator)
    curvature, moments = _forward_divergence(r, valid, metrics, curvature_probe, noise_draws, noise_scale, tangents,
                                             Curvature8Bit(curvature_8bit))
    del tangents
    # Backward (WD): the dgrad errors E_X of every (layer, format), drawn before any propagation (one
    # order of stochastic-rounding draws for both Propagation modes), then each layer's wgrad error.
    direct = _backward_divergence(r, valid, metrics, probes)
    out = _layer_divergences(r, valid, metrics, moments, direct, curvature)
    return DivergenceResult(layers=out, loss=stats.loss, used_adam=used_adam)


def _resolved_group_layers(stats: Statistics, group_layers: int | None) -> int:
    """estimate_divergence's ``group_layers``, checked; None: the default of the statistics' device."""
    if group_layers is None:
        return default_group_layers(next((s.x.device for s in stats.layers.values()), "cpu"))
    if not isinstance(group_layers, int) or isinstance(group_layers, bool) or group_layers < 1:
        raise ValueError(f"group_layers: invalid value {group_layers!r}; allowed: an integer >= 1, or None")
    return group_layers


def _initial_metrics(stats: Statistics, formats: list[Format], valid: dict) -> dict:
    """fqn -> metric -> format -> value: bf16 free, a format a valid layer does not allow +inf."""
    metrics = {fqn: {k: {Format.BF16: 0.0} for k in _METRICS} for fqn in stats.layers}
    for fqn, fmts in valid.items():
        for fmt in formats:
            if fmt not in fmts:
                metrics[fqn]["ld"][fmt] = metrics[fqn]["wd"][fmt] = math.inf
    return metrics


def _layer_divergences(r: _RoundInputs, valid: dict, metrics: dict, moments: dict, direct: dict,
                       curvature: dict) -> dict[str, "LayerDivergence"]:
    """The round's LayerDivergence per layer: WD = direct + propagated, anything non-finite marked
    invalid (+inf, one warning per round)."""
    stats, formats = r.stats, r.formats
    out: dict[str, LayerDivergence] = {}
    for fqn, st in stats.layers.items():
        if fqn not in valid:
            out[fqn] = _invalid(formats)
            continue
        for fmt in valid[fqn]:
            m = metrics[fqn]
            m["direct"][fmt] = direct[fqn, fmt] / r.denominator
            wd = m["direct"][fmt] + m["prop"][fmt]
            if not math.isfinite(wd) or not math.isfinite(m["ld"][fmt]):
                if (fqn, fmt) not in r.invalid:
                    r.invalid.append((fqn, fmt))
                m["ld"][fmt] = wd = math.inf
            m["wd"][fmt] = wd
        if moments[fqn][0] is None:
            metrics[fqn]["first_mom"], metrics[fqn]["first_mom_se"] = {}, {}
        out[fqn] = _metrics_to_divergence(metrics[fqn], curvature.get(fqn, 0.0))
    if r.invalid:
        # One line per round, not one per layer (a GPU round once printed 199 of them).
        shown = ", ".join(f"{fqn} ({fmt.value})" for fqn, fmt in r.invalid[:6])
        logger.warning("non-finite statistics or divergence: %d (layer, format) marked invalid and left out of plans: "
                       "%s%s", len(r.invalid), shown, ", ..." if len(r.invalid) > 6 else "")
    return out


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, a 0-d bool tensor: from its min and max (one pass, NaN
    propagates into both), 15x faster on a CPU than isfinite(t).all(), which builds a bool copy of t."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def _valid_formats(stats: Statistics, formats: list[Format], allowed) -> tuple[dict[str, list[Format]], list]:
    """fqn -> the formats to measure for each layer whose sample is finite (on every rank), and the
    (fqn, format) candidates of the others (invalid)."""
    finite = {fqn: bool(_all_finite(s.x) and _all_finite(s.g)
                        and _all_finite(s.weight.to_local() if is_sharded(s.weight) else s.weight))
              for fqn, s in stats.layers.items()}
    if stats.sharded and finite:
        # Every rank runs the same all-gathers below, layer by layer: agree on which layers take part.
        like = _a_sharded_weight(stats)
        flags = all_reduce_sum(torch.tensor([float(not f) for f in finite.values()], device=like.device), like)
        finite = {fqn: float(flag) == 0.0 for fqn, flag in zip(finite, flags.cpu())}
    valid, invalid = {}, []
    for fqn, s in stats.layers.items():
        if finite[fqn]:
            valid[fqn] = formats if allowed is None else [f for f in formats if f in set(allowed[fqn])]
        else:
            invalid.extend((fqn, f) for f in formats if allowed is None or f in set(allowed[fqn]))
    return valid, invalid


def _forward_divergence(r: _RoundInputs, valid: dict, metrics: dict, curvature_probe: CurvatureProbe,
                        noise_draws: int, noise_scale: float, tangents=(),
                        curvature_8bit: Curvature8Bit = Curvature8Bit.TRANSFER) -> tuple[dict[str, float], dict]:
    """LD's parts of every valid (layer, format) into ``metrics`` (formats that turn out non-finite
    leave ``valid``); returns the GAUSSIAN probe's curvature per layer ({} for the others) and the
    Adam moments the MOMENTUM estimator used, per layer."""
    stats, precision, generator = r.stats, r.precision, r.generator
    # Layers of one shape (and the same formats) stacked: each quantizer and GEMM below runs once per
    # group, not once per layer (lightning_snip.groups; the same numbers).
    groups = _groups(r, stats.layers, valid)
    # Y = X W^T of every layer, computed once: the reference of every format's dY. One format at a time
    # below, so the round holds one format's dY of every layer (the error probe injects them all at once).
    references, rms = {}, {}
    for group in groups:
        xs, ws = _stacked_operands(r, group, "x"), _stacked_operands(r, group, "w")
        ys = bmm_fp32(xs, ws)
        del xs, ws
        if valid.get(group[0]):  # (every layer's output RMS; the references of measured layers only)
            references[tuple(group)] = ys
        rms.update(zip(group, ys.pow(2).mean(dim=(1, 2)).sqrt()))
        del ys
    output_rms = dict(zip(stats.layers, _read_scalars([rms[fqn] for fqn in stats.layers])))
    del rms
    curvature = {}
    # FISHER: the per-token losses the loss averages, taken as the most token rows any layer saw.
    tokens = max((st.num_rows for st in stats.layers.values()), default=0)
    if curvature_probe is CurvatureProbe.GAUSSIAN:
        curvature = _estimate_curvature(stats, output_rms, noise_draws, noise_scale, generator)
    # (FSDP2: m_hat is sharded; the MOMENTUM estimator's parts are not computed there.)
    moments = {fqn: _momentum_and_variance(None if stats.sharded else stats.layers[fqn].adam) for fqn in valid}
    transfer = curvature_8bit is Curvature8Bit.TRANSFER and curvature_probe in (CurvatureProbe.ERROR,
                                                                                CurvatureProbe.ERROR_LAYER)
    # TRANSFER: the FP4 formats first, so each layer's curvature along its FP4 errors is known when its
    # 8-bit formats come (stable sort: the configured order within each group).
    order = sorted(r.formats, key=lambda f: not f.is_fp4) if transfer else r.formats
    for fmt in order:
        errors, scalars, finite = {}, {}, {}
        for group in groups:
            if fmt in valid.get(group[0], ()):  # (a group's layers share their formats)
                _output_errors(r, group, fmt, references[tuple(group)], moments, errors, scalars, finite)
        keys = [(fqn, fmt) for fqn in stats.layers if (fqn, fmt) in errors]  # layer order: the probe's draws follow it
        output_errors = {key: errors[key] for key in keys}
        del errors
        _drop_non_finite(r, output_errors, fmt, valid, metrics, [finite[key] for key in keys])
        if curvature_probe is CurvatureProbe.GAUSSIAN:
            second_order = {(fqn, f): 0.5 * curvature.get(fqn, 0.0) * float(dy.pow(2).sum())
                            for (fqn, f), dy in output_errors.items()}
        elif curvature_probe is CurvatureProbe.FISHER:
            second_order = {(fqn, f): _fisher_second_order(stats.layers[fqn].g, dy, tokens)
                            for (fqn, f), dy in output_errors.items()}
        elif transfer and not fmt.is_fp4:
            second_order = _transferred_second_order(r, output_errors, fmt, metrics, noise_draws, generator,
                                                     per_sample=curvature_probe is CurvatureProbe.ERROR)
        else:
            second_order = error_probe_second_order(stats, output_errors, [fmt], noise_draws, generator,
                                                     per_sample=curvature_probe is CurvatureProbe.ERROR)
        if tangents:
            for (fqn, f), terms in drift_terms(stats, output_errors, tangents, r.denominator).items():
                metrics[fqn]["drift"][f] = terms
        # Every layer's scalars of this format read with one device transfer (a sync per value made a GPU
        # round wait ~10x per layer and format).
        flat = [(key, i) for key in output_errors for i in range(len(scalars[key]))]
        values = {key: [] for key in output_errors}
        for (key, _), value in zip(flat, _read_scalars([scalars[key][i] for key, i in flat])):
            values[key].append(value)
        for (fqn, _), dy in output_errors.items():
            _forward_metrics(r, stats.layers[fqn], fmt, values[fqn, fmt], dy.numel(), second_order[fqn, fmt],
                             output_rms[fqn], moments[fqn], metrics[fqn])
        del output_errors, scalars
    return curvature, moments


def _groups(r: _RoundInputs, fqns, valid: dict) -> list[list[str]]:
    """The round's groups of ``fqns`` (layer_groups): layers of one shape measured in the same formats, at
    most r.group_layers of them and MAX_GROUP_BYTES of their working_bytes."""
    return layer_groups(r.stats, fqns, r.precision, max_layers=r.group_layers,
                        extra_key=lambda fqn: tuple(valid.get(fqn, ())),
                        layer_bytes=lambda fqn: working_bytes(r.stats.layers[fqn], len(valid.get(fqn, ()))))


def _stacked_operands(r: _RoundInputs, group: list[str], which: str) -> torch.Tensor:
    """One operand (``which``: "x", "g" or "w") of a group's layers in the round's dtype, stacked
    (layers x rows x cols; a view for a group of one)."""
    stats, index = r.stats, "xgw".index(which)
    return stack([round_operands(stats, stats.layers[fqn], r.precision, weight=which == "w")[index] for fqn in group])


def _output_errors(r: _RoundInputs, group: list[str], fmt: Format, ys: torch.Tensor, moments: dict,
                   errors: dict, scalars: dict, finite: dict) -> None:
    """dY = Q(X) Q(W)^T - Y of a group's layers in ``fmt`` into ``errors`` (views of one stack), their
    finiteness (0-d bool tensors) into ``finite`` and the tensors of LD's parts into ``scalars``
    (_forward_metrics reads them): per layer, the first-order term's sum and sampling variance, those of
    its activation part, ||dY||, ||dY||^2, and with Adam moments <m_hat, dW> and <m_var, dW^2>."""
    stats, recipe = r.stats, r.recipe
    xs, ws = _stacked_operands(r, group, "x"), _stacked_operands(r, group, "w")
    q_w = quantize_stack(ws, fmt, recipe=recipe)
    if kernel_for(fmt, xs.device) is Kernel.EMULATED:
        dys = bmm_fp32(quantize_stack(xs, fmt, recipe=recipe), q_w) - ys
    else:  # a native GEMM per layer (its own casts; shapes it does not take are emulated inside)
        dys = stack([quantized_matmul(x, w, fmt, recipe=recipe, out_dtype=torch.float32) for x, w in zip(xs, ws)]) - ys
    gs = _stacked_operands(r, group, "g").float()
    # The weight part of dY: X (Q(W) - W)^T = X Q(W)^T - Y; its first-order term is <G^T X, Q(W) - W>.
    per_row = (gs * dys).sum(-1)
    per_row_w = (gs * (bmm_fp32(xs, q_w) - ys)).sum(-1)
    del xs, gs
    first = _sums_and_variances(per_row, stats.layers[group[0]].num_samples)
    first_x = _sums_and_variances(per_row - per_row_w, stats.layers[group[0]].num_samples)
    norms = torch.linalg.vector_norm(dys.flatten(1), dim=1).double()
    energies = dys.pow(2).sum(dim=(1, 2)).double()
    if dys[0].numel():
        low, high = torch.aminmax(dys.flatten(1), dim=1)  # (as _all_finite: NaN propagates into both)
        ok = torch.isfinite(low) & torch.isfinite(high)
    else:
        ok = torch.ones(len(group), dtype=torch.bool, device=dys.device)
    dw = q_w.float() - ws.float()
    m_hats = [moments[fqn][0] for fqn in group]
    m_vars = [moments[fqn][1] for fqn in group]
    mom = (stack(m_hats) * dw).sum(dim=(1, 2)).double() if all(m is not None for m in m_hats) else None
    mom_var = (stack(m_vars) * dw.pow(2)).sum(dim=(1, 2)).double() if all(v is not None for v in m_vars) else None
    for i, fqn in enumerate(group):
        key = (fqn, fmt)
        errors[key], finite[key] = dys[i], ok[i]
        scalars[key] = [*first[i], *first_x[i], norms[i], energies[i]]
        if m_hats[i] is not None:
            scalars[key].append(mom[i] if mom is not None else (m_hats[i] * dw[i]).sum().double())
        if m_vars[i] is not None:
            scalars[key].append(mom_var[i] if mom_var is not None else (m_vars[i] * dw[i].pow(2)).sum().double())


def _drop_non_finite(r: _RoundInputs, output_errors: dict, fmt: Format, valid: dict, metrics: dict,
                     finite: list[torch.Tensor]) -> None:
    """A non-finite output error (a quantizer fault) leaves the round for that (layer, format) only: the
    error probe injects every layer's dY into one forward pass, where one NaN would make every layer's
    second-order term NaN. ``finite``: each error's finiteness, in ``output_errors``' order. Ranks agree on
    the set (their collectives follow it)."""
    stats = r.stats
    bad = torch.tensor([0.0 if ok else 1.0 for ok in _read_scalars(finite)])  # one device sync, not one per layer
    if stats.sharded and len(bad):
        like = _a_sharded_weight(stats)
        bad = all_reduce_sum(bad.to(like.device), like).cpu()
    for (fqn, _), flag in zip(list(output_errors), bad.tolist()):
        if flag:
            del output_errors[fqn, fmt]
            valid[fqn] = [f for f in valid[fqn] if f is not fmt]
            metrics[fqn]["ld"][fmt] = metrics[fqn]["wd"][fmt] = math.inf
            r.invalid.append((fqn, fmt))


def _transferred_second_order(r: _RoundInputs, output_errors: dict, fmt: Format, metrics: dict, draws: int,
                              generator, *, per_sample: bool) -> dict:
    """Curvature8Bit.TRANSFER: 1/2 dY^T H dY of an 8-bit format as q_l ||dY||^2, q_l the layer's
    curvature along its FP4 errors this round (sum of their probed second-order terms / sum of their
    ||dY||^2, already in ``metrics``). Layers with no FP4 format probed this round (only 8-bit formats
    allowed, or their FP4 errors non-finite) get the error probe for ``fmt``, their errors alone."""
    stats, quotient = r.stats, {}
    for fqn, _ in output_errors:
        m = metrics[fqn]
        # (a non-finite probed term is no curvature to transfer: the 8-bit format is probed instead)
        probed = [f for f in m["second"] if f.is_fp4 and f in m["abs_y"] and m["abs_y"][f] > 0
                  and math.isfinite(m["second"][f])]
        if probed:  # metrics hold second / |loss| (_forward_metrics): back to the loss's units
            quotient[fqn] = sum(m["second"][f] * r.loss_norm for f in probed) / sum(m["abs_y"][f] for f in probed)
    keys = [key for key in output_errors if key[0] in quotient]
    energies = _read_scalars([output_errors[key].pow(2).sum().double() for key in keys])
    out = {key: quotient[key[0]] * e for key, e in zip(keys, energies)}
    rest = {key: dy for key, dy in output_errors.items() if key[0] not in quotient}
    if rest:
        out.update(error_probe_second_order(stats, rest, [fmt], draws, generator, per_sample=per_sample))
    return out


def _backward_divergence(r: _RoundInputs, valid: dict, metrics: dict, probes: int) -> dict:
    """WD's parts of every valid (layer, format) into ``metrics``; returns (fqn, format) -> the direct
    term's sum of squares (summed over ranks under FSDP2), before the division by the update energy."""
    stats, precision, generator = r.stats, r.precision, r.generator
    measured = [fqn for fqn, fmts in valid.items() if fmts]
    keys = [(fqn, f) for fqn in measured for f in valid[fqn]]
    bits = _GradientBits(r, keys, "g")
    input_errors = {}
    for group in _groups(r, measured, valid):
        fmts = valid[group[0]]
        gs, ws = _stacked_operands(r, group, "g"), _stacked_operands(r, group, "w")
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
    for group in _groups(r, measured, valid):
        fmts = valid[group[0]]
        # wgrad's operands, quantized along the token axis: one contiguous copy each for every format
        g_ts = _stacked_operands(r, group, "g").transpose(1, 2).contiguous()
        x_ts = _stacked_operands(r, group, "x").transpose(1, 2).contiguous()
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
            direct.update(_backward_metrics(r, stats.layers[fqn], valid[fqn], input_errors.pop(fqn),
                                            None if propagated is None else propagated[fqn], wgrad, metrics[fqn]))
        del gw_refs, e_ws
    if stats.sharded and direct:  # one all-reduce for every layer's direct term
        like = _a_sharded_weight(stats)
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

    def __init__(self, r: _RoundInputs, keys: list[tuple[str, Format]], operand: str) -> None:
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


def _quantized_bmm(r: _RoundInputs, grads: torch.Tensor, others: torch.Tensor, fmt: Format, group: list[str],
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


@dataclass(frozen=True)
class _RoundInputs:
    """What every layer's divergence of one round shares."""

    stats: Statistics
    formats: tuple[Format, ...]
    recipe: QuantRecipe
    adam: Mapping[str, AdamState | None]  # parameter name -> AdamW state before the step (None: no Adam)
    denominator: float  # sum_k ||u_k||^2 (or ||g_k||^2 without Adam)
    loss_norm: float
    loss_estimator: LossEstimator
    first_order_history: Mapping[tuple[str, Format], list[float]]
    generator: torch.Generator | None  # stochastic rounding of the gradient GEMMs' errors
    precision: RoundPrecision = RoundPrecision.TRAINING
    group_layers: int = MAX_GROUP_LAYERS  # the most layers of one shape stacked into one batched call
    # (fqn, format) marked invalid for non-finite values: one warning per round
    invalid: list = dataclasses.field(default_factory=list)


class FirstOrderTerms:
    """LD's first-order term <G, dY> of sampled training batches, per (fqn, format): the evidence of
    the ACCUMULATED estimator. Its ``add`` is a FirstOrderSampler's ``measure``.

    A sample holds ``rows`` of a batch of ``total_rows`` rows; the sum over them is scaled by
    total_rows / rows, an estimate of the whole batch's term. ``grad_scale`` is divided out of the
    recorded gradients (1 / accumulate_grad_batches, times an AMP loss scale). A non-finite sample
    (an overflowing fp16 step) is dropped.
    """

    def __init__(self, formats: Iterable[Format], *, recipe: QuantRecipe = QuantRecipe()) -> None:
        self.formats = [f for f in dict.fromkeys(formats) if f is not Format.BF16]
        self.recipe = recipe
        self.grad_scale = 1.0
        self.values: dict[tuple[str, Format], list[float]] = {}

    def add(self, fqn: str, x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, total_rows: int) -> None:
        """``x`` in the dtype of the round's GEMM operands (FirstOrderSampler: bf16 where the layer's
        GEMM ran in bf16; the weight is cast to it, as autocast casts it), ``g`` in fp32."""
        with torch.no_grad():
            w = weight.to(x.dtype)
            y = mm_fp32(x, w)
            g = g.float()
            for fmt in self.formats:
                dy = quantized_matmul(x, w, fmt, recipe=self.recipe, out_dtype=torch.float32) - y
                value = float((g * dy).sum()) * total_rows / x.shape[0] / self.grad_scale
                if math.isfinite(value):
                    self.values.setdefault((fqn, fmt), []).append(value)

    def take(self) -> dict[tuple[str, Format], list[float]]:
        """The values collected so far, and a fresh start."""
        values, self.values = self.values, {}
        return values


def _invalid(formats) -> LayerDivergence:
    inf = {f: math.inf for f in formats}
    return LayerDivergence(loss_divergence={Format.BF16: 0.0, **inf}, weight_divergence={Format.BF16: 0.0, **inf})


def _update_deviation(r: _RoundInputs, name: str, delta: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    """D(delta): the deviation of parameter ``name``'s next update when its gradient is off by delta
    (``grad``: the slice's gradient of ``name`` when the caller has it)."""
    adam = r.adam.get(name)
    like = r.stats.parameter(name)
    if adam is None:
        return local_part(delta.float(), like)
    grad = r.stats.param_grad(name, r.precision) if grad is None else grad
    # FSDP2: this rank's shard of the error and gradient, with its shard of the moments.
    return adam.local().update_deviation(local_part(grad, like), local_part(delta, like))


def _a_sharded_weight(stats: Statistics):
    """Any sharded layer weight of the round: its mesh is the group the round's sums are reduced over."""
    return next(s.weight for s in stats.layers.values() if is_sharded(s.weight))


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
    total = math.fsum(_read_scalars(parts))
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
                       "registers them; their share of the propagated term is missing (use "
                       "wd_propagation=exact for this model)", missing[:5])
    out = {}
    for fqn in input_errors:
        mean = sums[fqn].cpu() / probes
        squares[fqn] = squares[fqn].cpu()
        var = (squares[fqn] / probes - mean.pow(2)).clamp_min(0) * probes / max(probes - 1, 1)
        out[fqn] = (mean, (var / probes).sqrt() if probes > 1 else torch.full_like(mean, math.inf))
    return out


def _read_scalars(values: list[torch.Tensor]) -> list[float]:
    """0-d tensors as floats, read with one device transfer (a sync per value made a GPU round wait
    thousands of times); values on other devices than the first (a model split over devices) are
    copied there first."""
    if not values:
        return []
    device = values[0].device
    return torch.stack([v.to(device) for v in values]).tolist()


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


_METRICS = ("ld", "wd", "first", "second", "direct", "prop", "rel_y", "rel_w", "first_w", "first_x", "first_se",
            "first_x_se", "first_mom", "first_mom_se", "first_acc", "first_acc_se", "abs_y", "abs_w", "prop_se", "drift")


def _momentum_and_variance(adam: AdamState | None):
    """AdamW's m_hat of a weight and its noise variance (LossEstimator.MOMENTUM); (None, None) before
    the first step, when there is no m_hat."""
    if adam is None or adam.step == 0:
        return None, None
    b1, t = adam.beta1, adam.step
    m_hat = adam.exp_avg.float() / (1 - b1**t)
    v_hat = adam.exp_avg_sq.float() / (1 - adam.beta2**t)
    m_var = (v_hat - m_hat.pow(2)).clamp_min(0) * ((1 - b1) * (1 - b1 ** (2 * t)) / ((1 + b1) * (1 - b1**t) ** 2))
    return m_hat, m_var


def round_operands(stats: Statistics, s: LayerStats, precision: RoundPrecision, *, weight: bool = True):
    """X, G (Statistics.operands: cast once per round) and W (None with ``weight=False``: no
    all-gather under FSDP2) in the dtype of the round's GEMMs (RoundPrecision)."""
    x, g = stats.operands(s.fqn, precision)
    return x, g, dense(s.weight).to(s.operand_dtype(precision)) if weight else None


def _forward_metrics(r: _RoundInputs, s: LayerStats, fmt: Format, values: list[float], numel: int, second: float,
                     y_rms: float, moments, metrics: dict) -> None:
    """LD and its parts for one layer and format into ``metrics``, from the values of its scalars
    (_output_errors) and the numel of its dY."""
    m_hat, m_var = moments
    norm = r.loss_norm
    first, first_se, first_x, first_x_se = values[0], math.sqrt(values[1]), values[2], math.sqrt(values[3])
    dy_norm, abs_y = values[4], values[5]
    first_mom = None if m_hat is None else values[6]
    first_mom_se = math.inf if m_var is None else math.sqrt(values[-1])
    # This batch and the sampled batches before the round: independent draws of the first-order term.
    history = r.first_order_history.get((s.fqn, fmt), ())
    batch_values = [*history, first]
    first_acc = sum(batch_values) / len(batch_values)
    first_acc_se = (math.sqrt(sum((v - first_acc) ** 2 for v in batch_values) / (len(batch_values) - 1) / len(batch_values))
                    if len(batch_values) > 1 else first_se)
    ld = _combine_loss_divergence(
        r.loss_estimator, first=first / norm, first_stderr=first_se / norm, first_activation=first_x / norm,
        first_activation_stderr=first_x_se / norm,
        first_weight_momentum=None if first_mom is None else first_mom / norm,
        first_weight_momentum_stderr=first_mom_se / norm, first_accumulated=first_acc / norm if history else None,
        first_accumulated_stderr=first_acc_se / norm, second=second / norm)
    if not math.isfinite(ld) or not math.isfinite(second):  # max(0, nan) is 0: a NaN curvature is no estimate, not free
        r.invalid.append((s.fqn, fmt))
        ld = math.inf
    metrics["ld"][fmt] = ld
    metrics["first"][fmt], metrics["second"][fmt] = first / norm, second / norm
    metrics["first_w"][fmt], metrics["first_x"][fmt] = (first - first_x) / norm, first_x / norm
    metrics["first_se"][fmt], metrics["first_x_se"][fmt] = first_se / norm, first_x_se / norm
    if first_mom is not None:
        metrics["first_mom"][fmt], metrics["first_mom_se"][fmt] = first_mom / norm, first_mom_se / norm
    if history:
        metrics["first_acc"][fmt], metrics["first_acc_se"][fmt] = first_acc / norm, first_acc_se / norm
    metrics["rel_y"][fmt] = dy_norm / max(y_rms * math.sqrt(numel), 1e-30)
    metrics["abs_y"][fmt] = abs_y


def _backward_metrics(r: _RoundInputs, s: LayerStats, fmts, input_errors: torch.Tensor, propagated, wgrad,
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
    values = _read_scalars(scalars + norms)
    direct = {}
    for i, fmt in enumerate(fmts):
        direct_sum, (e_w_norm, abs_w) = values[i], values[len(fmts) + 2 * i: len(fmts) + 2 * i + 2]
        direct[s.fqn, fmt] = direct_sum
        metrics["prop"][fmt] = float(propagated_by_format[i]) / r.denominator
        metrics["prop_se"][fmt] = float(propagated_stderr[i]) / r.denominator
        rel_w = e_w_norm / values[-1]
        metrics["rel_w"][fmt] = rel_w if math.isfinite(rel_w) else math.inf  # as LD/WD: non-finite = invalid
        metrics["abs_w"][fmt] = abs_w
    return direct


def _metrics_to_divergence(metrics, kappa) -> LayerDivergence:
    return LayerDivergence(
        loss_divergence=metrics["ld"], weight_divergence=metrics["wd"], first_order=metrics["first"],
        second_order=metrics["second"], wd_direct=metrics["direct"], wd_propagated=metrics["prop"],
        wd_propagated_stderr=metrics["prop_se"],
        rel_error_forward=metrics["rel_y"], rel_error_wgrad=metrics["rel_w"], curvature=kappa,
        first_weight=metrics["first_w"], first_activation=metrics["first_x"], first_stderr=metrics["first_se"],
        first_activation_stderr=metrics["first_x_se"], first_weight_momentum=metrics["first_mom"],
        first_weight_momentum_stderr=metrics["first_mom_se"], first_accumulated=metrics["first_acc"],
        first_accumulated_stderr=metrics["first_acc_se"],
        abs_error_forward=metrics["abs_y"], abs_error_wgrad=metrics["abs_w"],
        drift={f: d for f, d in metrics["drift"].items() if f is not Format.BF16},
    )


def _estimate_curvature(stats: Statistics, output_rms, draws: int, scale: float, generator) -> dict[str, float]:
    """kappa_l = <d_l, G'_l - G_l> / ||d_l||^2, averaged over ``draws`` independent noise draws.

    Noise goes into every layer at once: cross-layer terms vanish in expectation because the draws
    are independent."""
    if draws <= 0:
        return {}
    totals = {fqn: 0.0 for fqn in stats.layers}
    noise_std = {fqn: scale * max(rms, 1e-12) for fqn, rms in output_rms.items()}
    for _ in range(draws):
        noise = {}
        for fqn, s in stats.layers.items():
            shape = (s.num_rows, s.weight.shape[0])
            noise[fqn] = torch.randn(shape, generator=generator, device=s.x.device) * noise_std[fqn]
        noisy = stats.output_grads_with_noise(noise)
        for fqn, d in noise.items():
            delta_g = noisy[fqn].float() - stats.layers[fqn].g.float()
            totals[fqn] += float((d * delta_g).sum() / d.pow(2).sum())
    return {fqn: t / draws for fqn, t in totals.items()}


def _fisher_second_order(g: torch.Tensor, dy: torch.Tensor, tokens: int) -> float:
    """1/2 N sum_i (G_i . dY_i)^2 over a layer's rows (CurvatureProbe.FISHER). N, the number of
    per-token losses the loss averages: taken as the round's token rows (the most any layer saw; a
    layer that sees some tokens only, a mixture-of-experts expert, still has per-token gradients
    N G_i). A loss averaged over fewer terms (masked or padded tokens, a per-sequence loss) scales
    this term by rows / terms against the first-order one: the ranking of the term itself is unchanged."""
    per_row = (g.float() * dy).sum(1).double()
    return 0.5 * tokens * float(per_row.pow(2).sum())


def _sign_units(s: LayerStats) -> int:
    """How many independent signs the error probe gives a layer's rows: one per sample where its input
    had a leading sample dimension over token dimensions (rows of a sample contiguous), else one."""
    n, rows = s.num_samples, s.num_rows
    return n if s.leading_sample_dim and 2 <= n <= rows and rows % n == 0 else 1


# Per model (keyed by its first switchable layer's module): whether its samples are independent, as
# _samples_independent measured at the model's first round.
_independent_samples: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _samples_independent(stats: Statistics, output_errors, keys, units) -> bool:
    """Whether the leading dimension of the per-sample layers' inputs indexes independent samples: one
    pass injecting every such layer's error into the rows of its first sample only; where the samples
    are independent (a batch-first causal LM: the forward pass never mixes samples, the loss is a sum
    over them) no other sample's output gradient changes, bit for bit. A sequence-first layout, windows
    or attention heads folded into the leading dimension, or a loss that couples samples (pairs of a
    preference loss, in-batch negatives) change them, and a sign per sample would drop real terms: the
    probe then keeps one sign per layer. Measured once per model (the first round; one extra pass) and
    remembered; under FSDP2 the ranks agree (one all-reduce)."""
    per_sample = [(key, n) for key, n in zip(keys, units) if n > 1]
    if not per_sample:
        return True
    anchor = next(iter(stats.layer_modules.values()), None)
    if anchor is not None and anchor in _independent_samples:
        return _independent_samples[anchor]
    noise, first_rows = {}, {}
    for (fqn, f), n in per_sample:
        dy = output_errors[fqn, f]
        first_rows[fqn] = dy.shape[0] // n
        part = torch.zeros_like(dy)
        part[: first_rows[fqn]] = dy[: first_rows[fqn]]
        noise[fqn] = part
    noisy = stats.output_grads_with_noise(noise)
    inside, outside = [], []
    for (fqn, _), _ in per_sample:
        delta = noisy[fqn].float() - stats.layers[fqn].g.float()
        inside.append(delta[: first_rows[fqn]].pow(2).sum().double())
        outside.append(delta[first_rows[fqn]:].pow(2).sum().double())
    del noise, noisy
    inside_v, outside_v = _read_scalars(inside), _read_scalars(outside)
    scale = max(inside_v)
    # A change outside the first sample above 1e-4 of the largest inside it (in norm): roundoff is far
    # below, interacting samples measured 0.1-0.8 of it.
    leaking = [fqn for ((fqn, _), _), out in zip(per_sample, outside_v) if out > 1e-8 * scale]
    flag = torch.tensor([float(bool(leaking)), float(scale > 0)], dtype=torch.float64)
    if stats.sharded:
        like = _a_sharded_weight(stats)
        flag = all_reduce_sum(flag.to(like.device), like).cpu()
    if flag[1] == 0:  # no layer's error changed anything: nothing measured, not remembered
        return True
    independent = bool(flag[0] == 0)
    if not independent:
        logger.warning(
            "error probe: the samples of a round interact: injecting layer errors into the first sample's rows "
            "changed the output gradients of other samples (at %s%s: a sequence-first layout, windows or heads "
            "folded into the batch dimension, or a loss that couples samples); the probe keeps one sign per layer "
            "for this model (as curvature_probe=error_layer)", ", ".join(leaking[:4]) or "another rank's layers",
            ", ..." if len(leaking) > 4 else "")
    if anchor is not None:
        _independent_samples[anchor] = independent
    return independent


def error_probe_second_order(stats: Statistics, output_errors, formats, draws: int, generator, *,
                              per_sample: bool = True) -> dict:
    """1/2 dY^T H dY per (layer, format): inject eps dY(l, p) into every layer for one format at a
    time, eps = +-1 independent per layer and (``per_sample``, where _samples_independent) per sample
    of its rows (CurvatureProbe.ERROR), read 1/2 sum_rows eps <dY(l, p), G'_l - G_l>, average over draws."""
    totals = {key: 0.0 for key in output_errors}
    if draws <= 0:
        return totals
    terms = {key: [] for key in output_errors}  # device scalars, read with one transfer at the end
    for fmt in formats:
        keys = [key for key in output_errors if key[1] is fmt]
        if not keys:
            continue
        units = [_sign_units(stats.layers[fqn]) if per_sample else 1 for fqn, _ in keys]
        if not _samples_independent(stats, output_errors, keys, units):
            units = [1] * len(keys)
        device = output_errors[keys[0]].device
        for _ in range(draws):
            # every sign of the draw in one call, moved to the errors' device once (one sync per draw)
            drawn = torch.rand(sum(units), generator=generator,
                               device=generator.device if generator is not None else device) < 0.5
            drawn = (drawn.float() * 2 - 1).to(device)
            noise = {}
            for (fqn, f), signs, n in zip(keys, drawn.split(units), units):
                dy = output_errors[fqn, f]
                noise[fqn] = signs.repeat_interleave(dy.shape[0] // n).unsqueeze(1) * dy
            noisy = stats.output_grads_with_noise(noise)
            for fqn, f in keys:
                delta_g = noisy[fqn].float() - stats.layers[fqn].g.float()
                # (eps dY) . (G' - G) = eps <dY, G' - G> row by row
                terms[fqn, f].append((noise[fqn] * delta_g).sum().double())
            del noise, noisy
    flat = [(key, t) for key, ts in terms.items() for t in ts]
    for (key, _), value in zip(flat, _read_scalars([t for _, t in flat])):
        totals[key] += 0.5 * value / draws
    return totals
