"""The forward error's drift: how a format's forward error moves AdamW's updates of every parameter.

Issue 33. LD prices a quantized forward by the loss increase of one step. But a plan holds for the
``horizon`` steps until the next one, and a model trained with a quantized forward is judged in high
precision (or in its plan's formats) by the weights that training produced. Round-to-nearest is
deterministic: the forward error e_l(p) of layer l in format p shifts the gradient of every parameter
(upstream through the changed backward signal, downstream through the changed activations) by

    delta g_l = d/de grad_theta L(theta, y_l + e) at e = 0, applied to e_l(p)   (H_{theta, y_l} e_l)

and its mean over batches, the bias, adds up step after step, while the batch-to-batch fluctuation
of delta g and the zero-mean stochastic rounding of the backward (WD) grow only like a random walk.
Through AdamW's linearized update map Lambda (AdamState.update_sensitivity), over H steps the bias
moves the weights by H Lambda E[delta g] and a fluctuation of variance sigma^2 by sqrt(H) sigma, so
relative to one update's energy sum_k ||u_k||^2 (WD's denominator):

    drift energy per step = H ||Lambda E[delta g]||^2 / sum ||u||^2  +  Var(Lambda delta g) / sum ||u||^2

``bias`` is ||Lambda E[delta g]||^2 / sum ||u||^2 and ``total`` E||Lambda delta g||^2 / sum ||u||^2
(bias + fluctuation) of the statistics slice; ``DriftTerms.per_step(horizon)`` combines them.

How they are measured (written here: no library computes a mixed second derivative per layer and
format from a finite difference): for a random sign vector r over all parameters and the parameter
tangent Lambda r, r^T Lambda delta g_l = <dG_l(Lambda r), e_l> (symmetry of the mixed derivative),
where dG_l(v) is how the gradient arriving at layer l's output moves when the parameters move along
v: one re-run of the slice with the parameters shifted by h Lambda r (Statistics.output_grads_with_shift),
dG_l = (G'_l - G_l) / h, serves every layer and format. E_r[<dG_l, e_l>^2] = ||Lambda delta g_l||^2.
The bias is taken from two halves A, B of the slice's samples: E[<Lambda dg_A, Lambda dg_B>] =
||Lambda E[delta g]||^2 / 4 when the halves are independent, so 4 <., dG_A><., dG_B> estimates it
without the fluctuation's square (one batch's delta g squared is mostly its fluctuation). A slice
whose rows are not known to be samples (a 2-D input) has no halves: its bias is its total (an upper
bound).

Costs and limits: one forward and backward of the slice per probe (the round measured 1.22x on deep8
and 1.45x on SmolLM2 with 4 probes), the tangent and a saved copy of every trainable parameter while a
probe runs, and each probe's dG of every layer until the formats are done. Measured in fp32 only: under
bf16 autocast G carries bf16 rounding, which the finite difference at half an update's norm may not rise
above. Not supported with FSDP2 (sharded parameters): the round fails with that error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_snip.adamw import AdamState
from lightning_snip.formats import Choice, Format
from lightning_snip.sharding import from_local_parts, local_part
from lightning_snip.stats import RoundPrecision, Statistics

# The finite difference's step: the shift h Lambda r has this fraction of one AdamW update's norm
# (a training step moves the weights by one update: the mixed derivative is wanted at that scale).
SHIFT_FRACTION = 0.5


class Pricing(Choice):
    """What a forward GEMM in a low format costs in the ILP's objective (SNIPConfig.pricing).

    ONE_STEP: its LD, the relative loss increase of one step (the method text).
    HORIZON: LD + weight_divergence_weight x its drift of AdamW's updates per step over the plan's
        horizon (DriftTerms.per_step, the horizon the interval between rounds): the forward error's
        bias adds up over the steps a plan holds, in WD's units (the backward keeps WD, the
        zero-mean stochastic rounding that averages out). ``drift_probes`` shifted re-runs per round.
        Measured (benchmarks/results/objective_outcome_*.md) it did not rank the runs' outcomes
        better than ONE_STEP: an option, not the default.
    """

    ONE_STEP = "one_step"
    HORIZON = "horizon"


@dataclass(frozen=True)
class DriftTerms:
    """One (layer, format)'s drift, relative to one AdamW update's energy (see the module text)."""

    bias: float  # ||Lambda E[delta g]||^2 / sum ||u||^2 (the part that adds up over a plan's steps)
    total: float  # E||Lambda delta g||^2 / sum ||u||^2 on the slice (bias + the batch's fluctuation)
    bias_stderr: float  # the bias's standard error over the probes

    def per_step(self, horizon: float) -> float:
        """The drift energy per step of a plan held ``horizon`` steps: horizon x bias + fluctuation,
        each part clamped at 0 (a negative estimate is noise, never a gain)."""
        bias = max(0.0, self.bias)
        return horizon * bias + max(0.0, self.total - bias)


def sign_tangent(stats: Statistics, adam: Mapping[str, AdamState | None], name: str, index: int, seed: int,
                 precision: RoundPrecision = RoundPrecision.TRAINING) -> torch.Tensor:
    """Lambda r of parameter ``name`` (the ``index``-th of stats.param_names): random signs r drawn from
    (``seed``, index), not from a shared stream, so the same tangent comes back wherever the parameter
    is used, times AdamW's update sensitivity at the slice's gradient (gradient operands in
    ``precision``; 1 without moments). FSDP2: every rank draws the whole parameter's signs, scales its
    shard by its shard of the moments, and one all-gather joins the shards. The WD probes
    (divergence._probe_propagated) and the drift's shifts (_tangents) draw through it."""
    return sign_tangents(stats, adam, name, index, [seed], precision)[0]


