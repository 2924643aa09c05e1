"""The NVFP4 training recipe's pieces (issue 63): the random Hadamard transform on the wgrad GEMM's operands, 2D
16x16 weight scales, stochastic rounding on gradients, as QuantRecipe knobs."""

import subprocess
import sys

import pytest
import torch

from lightning_snip.formats import Format, QuantRecipe, Rounding
from lightning_snip.gemm import quantized_matmul
from lightning_snip.hadamard import HADAMARD_SIZE, hadamard_rows, layer_signs, rht_matrix
from lightning_snip.quantize import fake_quantize

_PLAIN_KNOBS = dict(wgrad_hadamard=(), nvfp4_weight_scales_2d=False)  # the layout before the recipe
PLAIN = QuantRecipe(**_PLAIN_KNOBS)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_the_rht_matrix_is_orthonormal_and_torchaos_for_the_same_signs():
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix

    signs = layer_signs("model.layers.3.mlp.down_proj")
    matrix = rht_matrix(signs)
    assert torch.equal(matrix, get_rht_matrix(signs, "cpu", torch.float32, 16))
    assert torch.equal(matrix, torch.diag(torch.tensor(signs, dtype=torch.float32)) @ _sylvester(16) / 4)
    assert torch.allclose(matrix @ matrix.t(), torch.eye(16), atol=1e-7)


def test_sign_vectors_are_a_function_of_the_layer_name_the_same_in_every_process():
    """Ranks (separate processes) and a resumed run draw the same signs: nothing to send or save."""
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "lm_head"]
    here = [layer_signs(name) for name in names]
    code = ("from lightning_snip.hadamard import layer_signs; "
            f"print([layer_signs(n) for n in {names!r}])")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == repr(here)
    assert len(set(here)) == len(here)  # layers differ
    assert all(len(s) == HADAMARD_SIZE and set(s) <= {1, -1} for s in here)
    with pytest.raises(ValueError, match=r"rht_signs: expected 16 values, each 1 or -1, got \(1, 0"):
        rht_matrix((1, 0) * 8)


