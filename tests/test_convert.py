import logging

import pytest
import torch
from torch import nn

from lightning_snip.convert import apply_plan, convert_linears, glob_filter, switchable_layers
from lightning_snip.formats import Format
from lightning_snip.hadamard import layer_signs
from lightning_snip.linear import SNIPLinear


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(64, 128), "down": nn.Linear(128, 64)}) for _ in range(2)
        )
        self.head = nn.Linear(64, 64)

    def forward(self, x):
        for b in self.blocks:
            x = x + b["down"](torch.relu(b["up"](x)))
        return self.head(x)


def test_convert_keeps_parameters_and_state_dict(tmp_path):
    model = Tiny()
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    layers = convert_linears(model, pins={"head": "bf16"}, initial_format="fp8")
    assert set(layers) == {"blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head"}
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    assert layers["head"].format is Format.BF16 and layers["head"].pinned is Format.BF16
    assert layers["blocks.0.up"].format is Format.FP8
    path = tmp_path / "ckpt.pt"
    torch.save(model.state_dict(), path)
    plain = Tiny()
    plain.load_state_dict(torch.load(path, weights_only=True), strict=True)
    x = torch.randn(3, 64)
    apply_plan(model, {fqn: "bf16" for fqn in layers})
    assert torch.allclose(plain(x), model(x))


def test_filter_and_bad_filter():
    model = Tiny()
    layers = convert_linears(model, filter=glob_filter(include=("blocks.*",), exclude=("*.down",)))
    assert set(layers) == {"blocks.0.up", "blocks.1.up"}
    assert isinstance(model.head, nn.Linear) and not isinstance(model.head, SNIPLinear)
    with pytest.raises(ValueError, match="filter: selects no"):
        convert_linears(Tiny(), filter=glob_filter(include=("nothing*",)))
    with pytest.raises(ValueError, match="pins: pattern"):
        convert_linears(Tiny(), pins={"lm_head": "bf16"})


def test_incompatible_dimensions_stay_high_with_warning(caplog):
    model = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 64))
    with caplog.at_level(logging.WARNING):
        layers = convert_linears(model, initial_format="mxfp4")
    assert layers["0"].format is Format.BF16 and "layer 0 (64->40)" in caplog.text
    assert layers["0"].allowed_formats == {Format.BF16, Format.FP8}


def test_apply_plan_validates_before_changing():
    model = Tiny()
    convert_linears(model, pins={"head": "bf16"})
    with pytest.raises(ValueError, match="pinned"):
        apply_plan(model, {"blocks.0.up": "mxfp4", "head": "nvfp4"})
    assert model.blocks[0]["up"].format is Format.BF16  # nothing applied
    with pytest.raises(ValueError, match="not a converted layer"):
        apply_plan(model, {"blocks.9.up": "mxfp4"})
    apply_plan(model, {"blocks.0.up": "mxfp4", "blocks.1.down": Format.NVFP4})
    assert {f: m.format.value for f, m in switchable_layers(model).items()}["blocks.1.down"] == "nvfp4"


def test_switching_mid_training_keeps_optimizer_state_and_learns():
    torch.manual_seed(0)
    model = Tiny()
    layers = convert_linears(model, pins={"head": "bf16"})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(256, 64)
    target = torch.sin(x @ torch.randn(64, 64) / 8)
    losses = []
    for step in range(90):
        if step == 30:
            state_before = {id(p): opt.state[p]["exp_avg"].clone() for p in model.parameters()}
            apply_plan(model, {f: "mxfp4" for f in layers if f != "head"})
            assert all(id(p) in state_before for p in model.parameters())
            assert all(torch.equal(opt.state[p]["exp_avg"], state_before[id(p)]) for p in model.parameters())
        if step == 60:
            apply_plan(model, {f: "fp8" for f in layers if f != "head"})
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert opt.state[model.blocks[0]["up"].weight]["step"] == 90
    assert losses[59] < losses[30] < losses[0]
    assert losses[89] < losses[60]


def test_per_gemm_plan_runs_each_direction_in_its_format():
    from lightning_snip.formats import QuantRecipe
    from lightning_snip.gemm import quantized_matmul
    from lightning_snip.plan import BACKWARD, FORWARD, gemm_key

    torch.manual_seed(0)
    rtn = QuantRecipe(fp4_grad_rounding="nearest")  # deterministic gradient GEMMs
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    layers = convert_linears(model, recipe=rtn)
    x = torch.randn(32, 64, requires_grad=True)
    g = torch.randn(32, 64)
    w = model[0].weight.detach()

    def gemms(fwd, bwd):
        apply_plan(model, {gemm_key("0", FORWARD): fwd, gemm_key("0", BACKWARD): bwd})
        x.grad, model[0].weight.grad = None, None
        y = model(x)
        y.backward(g)
        return y.detach(), x.grad.clone(), model[0].weight.grad.clone()

    y, dx, dw = gemms(Format.FP8, Format.MXFP4)
    assert layers["0"].format is Format.FP8 and layers["0"].backward_format is Format.MXFP4
    # Each GEMM against its own reference: forward in fp8, dgrad and wgrad in mxfp4.
    assert torch.equal(y, quantized_matmul(x.detach(), w, Format.FP8, recipe=rtn))
    assert torch.equal(dx, quantized_matmul(g, w.t(), Format.MXFP4, recipe=rtn, a_is_grad=True))
    assert torch.equal(dw, quantized_matmul(g.t(), x.detach().t(), Format.MXFP4, recipe=rtn, a_is_grad=True,
                                            hadamard=layers["0"].rht_signs))  # (the layer's own RHT signs)
    assert tuple(layers["0"].rht_signs.tolist()) == layer_signs("0") != layer_signs("1")
    # ... and the swapped assignment differs in every GEMM (the test can tell the directions apart).
    y2, dx2, dw2 = gemms(Format.MXFP4, Format.FP8)
    assert not torch.equal(y, y2) and not torch.equal(dx, dx2) and not torch.equal(dw, dw2)
    # A layer key sets all three GEMMs again; a plan with one direction only is rejected.
    apply_plan(model, {"0": Format.FP8})
    assert layers["0"].backward_format is None
    with pytest.raises(ValueError, match="needs one format, or both a forward and a backward one"):
        apply_plan(model, {gemm_key("0", FORWARD): Format.FP8})
