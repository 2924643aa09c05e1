import copy
import logging
import math

import pytest
import torch
from torch import nn

from lightning_snip.convert import convert_linears
from lightning_snip.divergence import DivergenceResult
from lightning_snip.evidence import planning_value
from lightning_snip.loss_divergence import combine_loss_divergence
from lightning_snip.statistics_round import estimate_divergence
from lightning_snip.formats import Format
from lightning_snip.quantize import fake_quantize
from lightning_snip.gemm import quantized_matmul
from lightning_snip.formats import QuantRecipe
from lightning_snip.adamw import read_adam_state
from lightning_snip.stats import Propagation, collect_stats, slice_batch


class TwoLayer(nn.Module):
    def __init__(self, sizes=(64, 64, 64)):
        super().__init__()
        self.first = nn.Linear(sizes[0], sizes[1], bias=False)
        self.second = nn.Linear(sizes[1], sizes[2], bias=False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _setup(scale_second=1.0, steps=3):
    model = TwoLayer()
    with torch.no_grad():
        model.second.weight.mul_(scale_second)
    x, target = torch.randn(64, 64), torch.randn(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = lambda: nn.functional.mse_loss(model(x), target)
    loss_fn.target, loss_fn.x = target, x
    for _ in range(steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    layers = convert_linears(model)
    return model, layers, opt, loss_fn, x


def test_dominant_layer_ranks_first():
    # The second layer's weights carry one huge outlier per row: its FP4 blocks flush the other
    # elements, so its quantization error (and both divergences) dominate.
    model, layers, opt, loss_fn, _ = _setup()
    with torch.no_grad():
        model.second.weight[:, 0] = 50.0
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    result = estimate_divergence(stats, [Format.MXFP4])
    stats.release()
    d = result.layers
    # The outlier was set after the optimizer's history: only this batch's terms describe it.
    batch_ld = {f: d[f].first_order[Format.MXFP4] + d[f].second_order[Format.MXFP4] for f in d}
    assert abs(batch_ld["second"]) > 3 * abs(batch_ld["first"])
    assert d["first"].loss_divergence[Format.BF16] == 0.0 == d["first"].weight_divergence[Format.BF16]


def test_first_order_term_equals_inner_product():
    model, layers, opt, loss_fn, x = _setup()
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    result = estimate_divergence(stats, [Format.NVFP4], noise_draws=0)
    # Independently: G = dL/dY of the second layer by autograd, dY from the quantized GEMM.
    h = torch.tanh(model.first(x)).detach().requires_grad_()
    y = model.second(h)
    y.retain_grad()
    loss = nn.functional.mse_loss(y, loss_fn.target)
    loss.backward()
    w = model.second.weight.detach()
    dy = quantized_matmul(h.detach(), w, Format.NVFP4, recipe=QuantRecipe(), b_is_weight=True) - h.detach() @ w.t()
    expected = float((y.grad * dy).sum()) / loss.item()
    assert result.layers["second"].first_order[Format.NVFP4] == pytest.approx(expected, rel=1e-4)
    assert result.layers["second"].second_order[Format.NVFP4] == 0.0  # no noise draws: no curvature


def test_vjp_matches_finite_difference_of_upstream_gradients():
    model, layers, opt, loss_fn, x = _setup()
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt, propagation=Propagation.EXACT)
    e = torch.randn(64, 64) * 1e-3
    delta = stats.propagate_input_grad("second", e.unsqueeze(0))["first.weight"][0]
    # Finite difference: the first layer's weight gradient when the gradient arriving at h (the
    # second layer's input) is g_h + eps*e, by backpropagating that from h by hand.
    w1 = model.first.weight
    def first_grad(grad_h):
        pre = x @ w1.detach().t()
        return ((grad_h * (1 - torch.tanh(pre) ** 2)).t() @ x)
    h = torch.tanh(x @ w1.detach().t()).requires_grad_()
    loss = nn.functional.mse_loss(model.second(h), loss_fn.target)
    (g_h,) = torch.autograd.grad(loss, h)
    eps = 10.0
    fd = (first_grad(g_h + eps * e) - first_grad(g_h)) / eps
    assert torch.allclose(delta, fd, rtol=1e-3, atol=1e-7)
    # and the first layer has no switchable layer upstream: its input needs no gradient
    assert stats.propagate_input_grad("first", torch.randn(1, 64, 64)) == {}
    stats.release()


def test_curvature_matches_quadratic_loss():
    # For L = 1/2 ||y - t||^2 summed (not averaged), d^2L/dy^2 = I: the second-order term is exactly
    # 1/2 ||dY||^2.
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    x, t = torch.randn(16, 32), torch.randn(16, 32)
    layers = convert_linears(model)
    stats = collect_stats(model, lambda: 0.5 * (model(x) - t).pow(2).sum(), layers=layers)
    w = model[0].weight.detach()
    dy = quantized_matmul(x, w, Format.MXFP4, recipe=QuantRecipe()) - x @ w.t()
    expected = 0.5 * float(dy.pow(2).sum()) / stats.loss
    error = estimate_divergence(stats, [Format.MXFP4], noise_draws=1)
    assert error.layers["0"].second_order[Format.MXFP4] == pytest.approx(expected, rel=1e-4)


def test_non_finite_statistics_mark_formats_invalid(caplog):
    model, layers, opt, loss_fn, _ = _setup()
    with torch.no_grad():
        model.second.weight[0, 0] = float("inf")
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    with caplog.at_level(logging.WARNING):
        result = estimate_divergence(stats, [Format.MXFP4, Format.NVFP4])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1  # one line per round, not one per layer
    assert "second (mxfp4)" in warned[0] and "second (nvfp4)" in warned[0]
    assert math.isinf(result.layers["second"].loss_divergence[Format.MXFP4])
    assert math.isinf(result.layers["second"].weight_divergence[Format.NVFP4])
    assert result.layers["second"].loss_divergence[Format.BF16] == 0.0


def test_without_adam_falls_back_to_gradient_errors(caplog):
    model, layers, _, loss_fn, _ = _setup(steps=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    import lightning_snip.statistics_round as statistics_round
    statistics_round._warned_no_adam = False
    with caplog.at_level(logging.WARNING):
        result = estimate_divergence(stats, [Format.MXFP4])
    assert not result.used_adam and "plain gradient errors" in caplog.text
    assert result.layers["first"].weight_divergence[Format.MXFP4] > 0
    assert read_adam_state(opt, model.first.weight) is None


def test_formats_restored_and_hooks_removed_on_error():
    model, layers, opt, _, x = _setup()
    layers["first"].format = Format.MXFP4

    def broken():
        model(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        collect_stats(model, broken, layers=layers, optimizer=opt)
    assert layers["first"].format is Format.MXFP4
    assert not layers["first"]._forward_hooks


def test_result_round_trip_and_slice_batch():
    model, layers, opt, loss_fn, _ = _setup()
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    result = estimate_divergence(stats, [Format.MXFP4], allowed={"first": [Format.MXFP4], "second": []})
    assert math.isinf(result.layers["second"].loss_divergence[Format.MXFP4])
    again = DivergenceResult.from_dict(result.as_dict())
    assert again.layers["first"].loss_divergence == result.layers["first"].loss_divergence
    batch = (torch.zeros(8, 16, dtype=torch.long), torch.zeros(8, 16, dtype=torch.long))
    sliced = slice_batch(batch, 40)
    assert sliced[0].shape == (2, 16) and isinstance(sliced, tuple)
    assert slice_batch({"x": torch.zeros(8, 16)}, 1)["x"].shape == (1, 16)
    # Rows by tokens: one 64-token sequence is cut to a 40-token prefix, in every tensor of that length.
    long = {"input_ids": torch.arange(4 * 64).reshape(4, 64), "mask": torch.ones(4, 64), "lengths": torch.full((4,), 64)}
    cut = slice_batch(long, 40)
    assert cut["input_ids"].shape == (1, 40) and cut["mask"].shape == (1, 40) and cut["lengths"].shape == (1,)
    assert torch.equal(cut["input_ids"][0], torch.arange(40))
    assert slice_batch(torch.zeros(4, 8, 8, dtype=torch.long), 16).shape == (1, 8, 8)  # 2-D samples stay whole


def test_slice_batch_keeps_the_batch_type_lightning_moves():
    # A user's batch is any collection Lightning moves to the device: each comes back sliced in its own type.
    import collections
    import dataclasses

    Pair = collections.namedtuple("Pair", "input_ids labels")

    @dataclasses.dataclass
    class Batch:
        input_ids: torch.Tensor
        name: str = "b"

    ids = torch.arange(8 * 16).reshape(8, 16)
    pair = slice_batch(Pair(ids, ids + 1), 32)
    assert type(pair) is Pair and pair.input_ids.shape == (2, 16) and torch.equal(pair.labels, ids[:2] + 1)
    data = slice_batch(Batch(ids), 16)
    assert type(data) is Batch and data.input_ids.shape == (1, 16) and data.name == "b"
    transformers = pytest.importorskip("transformers")
    encoded = slice_batch(transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)}), 48)
    assert type(encoded) is transformers.BatchEncoding and encoded.input_ids.shape == (3, 16)
    with pytest.raises(ValueError, match=r"batch \(list\) holds no tensor"):
        slice_batch(["text"], 16)


def test_first_order_sampler_matches_autograd_inner_product():
    # A training step's G (gradient of the mean loss w.r.t. the layer output) and X, sampled on
    # strided rows and scaled to the whole batch, against an independent autograd computation, with
    # the weight the forward pass used (the optimizer steps before the values are read).
    from lightning_snip.first_order import FirstOrderSampler, FirstOrderTerms

    torch.manual_seed(0)
    model = TwoLayer()
    layers = convert_linears(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, target = torch.randn(4, 16, 64), torch.randn(4, 16, 64)
    w = model.second.weight.detach().clone()
    h = torch.tanh(model.first(x)).detach().requires_grad_()
    y = model.second(h)
    y.retain_grad()
    nn.functional.mse_loss(y, target).backward()
    model.zero_grad()
    hx, gy = h.detach().reshape(-1, 64), y.grad.reshape(-1, 64)
    dy = quantized_matmul(hx, w, Format.MXFP4, recipe=QuantRecipe()) - hx @ w.t()

    def sampled_step(max_rows, offset, grad_scale=1.0, loss_factor=1.0):
        terms = FirstOrderTerms([Format.MXFP4])
        terms.grad_scale = grad_scale
        sampler = FirstOrderSampler(layers, max_rows, terms.add)
        state = copy.deepcopy(model.state_dict())
        with sampler.recording(offset=offset):
            (loss_factor * nn.functional.mse_loss(model(x), target)).backward()
        opt.step()  # moves the weights before the values are read
        opt.zero_grad()
        model.load_state_dict(state)
        assert not layers["second"]._forward_hooks  # hooks removed after the step
        values = terms.take()
        assert terms.take() == {}  # take() clears
        return values["second", Format.MXFP4]

    exact = float((gy * dy).sum())
    assert sampled_step(64, 0) == [pytest.approx(exact, rel=1e-4)]  # the whole batch: no scaling
    # Every other row, phase 1, scaled by 2: an estimate of the same term with the right scale.
    assert sampled_step(32, 1) == [pytest.approx(2 * float((gy[1::2] * dy[1::2]).sum()), rel=1e-4)]
    # Gradients that carry a factor (accumulation, a loss scale) are divided by it.
    assert sampled_step(64, 0, grad_scale=0.25, loss_factor=0.25) == [pytest.approx(exact, rel=1e-4)]
    # Nothing is recorded outside a step with gradients.
    terms = FirstOrderTerms([Format.MXFP4])
    with FirstOrderSampler(layers, 64, terms.add).recording(), torch.no_grad():
        model(x)
    assert terms.take() == {}


def test_ld_without_sampled_batches_shrinks_the_batchs_first_order_term():
    """With no first-order history, LD is this batch's <G, dY> shrunk by its sampling error (positive-part
    James-Stein) plus the second-order term, not clamped (the planner clamps it at 0, evidence.planning_value)."""
    model, layers, opt, loss_fn, _ = _setup()
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    result = estimate_divergence(stats, [Format.MXFP4])
    stats.release()
    for d in result.layers.values():
        first, se, second = d.first_order[Format.MXFP4], d.first_stderr[Format.MXFP4], d.second_order[Format.MXFP4]
        shrunk = first * max(0.0, 1.0 - (se / first) ** 2) if first and math.isfinite(se) else 0.0
        assert d.loss_divergence[Format.MXFP4] == shrunk + second
        assert planning_value({"layer": {Format.MXFP4: shrunk + second}}, "layer", Format.MXFP4) == max(0.0, shrunk + second)
        assert Format.MXFP4 not in d.first_accumulated


class _Parallel(nn.Module):
    """Four independent layers. The loss of a batch is, per layer, a random linear term in the
    output (zero mean, new every sample: the batch's first-order term is large and random) plus a
    quadratic term of curvature KAPPA[l] whose minimum is the current output (zero expected
    gradient). The expected loss increase of a format is therefore 1/2 KAPPA[l] ||dY||^2 / n: the
    sharp layer (KAPPA 20) ranks first in expectation, whatever one batch says."""

    KAPPA = (1.0, 1.0, 20.0, 1.0)
    SIGMA = 100.0  # the random linear term: per batch about twice the sharp layer's expected increase

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(4))

    def forward(self, xs):
        return [layer(x) for layer, x in zip(self.layers, xs)]

    def batch(self, generator):
        xs = [torch.randn(16, 8, 32, generator=generator) for _ in range(4)]
        cs = [torch.randn(16, 8, 32, generator=generator) * self.SIGMA for _ in range(4)]
        with torch.no_grad():
            targets = self(xs)
        return xs, cs, targets

    def loss(self, batch):
        xs, cs, targets = batch
        n = 16 * 8
        terms = [((c * y).sum() + 0.5 * k * (y - t).pow(2).sum()) / n
                 for c, y, t, k in zip(cs, self(xs), targets, self.KAPPA)]
        return sum(terms) + 1e4  # an offset keeps the loss (LD's normalizer) positive


def test_estimate_ranks_the_expected_loss_increase_not_one_batch():
    """LD (its first-order term averaged over the sampled batches) ranks the layer whose expected loss
    increase is largest first in every round; one batch's F + S (the method text read literally) does not."""
    from lightning_snip.first_order import FirstOrderSampler, FirstOrderTerms

    torch.manual_seed(0)
    model = _Parallel()
    layers = convert_linears(model)
    generator = torch.Generator().manual_seed(1)
    terms = FirstOrderTerms([Format.MXFP4])
    sampler = FirstOrderSampler(layers, 128, terms.add)
    firsts = {"ld": 0, "batch": 0}
    num_rounds = 6
    for trial in range(num_rounds):
        for step in range(32):  # the training steps before a round (snip.first_order_steps)
            with sampler.recording(offset=step):
                model.loss(model.batch(generator)).backward()
            model.zero_grad()
        history = terms.take()
        batch = model.batch(generator)
        stats = collect_stats(model, lambda: model.loss(batch), layers=layers)
        result = estimate_divergence(stats, [Format.MXFP4], noise_draws=2, first_order_history=history,
                                     generator=torch.Generator().manual_seed(trial))
        stats.release()
        ld = {fqn: planning_value({fqn: d.loss_divergence}, fqn, Format.MXFP4) for fqn, d in result.layers.items()}
        assert min(ld.values()) >= 0.0  # as planned: never better than high precision
        firsts["ld"] += max(ld, key=ld.get) == "layers.2"
        batch_ld = {fqn: d.first_order[Format.MXFP4] + d.second_order[Format.MXFP4] for fqn, d in result.layers.items()}
        firsts["batch"] += max(batch_ld, key=batch_ld.get) == "layers.2"
    assert firsts["ld"] == num_rounds, firsts
    assert firsts["batch"] <= num_rounds // 2, firsts


def test_first_order_standard_error_is_over_samples_not_rows():
    from lightning_snip.loss_divergence import _sums_and_variances

    def _sum_and_stderr(per_row, num_samples):
        # as one layer, and as the second of a stack of two (a group of layers of one shape): the same values
        (total, variance), = _sums_and_variances(per_row.unsqueeze(0), num_samples)
        (_, _), (total_2, variance_2) = _sums_and_variances(torch.stack([per_row.flip(0) * 3, per_row]), num_samples)
        assert torch.equal(total, total_2) and torch.equal(variance, variance_2)
        return float(total), math.sqrt(float(variance))

    # 4 samples of 2 rows each; per-sample sums 1, 2, 3, 4: total 10, Var(sum) = 4 * var(1, 2, 3, 4).
    per_row = torch.tensor([0.5, 0.5, 1.5, 0.5, 1.0, 2.0, 4.0, 0.0])
    total, stderr = _sum_and_stderr(per_row, num_samples=4)
    assert total == pytest.approx(10.0)
    assert stderr == pytest.approx(math.sqrt(4 * torch.tensor([1.0, 2.0, 3.0, 4.0]).var().item()))
    # Rows that do not split into the samples are treated as independent units; one unit has no spread.
    assert _sum_and_stderr(per_row, num_samples=3)[1] == pytest.approx(math.sqrt(8 * per_row.var().item()))
    assert _sum_and_stderr(torch.tensor([2.0]), num_samples=1) == (2.0, math.inf)


class _TiedLM(nn.Module):
    """Embedding -> two blocks of (norm, up, gelu, down) with residuals -> a head tied to the
    embedding: every kind of upstream parameter the propagated term must reach."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.ups = nn.ModuleList(nn.Linear(dim, 4 * dim) for _ in range(2))
        self.downs = nn.ModuleList(nn.Linear(4 * dim, dim, bias=False) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            h = h + down(nn.functional.gelu(up(norm(h))))
        return self.head(h)


def _trained_tied_lm(steps=5):
    torch.manual_seed(0)
    model = _TiedLM()
    tokens = torch.randint(0, 64, (8, 33))
    loss_fn = lambda: nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    return model, convert_linears(model), opt, loss_fn


def test_probed_propagated_term_agrees_with_the_exact_one_within_its_stated_error():
    model, layers, opt, loss_fn = _trained_tied_lm()
    results = {}
    for propagation in (Propagation.EXACT, Propagation.PROBE):
        stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt, propagation=propagation)
        results[propagation] = estimate_divergence(stats, [Format.MXFP4, Format.NVFP4], noise_draws=0, probes=256,
                                                   generator=torch.Generator().manual_seed(0)).layers
        stats.release()
    exact, probed = results[Propagation.EXACT], results[Propagation.PROBE]
    checked = 0
    for fqn in exact:
        for fmt in (Format.MXFP4, Format.NVFP4):
            truth, estimate = exact[fqn].wd_propagated[fmt], probed[fqn].wd_propagated[fmt]
            stderr = probed[fqn].wd_propagated_stderr[fmt]
            if fqn == "ups.0":  # nothing trainable upstream but the embedding and a norm: still reached
                assert truth > 0
            # The stated error: at most sqrt(2 / probes) relative, and the probes' own spread.
            assert stderr <= math.sqrt(2 / 256) * truth * 1.5 + 1e-30, (fqn, fmt)
            # 4 standard errors, plus 5% for the linearized AdamW map the probes use (D is not linear).
            assert abs(estimate - truth) <= 4 * stderr + 0.05 * truth, (fqn, fmt, estimate, truth, stderr)
            # The same SR draws of the gradient GEMMs in both modes: the direct terms are identical.
            assert probed[fqn].wd_direct[fmt] == pytest.approx(exact[fqn].wd_direct[fmt], rel=1e-6)
            checked += 1
    assert checked == 2 * len(layers) == 10


@pytest.mark.parametrize("kernels", ["eager", "compiled"])
def test_update_sensitivity_is_the_derivative_of_the_update_deviation(kernels, monkeypatch):
    monkeypatch.setenv("LIGHTNING_SNIP_QUANTIZERS", kernels)  # adamw's maps, both modes
    torch.manual_seed(0)
    state = read_adam_state(None, nn.Parameter(torch.zeros(3)))
    assert state is None
    m, v = torch.randn(1000) * 1e-3, torch.rand(1000) * 1e-6
    v[:10] = 0.0  # never a gradient before: only this step's enters v
    from lightning_snip.adamw import AdamState

    adam = AdamState(exp_avg=m, exp_avg_sq=v, step=7, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)
    grad = torch.randn(1000, dtype=torch.float64).float() * 1e-3
    delta = torch.randn(1000) * 1e-3
    h = 1e-3
    finite_difference = (adam.update_deviation(grad, h * delta).double() - adam.update_deviation(grad, -h * delta).double()) / (2 * h)
    assert torch.allclose(adam.update_sensitivity(grad).double() * delta, finite_difference, rtol=1e-3, atol=1e-9)
    # Without a gradient the map is AdamW's plain 1/(sqrt(v_hat) + eps) scale.
    zero = adam.update_sensitivity(None)
    expected = adam.lr / (1 - 0.9**8) * 0.1 / ((0.95 * v / (1 - 0.95**8)).sqrt() + 1e-8)
    assert torch.allclose(zero, expected, rtol=1e-5)


def test_a_parameter_used_outside_its_module_is_reported_not_silently_dropped(caplog):
    class Outside(nn.Module):
        def __init__(self):
            super().__init__()
            self.holder = nn.Module()
            self.holder.scale = nn.Parameter(torch.ones(16))  # read by the parent, holder never runs
            self.first = nn.Linear(16, 16)
            self.second = nn.Linear(16, 16)

        def forward(self, x):
            return self.second(torch.tanh(self.first(x * self.holder.scale)))

    model = Outside()
    layers = convert_linears(model)
    x = torch.randn(32, 16)
    stats = collect_stats(model, lambda: model(x).pow(2).mean(), layers=layers)
    with caplog.at_level(logging.WARNING, logger="lightning_snip.divergence"):
        estimate_divergence(stats, [Format.MXFP4], noise_draws=0, probes=2)
    assert "holder.scale" in caplog.text and "propagated term is missing" in caplog.text


def test_probe_round_keeps_no_graph_and_no_copy_of_the_layers_weight_gradients():
    model, layers, opt, loss_fn = _trained_tied_lm()
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    # Held: the embedding (tied to the head), norms and biases; the layers' own weights: recomputed.
    assert set(stats.param_grads) == {"embed.weight", "norms.0.weight", "norms.0.bias", "norms.1.weight",
                                      "norms.1.bias", "ups.0.bias", "ups.1.bias"}
    assert all(stats.is_recomputed(f"{fqn}.weight") for fqn in ("ups.0", "ups.1", "downs.0", "downs.1"))
    assert not stats.is_recomputed("embed.weight")
    assert not any(s.x.requires_grad or s.x.grad_fn is not None for s in stats.layers.values())
    exact = collect_stats(model, loss_fn, layers=layers, optimizer=opt, propagation=Propagation.EXACT)
    for name in exact.param_grads:  # recomputed G^T X equals autograd's gradient
        assert torch.allclose(stats.param_grad(name), exact.param_grads[name], rtol=1e-4, atol=1e-7), name
    exact.release()
    with pytest.raises(RuntimeError, match="Propagation.EXACT"):
        stats.propagate_input_grad("ups.1", torch.zeros(1, 8 * 32, 32))


@pytest.mark.parametrize("propagation", [Propagation.PROBE, Propagation.EXACT])
def test_round_passes_do_not_grow_with_depth_under_probes(propagation, monkeypatch):
    """What makes a round linear in depth, counted rather than timed: with probes, the backward
    passes (recording + noise re-runs) and forward passes (those + probes) are the same for 2 and 4
    blocks; the exact mode adds one vector-Jacobian product per layer."""
    from lightning_snip.demo.model import LlamaConfig, TinyLlama

    counts = {}
    real_grad = torch.autograd.grad

    def counting_grad(*args, **kwargs):
        counts["backward"] = counts.get("backward", 0) + 1
        return real_grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting_grad)
    per_depth = {}
    for blocks in (2, 4):
        torch.manual_seed(0)
        model = TinyLlama(LlamaConfig(dim=32, num_layers=blocks, num_heads=2, num_kv_heads=1, hidden_dim=64))
        tokens = torch.randint(0, 256, (2, 17))
        tokens = (tokens[:, :-1], tokens[:, 1:])
        forwards = []
        model.register_forward_hook(lambda *_: forwards.append(1))
        layers = convert_linears(model)
        counts.clear()
        stats = collect_stats(model, lambda: model.loss(tokens), layers=layers, propagation=propagation)
        estimate_divergence(stats, [Format.MXFP4, Format.NVFP4], noise_draws=2, probes=3,
                            generator=torch.Generator().manual_seed(0))
        stats.release()
        per_depth[blocks] = (counts.get("backward", 0), len(forwards), len(layers))
    (b2, f2, l2), (b4, f4, l4) = per_depth[2], per_depth[4]
    if propagation is Propagation.PROBE:
        # recording + the error probe's independence check (a model's first round) + 2 draws x 2 formats
        assert b2 == b4 == 1 + 1 + 2 * 2
        assert f2 == f4 == 1 + 1 + 2 * 2 + 1  # ... + the 3 probes in one batched pass
    else:
        assert b4 - b2 == l4 - l2  # one product per layer (every layer but the first has something upstream)


class _Reused(nn.Module):
    """A layer called twice, beside layers of equal shapes (shared random signs would bias them)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.mids = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.shared = nn.Linear(32, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        for mid in self.mids:
            h = torch.tanh(mid(h))
        h = torch.tanh(self.shared(h))
        return self.out(torch.tanh(self.shared(h)))


def test_probes_match_the_exact_term_where_it_is_linear_and_report_their_spread_honestly():
    """Without Adam moments D(e) = e is linear: the probes must then agree with the exact vector-
    Jacobian products within their stated standard error, for a layer called twice (both modes use its
    last call) and for layers of equal shapes; and the stated error must match the spread of
    independent estimates."""
    torch.manual_seed(0)
    model = _Reused()
    x, target = torch.randn(64, 16), torch.randn(64, 8)
    layers = convert_linears(model)
    loss_fn = lambda: nn.functional.mse_loss(model(x), target)
    exact_stats = collect_stats(model, loss_fn, layers=layers, propagation=Propagation.EXACT)
    rtn = QuantRecipe(fp4_grad_rounding="nearest")  # E_X deterministic: the seeds change only the probes
    exact = estimate_divergence(exact_stats, [Format.MXFP4], recipe=rtn, noise_draws=0).layers
    exact_stats.release()
    estimates = []
    for seed in range(6):
        stats = collect_stats(model, loss_fn, layers=layers)
        estimates.append(estimate_divergence(stats, [Format.MXFP4], recipe=rtn, noise_draws=0, probes=64,
                                             generator=torch.Generator().manual_seed(seed)).layers)
    for fqn in ("mids.0", "mids.1", "shared", "out"):
        truth = exact[fqn].wd_propagated[Format.MXFP4]
        first = estimates[0][fqn]
        assert truth > 0
        assert abs(first.wd_propagated[Format.MXFP4] - truth) <= 4 * first.wd_propagated_stderr[Format.MXFP4], fqn
        # The stated standard error against the spread of 6 independent 64-probe estimates.
        values = torch.tensor([e[fqn].wd_propagated[Format.MXFP4] for e in estimates], dtype=torch.float64)
        stated = torch.tensor([e[fqn].wd_propagated_stderr[Format.MXFP4] for e in estimates], dtype=torch.float64)
        assert 0.4 < float(values.std() / stated.mean()) < 2.5, fqn


def test_probe_signs_are_independent_across_parameters_and_probes():
    """E[r r^T] = I needs independent signs for every element of every parameter: two parameters of
    the same shape (or two probes) must not share their draws."""
    torch.manual_seed(0)
    model = _Reused()
    layers = convert_linears(model)
    x = torch.randn(8, 16)
    stats = collect_stats(model, lambda: model(x).pow(2).mean(), layers=layers)
    tangent_fns = []
    real = stats.input_tangents
    stats.input_tangents = lambda tangents_of, measure, probes, **kw: tangent_fns.append(tangents_of) or real(
        tangents_of, measure, probes, **kw)
    estimate_divergence(stats, [Format.MXFP4], noise_draws=0, probes=2, generator=torch.Generator().manual_seed(0))
    params = dict(model.named_parameters())
    a, other_probe = tangent_fns[0]("mids.0.weight", params["mids.0.weight"], range(2))
    b = tangent_fns[0]("mids.1.weight", params["mids.1.weight"], range(1))[0]
    again = tangent_fns[0]("mids.0.weight", params["mids.0.weight"], range(1))[0]
    assert torch.equal(other_probe, tangent_fns[0]("mids.0.weight", params["mids.0.weight"], range(1, 2))[0])
    assert set(a.unique().tolist()) == {-1.0, 1.0}  # no Adam moments: the signs themselves
    assert torch.equal(a, again)  # the same tangent wherever the parameter is used (tied weights)
    for other in (b, other_probe):
        assert abs(float((a * other).mean())) < 0.1  # 1024 signs: independent gives |mean| ~ 0.03


def test_a_non_finite_output_error_voids_only_its_layer_and_format(monkeypatch):
    """One layer's NaN forward error (a quantizer fault) must not reach the other layers through the
    error probe, which injects every layer's dY into one forward pass: that pair's LD and WD are inf
    (so an aggregate over rounds drops it), every other value stays finite."""
    import lightning_snip.loss_divergence as div

    model, layers, opt, loss_fn, _ = _setup()
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    second = model.second.weight.detach().clone()
    real = div.quantize_stack

    def nan_for_second(t, fmt, **kw):  # the forward's quantizer of a stack of weights (layers of one shape)
        out = real(t, fmt, **kw).clone()
        for i, part in enumerate(t):
            if not kw.get("is_grad") and fmt is Format.MXFP4 and torch.equal(part, second):
                out[i] = float("nan")
        return out

    monkeypatch.setattr(div, "quantize_stack", nan_for_second)
    result = estimate_divergence(stats, [Format.MXFP4, Format.NVFP4]).layers
    assert math.isinf(result["second"].loss_divergence[Format.MXFP4])
    assert math.isinf(result["second"].weight_divergence[Format.MXFP4])
    finite = [d.loss_divergence[f] for fqn, d in result.items() for f in (Format.MXFP4, Format.NVFP4)
              if (fqn, f) != ("second", Format.MXFP4)]
    finite += [d.weight_divergence[f] for fqn, d in result.items() for f in (Format.MXFP4, Format.NVFP4)
               if (fqn, f) != ("second", Format.MXFP4)]
    assert len(finite) == 2 * (2 * len(result) - 1) and all(math.isfinite(v) for v in finite)


def _Rectangular():
    """Layers whose shapes differ (a transposed operand in a round's GEMM cannot go unnoticed)."""
    return TwoLayer((64, 96, 48))


def _trained_rectangular(autocast: bool):
    """_Rectangular trained 3 AdamW steps on (4, 64) samples, its MSE loss under bf16 autocast or not;
    (model, converted layers, optimizer, loss_fn), the data as loss_fn.x and loss_fn.target."""
    torch.manual_seed(0)
    model = _Rectangular()
    x, target = torch.randn(4, 64, 64), torch.randn(4, 64, 48)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn():
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return nn.functional.mse_loss(model(x).float(), target)

    for _ in range(3):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    loss_fn.x, loss_fn.target = x, target
    return model, convert_linears(model), opt, loss_fn


@pytest.mark.parametrize("autocast", [False, True])
def test_round_precision_follows_the_training_dtype_and_keeps_the_estimates(autocast):
    # RoundPrecision.TRAINING takes each layer's GEMM operands in the dtype its GEMM ran in (bf16 under
    # bf16 autocast: on a GPU, tensor-core GEMMs ~15x faster than fp32 ones); FP32 upcasts them all.
    # Both describe the same quantization: under autocast they must agree to a few percent; in fp32
    # training they are the same computation.
    from lightning_snip.stats import RoundPrecision

    model, layers, opt, loss_fn = _trained_rectangular(autocast)
    results = {}
    for precision in RoundPrecision:
        # EXACT propagation: the probes' estimate is a mean of 8 squares, a few of which dominate (a
        # 1-2% change of E_X moved it by 20% here; 2% with 64 probes), too noisy to compare the two.
        stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt, propagation=Propagation.EXACT)
        assert {s.compute_dtype for s in stats.layers.values()} == {torch.bfloat16 if autocast else torch.float32}
        results[precision] = estimate_divergence(stats, [Format.MXFP4, Format.NVFP4], noise_draws=1,
                                                 generator=torch.Generator().manual_seed(0), precision=precision)
        stats.release()
    checked = 0
    for fqn in layers:
        a, b = results[RoundPrecision.TRAINING].layers[fqn], results[RoundPrecision.FP32].layers[fqn]
        for fmt in (Format.MXFP4, Format.NVFP4):
            for name in ("abs_error_forward", "abs_error_wgrad", "wd_direct", "wd_propagated", "weight_divergence"):
                got, want = getattr(a, name)[fmt], getattr(b, name)[fmt]
                assert got == pytest.approx(want, rel=0.05 if autocast else 1e-4), (fqn, fmt, name)
                checked += 1
    assert checked == 20
    # The first-order term <G, dY> is a signed sum that mostly cancels: the bf16 rounding of the
    # operands moves it by ~15% here. Each precision must give its own, computed independently for
    # the last layer: dY of the GEMM on bf16 operands (as autocast's SNIPLinear runs it) or fp32 ones.
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        h = torch.tanh(model.first(loss_fn.x)).detach()
        y = model.second(h)
    y.retain_grad()
    loss = nn.functional.mse_loss(y.float(), loss_fn.target)
    loss.backward()
    g = y.grad.reshape(-1, 48).float()
    for precision, dtype in ((RoundPrecision.TRAINING, torch.bfloat16 if autocast else torch.float32),
                             (RoundPrecision.FP32, torch.float32)):
        hd, w = h.reshape(-1, 96).to(dtype), model.second.weight.detach().to(dtype)
        for fmt in (Format.MXFP4, Format.NVFP4):
            d = results[precision].layers["second"]
            y_ref = hd.float() @ w.float().t()
            dy = quantized_matmul(hd, w, fmt, recipe=QuantRecipe(), b_is_weight=True, out_dtype=torch.float32) - y_ref
            per_row = (g * dy).sum(1)
            per_sample = per_row.double().reshape(4, -1).sum(1)
            n = loss.item()
            assert d.first_order[fmt] == pytest.approx(float(per_row.sum()) / n, rel=1e-3), (precision, fmt)
            assert d.first_stderr[fmt] == pytest.approx(math.sqrt(4 * float(per_sample.var())) / n, rel=1e-3)
            assert d.abs_error_forward[fmt] == pytest.approx(float(dy.pow(2).sum()), rel=1e-4)


def test_mm_fp32_is_the_fp32_product_of_the_operands():
    from lightning_snip.gemm import mm_fp32

    a, b = torch.randn(40, 64).bfloat16(), torch.randn(24, 64).bfloat16()
    out = mm_fp32(a, b)
    assert out.dtype == torch.float32 and out.shape == (40, 24)
    assert torch.equal(out, a.float() @ b.float().t())  # bf16 products are exact in fp32
    assert torch.equal(mm_fp32(a.float(), b.float()), a.float() @ b.float().t())


@pytest.mark.parametrize("kernels", ["eager", "compiled"])
def test_weight_divergence_denominator_is_the_energy_of_adamws_next_update(kernels, monkeypatch):
    # WD is relative to sum_k ||u_k||^2 of the AdamW step that takes this slice's gradient (its moments
    # advanced by it): checked against torch's own AdamW stepping a copy with those gradients.
    from lightning_snip.weight_divergence import update_energy

    monkeypatch.setenv("LIGHTNING_SNIP_QUANTIZERS", kernels)
    model, layers, opt, loss_fn, _ = _setup()
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    energy = update_energy(stats, stats.param_adam)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (it would share the moments)
    for group in twin_opt.param_groups:
        group["weight_decay"] = 0.0  # the update WD perturbs is the gradient's part
    twin_opt.zero_grad()
    nn.functional.mse_loss(twin(loss_fn.x), loss_fn.target).backward()
    before = [p.detach().double().clone() for p in twin.parameters()]
    twin_opt.step()
    expected = sum(float((b - p.detach().double()).pow(2).sum()) for b, p in zip(before, twin.parameters()))
    assert energy == pytest.approx(expected, rel=1e-3)
    stats.release()


def test_error_probe_injects_each_layers_error_with_its_own_random_sign(monkeypatch):
    # The second-order term's cross-layer terms vanish in expectation only if every layer's sign is
    # random and independent of the others' in each draw.
    model, layers, opt, loss_fn, _ = _setup()
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    injected = []
    original = stats.output_grads_with_noise

    def spy(noise):
        injected.append({fqn: n.clone() for fqn, n in noise.items()})
        return original(noise)

    monkeypatch.setattr(stats, "output_grads_with_noise", spy)
    estimate_divergence(stats, [Format.MXFP4], noise_draws=16, generator=torch.Generator().manual_seed(0))
    stats.release()
    dy = {fqn: quantized_matmul(s.x, s.weight, Format.MXFP4, recipe=QuantRecipe()) - s.x @ s.weight.t()
          for fqn, s in stats.layers.items()}
    assert len(injected) == 16
    signs = [{fqn: float(torch.sign((n * dy[fqn]).sum())) for fqn, n in draw.items()} for draw in injected]
    for draw in injected:  # each injection is exactly +-dY of its own layer
        for fqn, n in draw.items():
            assert torch.allclose(n.abs(), dy[fqn].abs(), rtol=1e-5, atol=1e-7)
    for fqn in dy:
        assert {s[fqn] for s in signs} == {-1.0, 1.0}, fqn
    assert any(s["first"] != s["second"] for s in signs) and any(s["first"] == s["second"] for s in signs)


def test_first_order_sampler_measures_on_the_rounds_operands_under_bf16_autocast():
    # The ACCUMULATED estimator averages the sampled steps' <G, dY> with the round's own: under bf16
    # autocast both must take bf16 operands (the round's RoundPrecision.TRAINING), or the average
    # mixes two quantities (here they differ by ~15%).
    from lightning_snip.first_order import FirstOrderSampler, FirstOrderTerms
    from lightning_snip.stats import RoundPrecision

    model, layers, opt, loss_fn = _trained_rectangular(autocast=True)
    terms = FirstOrderTerms([Format.MXFP4, Format.NVFP4])
    with FirstOrderSampler(layers, 256, terms.add).recording():
        loss = loss_fn()
        loss.backward()
    model.zero_grad()
    sampled = terms.take()
    rounds = {}
    for precision in RoundPrecision:
        stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
        rounds[precision] = estimate_divergence(stats, [Format.MXFP4, Format.NVFP4], noise_draws=0, precision=precision)
        stats.release()
    for fqn in layers:
        for fmt in (Format.MXFP4, Format.NVFP4):
            (value,) = sampled[fqn, fmt]
            training = rounds[RoundPrecision.TRAINING].layers[fqn].first_order[fmt]
            assert value / loss.item() == pytest.approx(training, rel=1e-3), (fqn, fmt)
    fp32 = rounds[RoundPrecision.FP32].layers["second"].first_order[Format.MXFP4]
    assert abs(fp32 - sampled["second", Format.MXFP4][0] / loss.item()) > 0.02 * abs(fp32)  # the check can tell


class _TokenMixing(nn.Module):
    """Two layers and, between them, a fixed linear mixing of each sample's tokens (attention's role):
    the loss is quadratic in both layers' outputs jointly, samples do not interact, tokens of one do."""

    def __init__(self, tokens=8, width=32):
        super().__init__()
        self.first = nn.Linear(width, width, bias=False)
        self.second = nn.Linear(width, width, bias=False)
        self.register_buffer("mix", torch.eye(tokens) + torch.rand(tokens, tokens, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):  # x: (samples, tokens, width)
        return self.second(torch.einsum("st,btd->bsd", self.mix, self.first(x)))


def _token_mixing_round(seed: int, samples: int):
    """(a recorded round of _TokenMixing on random samples, each layer's mxfp4 output error)."""
    torch.manual_seed(seed)
    model = _TokenMixing()
    x, target = torch.randn(samples, 8, 32), torch.randn(samples, 8, 32)
    layers = convert_linears(model)
    stats = collect_stats(model, lambda: nn.functional.mse_loss(model(x), target), layers=layers)
    errors = {(fqn, Format.MXFP4): quantized_matmul(s.x, s.weight, Format.MXFP4, recipe=QuantRecipe()) - s.x @ s.weight.t()
              for fqn, s in stats.layers.items()}
    return stats, errors


def _second_order_draws(stats, output_errors, per_sample, draws, seed=0):
    """Per-draw error-probe values (one draw each) per (layer, format)."""
    from lightning_snip.curvature import error_probe_second_order

    gen = torch.Generator().manual_seed(seed)
    values = {key: [] for key in output_errors}
    for _ in range(draws):
        for key, v in error_probe_second_order(stats, output_errors, [Format.MXFP4], 1, gen,
                                                per_sample=per_sample).items():
            values[key].append(v)
    return values


def test_error_probe_with_a_sign_per_sample_is_unbiased_and_steadier():
    # On a loss quadratic in every layer's output the error probe's expectation is exactly
    # 1/2 dY_l^T H_ll dY_l, which injecting layer l's error alone measures. With a sign per (layer,
    # sample) it must stay unbiased: the cross-token terms inside a sample are kept (a sign per row
    # would drop them: here about 7% of the first layer's term, far above the test's standard error),
    # the cross-sample ones are zero; and the
    # cross-layer noise, a sum of independent per-sample terms instead of the square of their sum,
    # must be smaller than with one sign per layer where the samples' cross-layer terms share a sign
    # (here: samples alike, as a trained model's quantization errors are alike across sequences).
    torch.manual_seed(0)
    model = _TokenMixing()
    x = torch.randn(1, 8, 32) + 0.1 * torch.randn(16, 8, 32)
    target = torch.randn(1, 8, 32) + 0.1 * torch.randn(16, 8, 32)
    layers = convert_linears(model)
    stats = collect_stats(model, lambda: nn.functional.mse_loss(model(x), target), layers=layers)
    assert all(s.leading_sample_dim and s.num_samples == 16 for s in stats.layers.values())
    output_errors = {(fqn, Format.MXFP4): quantized_matmul(s.x, s.weight, Format.MXFP4, recipe=QuantRecipe()) - s.x @ s.weight.t()
                     for fqn, s in stats.layers.items()}
    exact = {}
    for (fqn, fmt), dy in output_errors.items():  # one layer at a time: no cross-layer term
        exact[fqn] = 0.5 * float((dy * (stats.output_grads_with_noise({fqn: dy})[fqn] - stats.layers[fqn].g)).sum())
    spread = {}
    for per_sample in (True, False):
        draws = _second_order_draws(stats, output_errors, per_sample, draws=400)
        for (fqn, _), values in draws.items():
            t = torch.tensor(values, dtype=torch.float64)
            stderr = float(t.std()) / math.sqrt(len(values))
            assert abs(float(t.mean()) - exact[fqn]) < 4 * stderr + 1e-6 * abs(exact[fqn]), (fqn, per_sample)
            assert float(t.std()) > 0  # cross-layer terms present: not a test that holds trivially
            spread[fqn, per_sample] = float(t.std())
    for fqn in exact:
        assert spread[fqn, True] < 0.5 * spread[fqn, False], (fqn, spread)
    stats.release()


def test_error_probe_signs_are_per_sample_for_sample_inputs_and_per_layer_otherwise(monkeypatch):
    # The error probe: every row of a sample carries its sample's sign, samples and layers draw
    # independently; with per_sample=False (the fallback where samples interact), and for a 2-D input
    # (rows that may be one sequence's tokens), one sign for all of a layer's rows.
    from lightning_snip.curvature import error_probe_second_order

    torch.manual_seed(0)
    model = _TokenMixing()
    x, target = torch.randn(6, 8, 32), torch.randn(6, 8, 32)
    flat_model = TwoLayer((32, 32, 32))
    flat_x, flat_target = torch.randn(48, 32), torch.randn(48, 32)
    for net, inputs, t, per_layer_only, per_sample in ((model, x, target, False, True),
                                                       (model, x, target, True, False),
                                                       (flat_model, flat_x, flat_target, False, False)):
        layers = convert_linears(net)
        stats = collect_stats(net, lambda: nn.functional.mse_loss(net(inputs), t), layers=layers)
        injected = []
        original = stats.output_grads_with_noise
        monkeypatch.setattr(stats, "output_grads_with_noise",
                            lambda noise: injected.append({k: n.clone() for k, n in noise.items()}) or original(noise))
        if per_layer_only:
            errors = {(fqn, Format.MXFP4): quantized_matmul(s.x, s.weight, Format.MXFP4, recipe=QuantRecipe())
                      - s.x @ s.weight.t() for fqn, s in stats.layers.items()}
            error_probe_second_order(stats, errors, [Format.MXFP4], 16, torch.Generator().manual_seed(0), per_sample=False)
        else:
            estimate_divergence(stats, [Format.MXFP4], noise_draws=16, generator=torch.Generator().manual_seed(0))
        # (a model's first per-sample round also runs the independence check, first)
        assert len(injected) == 16 + per_sample
        injected = injected[per_sample:]
        units = 6 if per_sample else 1
        signs = []  # per draw: {fqn: (units,) signs}
        for draw in injected:
            per_layer = {}
            for fqn, n in draw.items():
                s = stats.layers[fqn]
                dy = quantized_matmul(s.x, s.weight, Format.MXFP4, recipe=QuantRecipe()) - s.x @ s.weight.t()
                assert torch.allclose(n.abs(), dy.abs(), rtol=1e-5, atol=1e-7)  # exactly +-dY, row by row
                row_signs = torch.sign((n * dy).sum(1)).reshape(units, -1)
                assert (row_signs == row_signs[:, :1]).all(), fqn  # one sign per unit
                per_layer[fqn] = row_signs[:, 0]
            signs.append(per_layer)
        for fqn in stats.layers:
            all_signs = torch.stack([d[fqn] for d in signs])  # draws x units
            assert set(all_signs.flatten().tolist()) == {-1.0, 1.0}
            if per_sample:
                assert any(len(set(row.tolist())) == 2 for row in all_signs), fqn  # samples differ in a draw
        first, second = list(stats.layers)
        assert any(not torch.equal(d[first], d[second]) for d in signs)  # layers draw independently
        stats.release()
        monkeypatch.undo()


class _SequenceFirst(_TokenMixing):
    """_TokenMixing with (tokens, samples, width) inputs: the leading dimension is not the sample."""

    def forward(self, x):
        return self.second(torch.einsum("st,tbd->sbd", self.mix, self.first(x)))


def test_error_probe_keeps_one_sign_per_layer_where_samples_interact(monkeypatch, caplog):
    # A sign per "sample" is exact only where the leading dimension indexes samples that neither the
    # forward pass nor the loss couples. Here it does not (a sequence-first layout; a loss over pairs of
    # samples): the probe must notice at the first round (one extra pass), say so once, and draw one sign
    # per layer, exactly as per_sample=False; a batch-first model with independent samples keeps its signs
    # per sample. The verdict is remembered per model: later rounds run no check pass.
    from lightning_snip.curvature import error_probe_second_order

    torch.manual_seed(0)
    batch_first = _TokenMixing()
    seq_first = _SequenceFirst()
    cases = {
        "sequence-first": (seq_first, torch.randn(8, 6, 32), lambda out, t: nn.functional.mse_loss(out, t), False),
        "paired loss": (_TokenMixing(), torch.randn(6, 8, 32), lambda out, t: (out[0::2] - out[1::2] - t[0::2]).pow(2).mean(), False),
        "independent": (batch_first, torch.randn(6, 8, 32), lambda out, t: nn.functional.mse_loss(out, t), True),
    }
    for name, (net, x, loss_of, independent) in cases.items():
        target = torch.randn_like(x)
        layers = convert_linears(net)
        passes = []
        for _ in range(2):
            stats = collect_stats(net, lambda: loss_of(net(x), target), layers=layers)
            original = stats.output_grads_with_noise
            calls = []
            monkeypatch.setattr(stats, "output_grads_with_noise", lambda noise: calls.append(1) or original(noise))
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="lightning_snip.curvature"):
                estimate_divergence(stats, [Format.MXFP4], noise_draws=3, generator=torch.Generator().manual_seed(0))
            warned = [r for r in caplog.records if "samples of a round interact" in r.getMessage()]
            passes.append((len(calls), len(warned)))
            monkeypatch.undo()
        # the first round: 3 draws + the check pass (and one warning where the samples interact); the
        # second: the remembered verdict, no check, no warning.
        assert passes == [(4, 0 if independent else 1), (3, 0)], (name, passes)
        errors = {(fqn, Format.MXFP4): quantized_matmul(s.x, s.weight, Format.MXFP4, recipe=QuantRecipe())
                  - s.x @ s.weight.t() for fqn, s in stats.layers.items()}
        terms = [error_probe_second_order(stats, errors, [Format.MXFP4], 3, torch.Generator().manual_seed(0),
                                          per_sample=per_sample) for per_sample in (True, False)]
        stats.release()
        assert (terms[0] == terms[1]) != independent, name


def test_error_probe_signs_are_fair_and_independent(monkeypatch):
    # The cross-layer terms vanish in expectation only if E[eps_a eps_b] = 0 for every two signs: each
    # sign fair and independent of the others (a coin with P(+1) = 0.6 leaves 4% of every cross term).
    from lightning_snip.curvature import error_probe_second_order

    stats, errors = _token_mixing_round(seed=0, samples=6)
    error_probe_second_order(stats, errors, [Format.MXFP4], 1, torch.Generator().manual_seed(1))  # the check: independent
    drawn = []

    def record(noise):
        drawn.append(torch.cat([torch.sign((noise[f] * errors[f, Format.MXFP4]).sum(1)).reshape(6, 8)[:, 0]
                                for f in ("first", "second")]))
        return {f: stats.layers[f].g for f in noise}

    monkeypatch.setattr(stats, "output_grads_with_noise", record)
    error_probe_second_order(stats, errors, [Format.MXFP4], 2000, torch.Generator().manual_seed(2))
    signs = torch.stack(drawn).double()  # draws x 12 (6 samples x 2 layers)
    assert signs.abs().eq(1).all()
    limit = 4 / math.sqrt(len(signs))
    assert signs.mean(0).abs().max() < limit  # fair
    products = (signs.t() @ signs) / len(signs) - torch.eye(12, dtype=torch.float64)
    assert products.abs().max() < limit  # pairwise uncorrelated, across samples and layers
    stats.release()


def _backward_count(monkeypatch):
    counts = {"backward": 0}
    real_grad = torch.autograd.grad

    def counting_grad(*args, **kwargs):
        counts["backward"] += 1
        return real_grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting_grad)
    return counts