@pytest.mark.parametrize("tokens", [64, 50])  # 50: the token axis zero-padded to whole blocks of 16
def test_the_transform_cancels_in_the_wgrad_product_before_quantization(tokens):
    """(G^T R)(X^T R)^T = G^T X: the RHT along the contraction (token) axis leaves the product unchanged; along
    the other axis it would not (the mutation "applied on the wrong axis")."""
    g = torch.Generator().manual_seed(0)
    grads_t, inputs_t = torch.randn(24, tokens, generator=g), torch.randn(40, tokens, generator=g)
    matrix = rht_matrix(layer_signs("layer"))
    a, b = hadamard_rows(grads_t, matrix), hadamard_rows(inputs_t, matrix)
    assert a.shape[1] == b.shape[1] == -(-tokens // 16) * 16
    assert torch.allclose(a @ b.t(), grads_t @ inputs_t.t(), atol=1e-4, rtol=1e-5)
    wrong_axis = hadamard_rows(grads_t[:16].t(), matrix).t() @ hadamard_rows(inputs_t[:16].t(), matrix)
    assert not torch.allclose(wrong_axis, grads_t[:16] @ inputs_t[:16].t(), atol=1e-2)


def test_a_stack_of_layers_takes_each_layers_own_matrix():
    g = torch.Generator().manual_seed(1)
    stacked = torch.randn(3, 8, 40, generator=g)
    matrices = torch.stack([rht_matrix(layer_signs(f"layer{i}")) for i in range(3)])
    together = hadamard_rows(stacked, matrices)
    for i in range(3):
        assert torch.equal(together[i], hadamard_rows(stacked[i], matrices[i]))


@pytest.mark.parametrize("fmt", [Format.NVFP4, Format.MXFP4])
def test_the_wgrad_gemm_quantizes_the_transformed_operands(fmt):
    """quantized_matmul(hadamard=signs) is Q(G^T R) Q(X^T R)^T for a format the recipe transforms, the plain
    Q(G^T) Q(X^T)^T without the knob (the mutation "RHT skipped" fails the first, "RHT always" the second)."""
    g = torch.Generator().manual_seed(2)
    grads_t, inputs_t = torch.randn(32, 96, generator=g), torch.randn(48, 96, generator=g)
    signs = layer_signs("layer")
    recipe = QuantRecipe(wgrad_hadamard=(fmt,), fp4_grad_rounding=Rounding.NEAREST)
    out = quantized_matmul(grads_t, inputs_t, fmt, recipe=recipe, a_is_grad=True, hadamard=signs, out_dtype=torch.float32)
    matrix = rht_matrix(signs)
    expected = (fake_quantize(hadamard_rows(grads_t, matrix), fmt, axis=1, recipe=recipe)
                @ fake_quantize(hadamard_rows(inputs_t, matrix), fmt, axis=1, recipe=recipe).t())
    assert torch.equal(out, expected)
    plain = quantized_matmul(grads_t, inputs_t, fmt, recipe=QuantRecipe(wgrad_hadamard=(), fp4_grad_rounding=Rounding.NEAREST),
                             a_is_grad=True, hadamard=signs, out_dtype=torch.float32)
    assert not torch.equal(plain, out)
    assert torch.equal(plain, fake_quantize(grads_t, fmt, axis=1, recipe=recipe)
                       @ fake_quantize(inputs_t, fmt, axis=1, recipe=recipe).t())


def test_stochastic_rounding_after_the_transform_is_unbiased():
    g = torch.Generator().manual_seed(3)
    grads_t, inputs_t = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    recipe = QuantRecipe(wgrad_hadamard=(Format.NVFP4,))
    assert recipe.fp4_grad_rounding is Rounding.STOCHASTIC
    draws, matrix = torch.Generator().manual_seed(4), rht_matrix(layer_signs("layer"))
    outs = [quantized_matmul(grads_t, inputs_t, Format.NVFP4, recipe=recipe, a_is_grad=True, generator=draws,
                             hadamard=layer_signs("layer"), out_dtype=torch.float32) for _ in range(400)]
    # the activations round to nearest: the mean over draws is G^T R times their quantized transform
    expected = hadamard_rows(grads_t, matrix) @ fake_quantize(hadamard_rows(inputs_t, matrix), Format.NVFP4, axis=1,
                                                              recipe=recipe).t()
    mean = sum(outs) / len(outs)
    assert (mean - expected).abs().max() < 0.2 * (outs[0] - expected).abs().max()


@pytest.mark.parametrize("shape", [(64, 48), (40, 24)])  # (40, 24): both axes padded to whole tiles
def test_2d_weight_scales_give_one_weight_for_the_forward_and_the_dgrad(shape):
    """One E4M3 scale per 16x16 tile: the weight quantized for the forward (along its in-features) is the
    transpose of the one quantized for the dgrad (along its out-features); 1D scales do not have that property
    (the mutation "1D instead of 2D")."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[1])
    forward = fake_quantize(weight, Format.NVFP4, axis=1, scales_2d=True)
    dgrad = fake_quantize(weight.t(), Format.NVFP4, axis=1, scales_2d=True)
    assert torch.equal(forward, dgrad.t())
    one_d = fake_quantize(weight, Format.NVFP4, axis=1), fake_quantize(weight.t(), Format.NVFP4, axis=1)
    assert not torch.equal(one_d[0], one_d[1].t())
    # and through the GEMMs: the recipe's forward and dgrad see that weight
    recipe = QuantRecipe(fp4_grad_rounding=Rounding.NEAREST)
    assert recipe.nvfp4_weight_scales_2d
    x = torch.randn(8, shape[1], generator=g)
    out = quantized_matmul(x, weight, Format.NVFP4, recipe=recipe, b_is_weight=True, out_dtype=torch.float32)
    assert torch.equal(out, fake_quantize(x, Format.NVFP4, axis=1) @ forward.t())
    grad = torch.randn(8, shape[0], generator=g)
    dx = quantized_matmul(grad, weight.t(), Format.NVFP4, recipe=recipe, a_is_grad=True, b_is_weight=True,
                          out_dtype=torch.float32)
    assert torch.equal(dx, fake_quantize(grad, Format.NVFP4, axis=1, recipe=recipe) @ forward)
    plain = quantized_matmul(x, weight, Format.NVFP4, recipe=PLAIN, b_is_weight=True, out_dtype=torch.float32)
    assert torch.equal(plain, fake_quantize(x, Format.NVFP4, axis=1) @ one_d[0].t())


def test_2d_tiles_share_one_scale_and_keep_nvfp4s_two_levels():
    """Each 16x16 tile is quantized with its own E4M3 scale under the tensor's FP32 scale: a tile's values come
    back exactly when they are E2M1 values of one scale, and a tile of large values does not change its
    neighbour's."""
    tile = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0] * 32).reshape(16, 16)
    weight = torch.cat([tile, 100.0 * tile], dim=1)
    out = fake_quantize(weight, Format.NVFP4, axis=1, scales_2d=True)
    assert torch.allclose(out[:, :16], tile, rtol=0.07) and torch.allclose(out[:, 16:], 100.0 * tile, rtol=0.07)
    assert torch.equal(out, fake_quantize(weight, Format.NVFP4, axis=0, scales_2d=True))
    with pytest.raises(ValueError, match="scales_2d: 2D block scales are NVFP4's, for weights rounded to nearest"):
        fake_quantize(weight, Format.MXFP4, axis=1, scales_2d=True)


