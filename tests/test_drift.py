"""The forward error's drift of AdamW's updates (lightning_snip.drift) against autograd."""

import math

import pytest
import torch
from torch import nn

from lightning_snip.adamw import read_adam_state
from lightning_snip.convert import convert_linears
from lightning_snip.divergence import estimate_divergence, update_energy
from lightning_snip.drift import DriftTerms
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.gemm import quantized_matmul
from lightning_snip.stats import collect_stats


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 64)
        self.second = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _trained(steps=4, samples=8, repeated=False):
    torch.manual_seed(0)
    model = Net()
    x, target = torch.randn(samples, 6, 32), torch.randn(samples, 6, 32)
    if repeated:  # every sample the same: the gradient shift has no batch-to-batch fluctuation
        x, target = x[:1].expand_as(x).contiguous(), target[:1].expand_as(target).contiguous()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = lambda: nn.functional.mse_loss(model(x), target)  # noqa: E731
    for _ in range(steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    return model, convert_linears(model), opt, loss_fn, x


def _exact_drift(model, opt, loss_fn, x, fqn, fmt, stats):
    """||Lambda delta g||^2 and 4 <Lambda dg_A, Lambda dg_B> over one update's energy, by autograd:
    delta g the central difference of every parameter's gradient when layer ``fqn``'s output moves by
    +-eps x its forward error (on every sample, or on one half of them)."""
    layer = dict(model.named_modules())[fqn]
    with torch.no_grad():
        inp = model.first.weight.new_zeros(0)
        h = x if fqn == "first" else torch.tanh(model.first(x))
        dy = (quantized_matmul(h.reshape(-1, layer.in_features), layer.weight, fmt, recipe=QuantRecipe())
              - h.reshape(-1, layer.in_features) @ layer.weight.t()).reshape(*h.shape[:-1], -1)
    del inp
    params = dict(model.named_parameters())

    def grads(shift):
        handle = layer.register_forward_hook(lambda m, a, out: out + shift)
        try:
            g = torch.autograd.grad(loss_fn(), list(params.values()))
        finally:
            handle.remove()
        return dict(zip(params, g))

    eps = 1e-3

    def delta(mask):
        plus, minus = grads(eps * dy * mask), grads(-eps * dy * mask)
        out = {}
        for name, p in params.items():
            state = read_adam_state(opt, p)
            sens = state.update_sensitivity(stats.param_grad(name))
            out[name] = sens * (plus[name] - minus[name]) / (2 * eps)
        return out

    ones = torch.ones(x.shape[0], 1, 1)
    a_mask, b_mask = ones.clone(), ones.clone()
    a_mask[x.shape[0] // 2:] = 0
    b_mask[: x.shape[0] // 2] = 0
    full, a, b = delta(ones), delta(a_mask), delta(b_mask)
    energy = update_energy(stats, stats.param_adam)
    total = sum(float(v.pow(2).sum()) for v in full.values()) / energy
    bias = 4 * sum(float((a[n] * b[n]).sum()) for n in params) / energy
    return total, bias


@pytest.mark.parametrize("fqn", ["first", "second"])
def test_drift_probes_estimate_the_adam_normalized_gradient_shift_of_every_parameter(fqn):
    model, layers, opt, loss_fn, x = _trained()
    fmt = Format.MXFP4
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    result = estimate_divergence(stats, [fmt], noise_draws=0, drift_probes=300, generator=torch.Generator().manual_seed(1))
    total, bias = _exact_drift(model, opt, loss_fn, x, fqn, fmt, stats)
    stats.release()
    d = result.layers[fqn].drift[fmt]
    assert total > 0
    # 300 sign probes: the square's relative standard error is about sqrt(2 / 300) = 8%.
    assert d.total == pytest.approx(total, rel=0.3)
    assert abs(d.bias - bias) < 3 * d.bias_stderr
    assert d.bias_stderr < 0.5 * total


def test_without_fluctuation_the_bias_is_the_whole_shift():
    # Identical samples: the two halves shift the gradients alike, 4 <A, B> = ||A + B||^2 per probe.
    model, layers, opt, loss_fn, x = _trained(repeated=True)
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    result = estimate_divergence(stats, [Format.NVFP4], noise_draws=0, drift_probes=200,
                                 generator=torch.Generator().manual_seed(2))
    for fqn in layers:
        total, bias = _exact_drift(model, opt, loss_fn, x, fqn, Format.NVFP4, stats)
        d = result.layers[fqn].drift[Format.NVFP4]
        assert bias == pytest.approx(total, rel=1e-3)
        assert d.bias == pytest.approx(d.total, rel=1e-4)
        assert d.bias == pytest.approx(bias, rel=0.3)
    stats.release()


def test_shifted_rerun_restores_the_parameters_and_a_zero_shift_reproduces_the_gradients():
    model, layers, opt, loss_fn, _ = _trained()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    zero = stats.output_grads_with_shift({n: torch.zeros_like(p) for n, p in model.named_parameters()})
    moved = stats.output_grads_with_shift({"first.weight": torch.full_like(model.first.weight, 0.1)})
    for fqn in layers:
        assert torch.equal(zero[fqn], stats.layers[fqn].g)
    assert not torch.allclose(moved["second"], stats.layers["second"].g)
    with pytest.raises(KeyError):
        stats.output_grads_with_shift({"no.such.parameter": torch.zeros(1)})
    stats.release()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_without_drift_probes_the_round_is_unchanged_and_measures_no_drift():
    model, layers, opt, loss_fn, _ = _trained()
    out = []
    for probes in (0, 3):
        stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
        out.append(estimate_divergence(stats, [Format.MXFP4, Format.NVFP4], drift_probes=probes,
                                       generator=torch.Generator().manual_seed(5)))
        stats.release()
    plain, drift = out
    for fqn in layers:
        assert plain.layers[fqn].drift == {}
        assert set(drift.layers[fqn].drift) == {Format.MXFP4, Format.NVFP4}
        # The drift's re-runs draw nothing from the round's generator: LD and WD are the same numbers.
        assert plain.layers[fqn].loss_divergence == drift.layers[fqn].loss_divergence
        assert plain.layers[fqn].weight_divergence == drift.layers[fqn].weight_divergence


def test_per_step_drift_adds_the_bias_over_the_horizon_and_never_prices_noise_as_a_gain():
    terms = DriftTerms(bias=2.0, total=5.0, bias_stderr=0.1)
    assert terms.per_step(10) == 10 * 2.0 + 3.0
    assert terms.per_step(1) == terms.total
    assert DriftTerms(bias=-1.0, total=0.5, bias_stderr=1.0).per_step(20) == 0.5
    assert DriftTerms(bias=1.0, total=0.5, bias_stderr=1.0).per_step(20) == 20.0
    with pytest.raises(ValueError, match="drift_probes"):
        model, layers, opt, loss_fn, _ = _trained(steps=1)
        stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
        estimate_divergence(stats, [Format.MXFP4], drift_probes=-1)
    assert math.isfinite(terms.per_step(0))


def test_horizon_pricing_adds_the_weighted_drift_to_the_forward_price_of_a_controller_round():
    from lightning_snip.config import SNIPConfig
    from lightning_snip.controller import run_statistics_round

    model, layers, opt, loss_fn, _ = _trained()
    rounds = {}
    for pricing in ("one_step", "horizon"):
        cfg = SNIPConfig(pricing=pricing, interval=20, drift_probes=3, noise_draws=1, weight_divergence_weight=0.5,
                         candidate_formats=("fp8", "mxfp4"))
        rounds[pricing] = run_statistics_round(model, loss_fn, layers, cfg, optimizer=opt,
                                               generator=torch.Generator().manual_seed(3))
    for fqn in layers:
        one, horizon = rounds["one_step"].layers[fqn], rounds["horizon"].layers[fqn]
        assert one.drift == {} and set(horizon.drift) == {Format.FP8, Format.MXFP4}
        for fmt in (Format.FP8, Format.MXFP4):
            drift = horizon.drift[fmt].per_step(20)
            assert drift > 0
            assert horizon.loss_divergence[fmt] == pytest.approx(one.loss_divergence[fmt] + 0.5 * drift, rel=1e-9)
        assert horizon.weight_divergence == one.weight_divergence