def test_8bit_curvature_is_the_fp4_errors_quotient_times_the_8bit_error_without_a_pass(monkeypatch):
    model, layers, opt, loss_fn, _ = _setup()
    counts = _backward_count(monkeypatch)
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    before = counts["backward"]
    transfer = estimate_divergence(stats, [Format.FP8, Format.MXFP4], noise_draws=3,
                                   generator=torch.Generator().manual_seed(0)).layers
    passes = counts["backward"] - before
    stats.release()
    assert passes == 3  # 3 draws of mxfp4 only (2-D inputs: no independence check pass)
    for fqn, d in transfer.items():
        quotient = d.second_order[Format.MXFP4] / d.abs_error_forward[Format.MXFP4]
        assert d.second_order[Format.FP8] == pytest.approx(quotient * d.abs_error_forward[Format.FP8], rel=1e-9)
        assert d.second_order[Format.FP8] != 0.0
        # LD was formed from the transferred term (its parts recombined give it back)
        assert d.loss_divergence[Format.FP8] == combine_loss_divergence(
            first=d.first_order[Format.FP8], first_stderr=d.first_stderr[Format.FP8],
            first_accumulated=d.first_accumulated.get(Format.FP8), second=d.second_order[Format.FP8])


def test_8bit_curvature_of_a_layer_without_an_fp4_format_is_probed(monkeypatch):
    model, layers, opt, loss_fn, _ = _setup()
    counts = _backward_count(monkeypatch)
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    before = counts["backward"]
    result = estimate_divergence(stats, [Format.FP8, Format.MXFP4], noise_draws=2,
                                 allowed={"first": [Format.BF16, Format.FP8], "second": list(Format)},
                                 generator=torch.Generator().manual_seed(0)).layers
    stats.release()
    assert counts["backward"] - before == 2 + 2  # mxfp4's draws, then fp8's for "first" alone
    assert math.isinf(result["first"].loss_divergence[Format.MXFP4])
    assert math.isfinite(result["first"].second_order[Format.FP8]) and result["first"].second_order[Format.FP8] != 0.0
    second = result["second"]
    assert second.second_order[Format.FP8] == pytest.approx(
        second.second_order[Format.MXFP4] / second.abs_error_forward[Format.MXFP4] * second.abs_error_forward[Format.FP8],
        rel=1e-9)