def test_the_recipe_knobs_are_in_its_key_and_checked():
    recipe = QuantRecipe()
    assert recipe.wgrad_hadamard == (Format.MXFP4, Format.NVFP4) and recipe.nvfp4_weight_scales_2d
    for other in (recipe, PLAIN, QuantRecipe(wgrad_hadamard=("nvfp4",)), QuantRecipe(nvfp4_weight_scales_2d=False)):
        assert QuantRecipe.from_key(other.key) == other
    assert len({r.key for r in (recipe, PLAIN, QuantRecipe(wgrad_hadamard=("nvfp4",)))}) == 3
    with pytest.raises(ValueError, match=r"wgrad_hadamard: invalid value 'fp8'; allowed: FP4 formats \(mxfp4, nvfp4\)"):
        QuantRecipe(wgrad_hadamard=("fp8",))
    with pytest.raises(ValueError, match="nvfp4_weight_scales_2d: expected True or False, got 'yes'"):
        QuantRecipe(nvfp4_weight_scales_2d="yes")


def _recipe_rtn(**knobs) -> QuantRecipe:
    return QuantRecipe(fp4_grad_rounding=Rounding.NEAREST, **knobs)  # deterministic gradient operands


def test_a_layer_trains_with_the_recipe_in_all_three_gemms():
    """SNIPLinear in NVFP4 under the recipe: forward Q(X) Q2D(W)^T, dgrad Q(G) Q2D(W), wgrad Q(G^T R) Q(X^T R)^T
    with R from the layer's own signs (convert_linears names them)."""
    from torch import nn

    from lightning_snip.convert import convert_linears

    torch.manual_seed(0)
    recipe = _recipe_rtn()
    model = nn.Sequential(nn.Linear(64, 48, bias=False))
    layer = convert_linears(model, recipe=recipe, initial_format=Format.NVFP4)["0"]
    assert tuple(layer.rht_signs.tolist()) == layer_signs("0")
    x, g = torch.randn(40, 64, requires_grad=True), torch.randn(40, 48)
    y = model(x)
    y.backward(g)
    w, matrix = model[0].weight.detach(), rht_matrix(layer_signs("0"))
    q_w = fake_quantize(w, Format.NVFP4, axis=1, scales_2d=True)
    assert torch.equal(y.detach(), fake_quantize(x.detach(), Format.NVFP4, axis=1) @ q_w.t())
    assert torch.equal(x.grad, fake_quantize(g, Format.NVFP4, axis=1, recipe=recipe) @ q_w)
    expected = (fake_quantize(hadamard_rows(g.t(), matrix), Format.NVFP4, axis=1, recipe=recipe)
                @ fake_quantize(hadamard_rows(x.detach().t(), matrix), Format.NVFP4, axis=1).t())
    assert torch.equal(model[0].weight.grad, expected)