def sign_tangents(stats: Statistics, adam: Mapping[str, AdamState | None], name: str, index: int,
                  seeds: Sequence[int], precision: RoundPrecision = RoundPrecision.TRAINING) -> torch.Tensor:
    """sign_tangent for each of ``seeds``, stacked (len(seeds) x the parameter's shape), the update
    sensitivity (and the weight's recomputed G^T X it needs) computed once for all of them: what the WD
    probes batched in one pass need."""
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


def _tangents(stats: Statistics, adam: Mapping[str, AdamState | None], seed: int) -> dict[str, torch.Tensor]:
    """Lambda r (sign_tangent) for every parameter with a gradient."""
    return {name: sign_tangent(stats, adam, name, index, seed)
            for index, name in enumerate(stats.param_names) if stats.has_grad(name)}


def _halves(stats: Statistics, fqn: str) -> int:
    """How many samples the slice of layer ``fqn`` holds along its leading dimension (1: rows that are
    not known to be samples, no halves)."""
    s = stats.layers[fqn]
    return s.num_samples if s.leading_sample_dim and s.num_samples >= 2 else 1


def output_grad_tangents(stats: Statistics, adam: Mapping[str, AdamState | None], probes: int, seed: int,
                         update_energy: float) -> list[dict[str, torch.Tensor]]:
    """dG_l(Lambda r) of every layer for ``probes`` random sign vectors r (one shifted re-run each)."""
    if probes < 1:
        raise ValueError(f"drift_probes: invalid value {probes!r}; allowed: an integer >= 1")
    if stats.sharded:
        raise ValueError("pricing: invalid value 'horizon' with sharded (FSDP2) parameters (the drift's shifted "
                         "re-runs shift unsharded parameters only); allowed there: one_step")
    out = []
    for probe in range(probes):
        tangent = _tangents(stats, adam, (seed * 0x9E3779B1 + 0x2545F491 * (probe + 1)) % 2**62)
        norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in tangent.values()))
        if norm == 0.0 or not math.isfinite(norm):
            raise RuntimeError("drift: the parameter tangent is zero or non-finite (no gradients this round?)")
        h = SHIFT_FRACTION * math.sqrt(max(update_energy, 1e-300)) / norm
        for t in tangent.values():
            t.mul_(h)  # in place: one copy of the parameters' size, not two
        shifted = stats.output_grads_with_shift(tangent)
        out.append({fqn: (shifted[fqn] - stats.layers[fqn].g) / h for fqn in stats.layers})
        del shifted, tangent
    return out


def drift_terms(stats: Statistics, output_errors: Mapping[tuple[str, Format], torch.Tensor],
                tangents: list[dict[str, torch.Tensor]], update_energy: float) -> dict[tuple[str, Format], DriftTerms]:
    """DriftTerms of every (layer, format) of ``output_errors`` (e = dY, rows x m) from the probes'
    output-gradient tangents (output_grad_tangents)."""
    out = {}
    denominator = max(update_energy, 1e-300)
    for (fqn, fmt), dy in output_errors.items():
        samples = _halves(stats, fqn)
        half = samples // 2
        products, squares = [], []
        for probe in tangents:
            per_sample = (probe[fqn].float() * dy.float()).reshape(samples, -1).sum(1).double()
            a, b = per_sample[:half].sum(), per_sample[half:].sum()
            products.append(4.0 * a * b if samples > 1 else (a + b) ** 2)
            squares.append((a + b) ** 2)
        values = torch.stack(products + squares).cpu().tolist()  # one device transfer per (layer, format)
        prod, sq = values[: len(tangents)], values[len(tangents):]
        bias = sum(prod) / len(prod)
        spread = math.sqrt(sum((v - bias) ** 2 for v in prod) / (len(prod) - 1) / len(prod)) if len(prod) > 1 else math.inf
        out[fqn, fmt] = DriftTerms(bias=bias / denominator, total=sum(sq) / len(sq) / denominator,
                                   bias_stderr=spread / denominator)
    return out