def test_a_nan_fp4_curvature_voids_that_format_and_is_not_transferred(monkeypatch):
    """max(0, nan) is 0: a NaN second-order term must make the format +inf (no estimate), not free, and
    must not reach the 8-bit format through the transfer (which then probes it)."""
    import lightning_snip.loss_divergence as div

    model, layers, opt, loss_fn, _ = _setup()
    real = div.error_probe_second_order

    def nan_for_mxfp4(stats, output_errors, formats, *args, **kw):
        out = real(stats, output_errors, formats, *args, **kw)
        return {key: (math.nan if key[1] is Format.MXFP4 and key[0] == "second" else v) for key, v in out.items()}

    monkeypatch.setattr(div, "error_probe_second_order", nan_for_mxfp4)
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    result = estimate_divergence(stats, [Format.FP8, Format.MXFP4], noise_draws=2,
                                 generator=torch.Generator().manual_seed(0)).layers
    stats.release()
    assert math.isinf(result["second"].loss_divergence[Format.MXFP4])
    assert math.isfinite(result["second"].second_order[Format.FP8])  # probed, not transferred
    assert math.isfinite(result["second"].loss_divergence[Format.FP8])
    assert math.isfinite(result["first"].loss_divergence[Format.MXFP4])


def _cubic_probe_setup():
    """One layer whose loss is cubic in its output, L = sum(y^3) / 6: G = y^2 / 2, H = diag(y), so the exact
    second-order term is 1/2 sum(y dY^2) and a one-sided probe adds a third-order term eps h sum(dY^3) / 4 per
    sample, of either sign."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 16, bias=False))
    x = torch.randn(4, 8, 16)
    layers = convert_linears(model)
    stats = collect_stats(model, lambda: (model(x) ** 3).sum() / 6, layers=layers)
    (fqn, s), = stats.layers.items()
    y = s.x @ s.weight.t()
    dy = quantized_matmul(s.x, s.weight, Format.MXFP4, recipe=QuantRecipe()) - y
    exact = 0.5 * float((y * dy * dy).sum())
    return stats, {(fqn, Format.MXFP4): dy}, exact, fqn


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_antithetic_error_probe_cancels_the_third_order_term_exactly(scale):
    from lightning_snip.curvature import error_probe_second_order

    stats, errors, exact, fqn = _cubic_probe_setup()
    for seed in range(3):
        value = error_probe_second_order(stats, errors, [Format.MXFP4], 1, torch.Generator().manual_seed(seed),
                                         scale=scale, antithetic=True)[fqn, Format.MXFP4]
        assert value == pytest.approx(exact, rel=1e-4)
    stats.release()


def test_scaled_error_probe_shrinks_the_higher_order_term_with_the_scale():
    # One-sided, one draw: the third-order term is eps h sum(dY^3) / 4 per sample, so its error falls as the scale:
    # at 0.25 a quarter of the error at 1 (and it is there at all: the probe's curvature is not the exact one).
    from lightning_snip.curvature import error_probe_second_order

    stats, errors, exact, fqn = _cubic_probe_setup()
    deviation = {}
    for scale in (1.0, 0.25):
        value = error_probe_second_order(stats, errors, [Format.MXFP4], 1, torch.Generator().manual_seed(0),
                                         scale=scale)[fqn, Format.MXFP4]
        deviation[scale] = value - exact
    assert abs(deviation[1.0]) > 1e-3 * abs(exact)
    assert deviation[0.25] == pytest.approx(deviation[1.0] / 4, rel=1e-3)
    stats.release()


def test_error_probe_scale_is_divided_out_where_the_loss_is_quadratic():
    # On a quadratic loss the probe measures 1/2 dY^T H dY at every scale: the scale only leaves the pass.
    from lightning_snip.curvature import error_probe_second_order

    stats, errors = _token_mixing_round(seed=4, samples=4)
    values = [error_probe_second_order(stats, errors, [Format.MXFP4], 2, torch.Generator().manual_seed(5), scale=scale,
                                       antithetic=anti) for scale, anti in ((1.0, False), (0.25, False), (0.25, True))]
    for key in errors:
        assert values[1][key] == pytest.approx(values[0][key], rel=1e-3)
        assert values[2][key] == pytest.approx(values[0][key], rel=1e-3)
    with pytest.raises(ValueError, match="scale: expected a finite number > 0, got 0"):
        error_probe_second_order(stats, errors, [Format.MXFP4], 1, None, scale=0)
    stats.release()