def test_the_round_measures_the_recipes_wgrad_and_weight():
    """The statistics round prices the GEMMs training runs: its relative wgrad error is the recipe's (each layer's
    RHT), its forward error the 2D-scaled weight's; without the knobs, the plain ones."""
    from torch import nn

    from lightning_snip.convert import convert_linears
    from lightning_snip.statistics_round import estimate_divergence
    from lightning_snip.stats import collect_stats

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32))
    layers = convert_linears(model)
    x, target = torch.randn(48, 64), torch.randn(48, 32)

    def loss_fn():
        return nn.functional.mse_loss(model(x), target)

    stats = collect_stats(model, loss_fn, layers=layers)
    try:
        results = {name: estimate_divergence(stats, [Format.NVFP4], recipe=recipe, noise_draws=0, probes=1).layers
                   for name, recipe in (("recipe", _recipe_rtn()), ("plain", _recipe_rtn(**_PLAIN_KNOBS)))}
        for fqn, layer_stats in stats.layers.items():
            grads, inputs, weight = layer_stats.g.float(), layer_stats.x.float(), layer_stats.weight.detach().float()
            reference, output = grads.t() @ inputs, inputs @ weight.t()
            for name, signs, scales_2d in (("recipe", layer_signs(fqn), True), ("plain", None, False)):
                recipe = _recipe_rtn() if name == "recipe" else _recipe_rtn(**_PLAIN_KNOBS)
                wgrad = quantized_matmul(grads.t(), inputs.t(), Format.NVFP4, recipe=recipe, a_is_grad=True,
                                         hadamard=signs)
                assert results[name][fqn].rel_error_wgrad[Format.NVFP4] == pytest.approx(
                    float((wgrad - reference).norm() / reference.norm()), rel=1e-5), (fqn, name)
                forward = fake_quantize(inputs, Format.NVFP4, axis=1) @ fake_quantize(
                    weight, Format.NVFP4, axis=1, scales_2d=scales_2d).t()
                assert results[name][fqn].abs_error_forward[Format.NVFP4] == pytest.approx(
                    float((forward - output).pow(2).sum()), rel=1e-5), (fqn, name)
    finally:
        stats.release()


_PLAIN_KNOBS = dict(wgrad_hadamard=(), nvfp4_weight_scales_2d=False)


def test_2d_tiles_with_rows_of_one_amax_are_1d_nvfp4():
    """Where every 1x16 block of a tile holds the tile's largest magnitude, a tile's scale is each block's: the 2D
    quantizer gives torchao's 1D NVFP4 (the library's fake_quantize) bit for bit."""
    g = torch.Generator().manual_seed(6)
    weight = torch.rand(32, 48, generator=g) * 2 - 1
    weight[:, ::16] = 1.0  # each block's (and so each tile's) amax 1
    assert torch.equal(fake_quantize(weight, Format.NVFP4, axis=1, scales_2d=True),
                       fake_quantize(weight, Format.NVFP4, axis=1))


def test_the_app_sets_the_knobs_and_bad_values_name_the_field():
    from lightning_snip.config import SNIPConfig

    config = SNIPConfig(wgrad_hadamard=["nvfp4"], nvfp4_weight_scales_2d=False)
    assert config.recipe == QuantRecipe(wgrad_hadamard=(Format.NVFP4,), nvfp4_weight_scales_2d=False)
    assert SNIPConfig().recipe == QuantRecipe()  # the recipe's knobs on by default
    for bad, match in ((dict(wgrad_hadamard=["fp8"]), r"wgrad_hadamard: .*'fp8'.*FP4 formats only"),
                       (dict(wgrad_hadamard="nvfp4"), r"wgrad_hadamard: .*'nvfp4'.*a list of FP4 formats"),
                       (dict(nvfp4_weight_scales_2d="yes"), r"nvfp4_weight_scales_2d: .*'yes'.*true or false")):
        with pytest.raises(ValueError, match=match):
            SNIPConfig(**bad)
    with pytest.raises(ValueError, match=r"wgrad_hadamard: expected a list of FP4 formats"):
        QuantRecipe(wgrad_hadamard="nvfp4")


def test_blocks_compiled_one_by_one_share_their_graph_despite_their_own_signs():
    """Each layer has its own signs, held as a tensor (a graph input, not a guarded constant): blocks compiled one by
    one (all of one code object, lightning_snip.recompile) share their graph, as with one sign vector for all (a
    tuple of signs made every block its own graph, past dynamo's recompile limit)."""
    from torch import nn
    from torch._dynamo.utils import counters

    from lightning_snip.convert import convert_linears
    from lightning_snip.hadamard import check_signs, sign_tensor

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(64, 64, bias=False)

        def forward(self, x):
            return x + self.up(x)

    graphs = {}
    for shared in (False, True):
        torch.manual_seed(0)
        blocks = nn.Sequential(*[Block() for _ in range(4)])
        layers = convert_linears(blocks, initial_format=Format.NVFP4)
        if shared:
            for layer in layers.values():
                layer.rht_signs = sign_tensor("")
        assert len({check_signs(layer.rht_signs) for layer in layers.values()}) == (1 if shared else 4)
        for block in blocks:
            block.compile(backend="eager")
        torch._dynamo.reset()
        counters.clear()
        blocks(torch.randn(32, 64, requires_grad=True)).sum().backward()
        graphs[shared] = counters["stats"]["unique_graphs"]
    assert graphs[False] == graphs[True]


def test_the_recipe_reaches_the_wgrad_under_bf16_autocast():
    """Under autocast SNIPLinear casts its operands and calls its GEMMs itself: the wgrad still takes the layer's
    RHT (the layer's own, bit for bit against quantized_matmul on the cast operands)."""
    from torch import nn

    from lightning_snip.convert import convert_linears

    torch.manual_seed(2)
    recipe = _recipe_rtn()
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    layer = convert_linears(model, recipe=recipe, initial_format=Format.MXFP4)["0"]
    assert layer.format is Format.MXFP4
    x, g = torch.randn(40, 64), torch.randn(40, 64).bfloat16()
    with torch.autocast("cpu", torch.bfloat16):
        y = model(x)
    y.backward(g)
    xb, signs = x.bfloat16(), layer_signs("0")
    expected = quantized_matmul(g.t(), xb.t(), Format.MXFP4, recipe=recipe, a_is_grad=True, hadamard=signs).float()
    plain = quantized_matmul(g.t(), xb.t(), Format.MXFP4, recipe=recipe, a_is_grad=True).float()
    assert torch.equal(model[0].weight.grad, expected) and not torch.equal(expected, plain)


def test_the_cost_model_prices_the_rht_on_the_wgrads_it_transforms():
    """The RHT costs 32 T (in + out) bf16-rate FLOPs per wgrad (two operands, a 16x16 matmul per 16 tokens): the
    planner's layers carry it per FLOP where the recipe transforms the format, the per-GEMM split keeps it on the
    backward, a plan's relative cost and its saved form include it, and a cost budget is met with it."""
    import dataclasses

    from lightning_snip.evidence import layer_candidates
    from lightning_snip.formats import hadamard_backward_cost
    from lightning_snip.linear import SNIPLinear
    from lightning_snip.plan import Plan
    from lightning_snip.planner import LayerCandidates, solve_gemm_plan, solve_plan, split_directions

    assert hadamard_backward_cost(576, 576) == pytest.approx(32 * (576 + 576) / (4 * 576 * 576))
    layers = {"a": SNIPLinear(64, 32), "b": SNIPLinear(64, 32, recipe=QuantRecipe(wgrad_hadamard=("nvfp4",))),
              "c": SNIPLinear(64, 32, recipe=PLAIN)}
    cands = {c.fqn: c for c in layer_candidates(layers, [Format.FP8, Format.MXFP4, Format.NVFP4])}
    rht = 2 / 3 * hadamard_backward_cost(64, 32)  # per FLOP of the layer's three GEMMs
    assert dict(cands["a"].extra_cost) == {Format.MXFP4: pytest.approx(rht), Format.NVFP4: pytest.approx(rht)}
    assert dict(cands["b"].extra_cost) == {Format.NVFP4: pytest.approx(rht)} and not cands["c"].extra_cost
    forward, backward = split_directions(cands["a"])
    assert not forward.extra_cost and backward.flops * backward.extra_cost[Format.MXFP4] == pytest.approx(
        cands["a"].flops * rht)
    mx = {c.fqn: c for c in layer_candidates(layers, [Format.FP8, Format.MXFP4])}  # only a's mxfp4 transformed
    all_fp4 = solve_plan(list(mx.values()), fp4_fraction=1.0)
    assert all_fp4.relative_gemm_cost == pytest.approx(0.25 + rht / 3)
    assert Plan.from_json(all_fp4.to_json()).relative_gemm_cost == pytest.approx(all_fp4.relative_gemm_cost)
    per_gemm = solve_gemm_plan(list(mx.values()), fp4_fraction=1.0)
    assert per_gemm.relative_gemm_cost == pytest.approx(all_fp4.relative_gemm_cost)
    # Under a cost budget between all-FP4 without the RHT and with it, the transformed backward goes to FP8
    # (FP4 is what the divergences prefer here); without the price, everything would stay FP4.
    prefer_fp4 = {Format.FP8: 1.0, Format.MXFP4: 0.0}
    two = [LayerCandidates(c.fqn, c.flops, prefer_fp4, prefer_fp4, extra_cost=c.extra_cost) for c in (mx["a"], mx["c"])]
    budget = 0.25 + 0.5 * rht - 0.01  # all-FP4 costs 0.25 + 0.5 rht; a's backward in FP8 0.25 + 0.5 * 2/3 * 0.25
    assert 0.25 + 0.5 * 2 / 3 * 0.25 < budget
    plan = solve_gemm_plan(two, cost_budget=budget)
    assert plan.relative_gemm_cost <= budget + 1e-9
    assert {k: f.value for k, f in plan.items()} == {"a:forward": "mxfp4", "a:backward": "fp8", "c:forward": "mxfp4",
                                                     "c:backward": "mxfp4"}
    unpriced = solve_gemm_plan([dataclasses.replace(t, extra_cost={}) for t in two], cost_budget=budget)
    assert all(f is Format.MXFP4 for f in unpriced.values())
    with pytest.raises(ValueError, match="extra_cost of x: must be finite numbers >= 0"):
        LayerCandidates("x", 1.0, {Format.FP8: 0.0}, {Format.FP8: 0.0}, extra_cost={Format.MXFP4: -1.0})


def test_the_rhts_price_survives_every_path_a_plan_takes():
    """The price stays where plans are made other than by the solver: a baseline's plan, a layer whose backward the
    noise guard keeps out of one FP4 format, a cost budget the RHT makes unreachable (named at the check), and a
    plan made by hand or saved before the price (priced when the controller applies it at train start)."""
    from lightning_snip.baselines import uniform_plan
    from lightning_snip.config import SNIPConfig
    from lightning_snip.controller import SNIPController
    from lightning_snip.demo.model import LlamaConfig, TinyLlama
    from lightning_snip.evidence import layer_candidates, priced_plan
    from lightning_snip.formats import hadamard_backward_cost
    from lightning_snip.linear import SNIPLinear
    from lightning_snip.plan import Plan
    from lightning_snip.planner import PlanInfeasibleError, check_target, gemm_items

    layers = {"a": SNIPLinear(64, 32), "b": SNIPLinear(64, 32)}
    cands = layer_candidates(layers, [Format.FP8, Format.MXFP4, Format.NVFP4])
    rht = hadamard_backward_cost(64, 32)
    assert uniform_plan(cands, "nvfp4").relative_gemm_cost == pytest.approx(0.25 + 2 / 3 * rht)
    guarded = gemm_items(cands, {"a": {Format.MXFP4}})
    backward_a = next(item for item in guarded if item.fqn == "a:backward")
    assert backward_a.extra_cost[Format.NVFP4] == pytest.approx(rht)
    with pytest.raises(PlanInfeasibleError, match="relative cost budget 0.26 is unreachable"):
        check_target(gemm_items([c for c in cands]), cost_budget=0.26)  # reachable at 0.25 without the RHT
    with pytest.raises(ValueError, match="extra_cost: must be finite numbers >= 0 for planned keys"):
        Plan(formats={"a": "fp8"}, flops={"a": 1.0}, extra_cost={"c": {"mxfp4": 0.1}})
    hand = Plan(formats={"a:forward": "nvfp4", "a:backward": "nvfp4", "b:forward": "fp8", "b:backward": "fp8"},
                flops={"a:forward": 1.0, "a:backward": 2.0, "b:forward": 1.0, "b:backward": 2.0})
    priced = priced_plan(hand, layers)
    assert priced.relative_gemm_cost == pytest.approx(hand.relative_gemm_cost + 2 / 6 * rht)
    assert priced_plan(priced, layers) is priced and dict(priced) == dict(hand)
    # the controller prices a plan given to it when it applies it at train start
    model = TinyLlama(LlamaConfig(dim=64, num_layers=1, num_heads=4, num_kv_heads=2, hidden_dim=128))
    keys = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    plan = Plan(formats={k: "nvfp4" for k in keys}, flops=dict.fromkeys(keys, 1.0))
    controller = SNIPController(SNIPConfig(replan=False), plan=plan)
    controller.attach(model)
    controller.resume(model)
    assert controller.plan.relative_gemm_cost > 0.25 and dict(controller.plan) == dict(plan)
