"""Layers of one shape stacked in the statistics round (lightning_snip.groups): the stacked quantizers
and GEMMs give every layer's numbers bit for bit, stochastic rounding included, and a whole round with
groups gives the round of one layer at a time, on the demo model and on a Hugging Face Llama."""

import contextlib
import dataclasses
import inspect
import json
import types
from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F

from lightning_snip.convert import convert_linears
from lightning_snip.statistics_round import estimate_divergence
from lightning_snip.formats import Format, Fp8Scaling, QuantRecipe, Rounding
from lightning_snip.gemm import bmm_fp32, mm_fp32
from lightning_snip.hadamard import layer_signs
from lightning_snip.grid import random_bits, uniforms_from_bits
from lightning_snip.groups import MAX_GROUP_BYTES, layer_groups, quantize_stack, row_scaled, working_bytes
from lightning_snip.quantize import fake_quantize, padded_numel
from lightning_snip.stats import Propagation, collect_stats

ALL = [Format.FP8, Format.MXFP8, Format.MXFP4, Format.NVFP4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("scaling", [Fp8Scaling.ROWWISE, Fp8Scaling.TENSORWISE])
def test_a_stack_quantizes_as_its_slices(fmt, dtype, scaling):
    torch.manual_seed(0)
    recipe = QuantRecipe(fp8_scaling=scaling)
    # slices of very different magnitudes: a scale shared across slices (NVFP4's per-tensor one) would show
    t = (torch.randn(3, 40, 80) * torch.tensor([1e-3, 1.0, 300.0]).view(3, 1, 1)).to(dtype)
    for is_grad in (False, True):
        stacked = quantize_stack(t, fmt, recipe=recipe, is_grad=is_grad)
        for i in range(3):
            assert torch.equal(stacked[i], fake_quantize(t[i], fmt, axis=1, recipe=recipe, is_grad=is_grad))


def test_which_formats_scale_row_by_row():
    assert row_scaled(Format.FP8, QuantRecipe()) and row_scaled(Format.MXFP8, QuantRecipe())
    assert row_scaled(Format.MXFP4, QuantRecipe())
    assert not row_scaled(Format.NVFP4, QuantRecipe())
    assert not row_scaled(Format.FP8, QuantRecipe(fp8_scaling=Fp8Scaling.TENSORWISE))


@pytest.mark.parametrize("fmt", [Format.MXFP4, Format.NVFP4])
def test_stochastic_rounding_of_a_stack_draws_each_slices_uniforms(fmt):
    torch.manual_seed(0)
    t = torch.randn(4, 24, 70)  # 70 columns: padded to whole blocks
    generator = torch.Generator().manual_seed(7)
    bits = [random_bits(padded_numel((24, 70), fmt, 1), generator, t.device) for _ in range(4)]
    stacked = quantize_stack(t, fmt, recipe=QuantRecipe(), is_grad=True, rounding=Rounding.STOCHASTIC, bits=bits)
    again = torch.Generator().manual_seed(7)
    for i in range(4):  # layer by layer, each drawing from the generator in turn
        one = fake_quantize(t[i], fmt, axis=1, rounding=Rounding.STOCHASTIC, is_grad=True, generator=again)
        assert torch.equal(stacked[i], one)
    assert not torch.equal(stacked[0], stacked[1])


def test_two_dimensional_bits_give_each_slice_its_own_uniforms():
    bits = torch.tensor([[1 | (2 << 24), 3 | (4 << 24)], [5 | (6 << 24), 7 | (8 << 24)]])
    # in units of 2^-24: slice 0's draw gives 1, 3, 2, 4 (as alone), slice 1's 5, 7, 6, 8
    assert (uniforms_from_bits(bits, (2, 4)) * 2**24).tolist() == [[1, 3, 2, 4], [5, 7, 6, 8]]
    assert (uniforms_from_bits(bits, (6,)) * 2**24).tolist() == [1, 3, 2, 5, 7, 6]  # 3 elements a slice
    assert (uniforms_from_bits(bits[0], (3,)) * 2**24).tolist() == [1, 3, 2]


def test_bad_bits_are_refused():
    t = torch.randn(2, 8, 32)
    with pytest.raises(ValueError, match="bits"):
        quantize_stack(t, Format.MXFP4, recipe=QuantRecipe(), rounding=Rounding.STOCHASTIC)
    with pytest.raises(ValueError, match="bits"):
        quantize_stack(t, Format.MXFP4, recipe=QuantRecipe(), bits=[torch.zeros(128, dtype=torch.int64)] * 2)
    with pytest.raises(ValueError, match=r"bits: expected shape \(128,\)"):
        fake_quantize(t[0], Format.MXFP4, axis=1, rounding=Rounding.STOCHASTIC, bits=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"bits: expected shape \(2, 128\) .* 2 slices of 256 elements"):
        fake_quantize(t.reshape(16, 32), Format.MXFP4, axis=1, rounding=Rounding.STOCHASTIC,
                      bits=torch.zeros(2, 127, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_fp32_is_mm_fp32_slice_by_slice(dtype):
    torch.manual_seed(0)
    a, b = torch.randn(5, 64, 96).to(dtype), torch.randn(5, 48, 96).to(dtype)
    out = bmm_fp32(a, b)
    assert out.dtype == torch.float32
    for i in range(5):
        assert torch.equal(out[i], mm_fp32(a[i], b[i]))


class _Stats:
    """What layer_groups reads of a Statistics."""

    def __init__(self, shapes, sharded=False):
        from lightning_snip.stats import LayerStats

        self.sharded = sharded
        self.layers = {f"l{i}": LayerStats(f"l{i}", torch.zeros(8, k), torch.zeros(8, n), torch.zeros(n, k), 2)
                       for i, (k, n) in enumerate(shapes)}
        # each layer's RHT signs, as convert_linears names them (what _quantized_bmm reads of the modules)
        self.layer_modules = {fqn: types.SimpleNamespace(rht_signs=layer_signs(fqn)) for fqn in self.layers}


def test_layer_groups_by_shape_in_order_and_chunked():
    stats = _Stats([(4, 4), (4, 8), (4, 4), (8, 4), (4, 4), (4, 8), (4, 4)])
    assert layer_groups(stats, stats.layers, "training") == [["l0", "l2", "l4", "l6"], ["l1", "l5"], ["l3"]]
    # a shape's chunks in the order of their first member too (a group draws the bits of the layers before its
    # last member: _GradientBits)
    assert layer_groups(stats, stats.layers, "training", max_layers=3) == [["l0", "l2", "l4"], ["l1", "l5"], ["l3"], ["l6"]]
    assert layer_groups(stats, stats.layers, "training", max_layers=1) == [[fqn] for fqn in stats.layers]
    by_formats = layer_groups(stats, stats.layers, "training", extra_key=lambda fqn: fqn in ("l0", "l2"))
    assert by_formats == [["l0", "l2"], ["l1", "l5"], ["l3"], ["l4", "l6"]]
    sharded = _Stats([(4, 4), (4, 4)], sharded=True)
    assert layer_groups(sharded, sharded.layers, "training") == [["l0"], ["l1"]]
    with pytest.raises(ValueError, match="max_layers: invalid value 0"):
        layer_groups(stats, stats.layers, "training", max_layers=0)


def test_layer_groups_hold_at_most_max_bytes():
    stats = _Stats([(4, 4)] * 6 + [(4, 8)])
    size = {"l0": 5, "l1": 5, "l2": 5, "l3": 20, "l4": 1, "l5": 1, "l6": 30}
    groups = layer_groups(stats, stats.layers, "training", layer_bytes=size.get, max_bytes=10)
    # a group closes when the next layer would take it over 10; a layer over it (l3, l6) is a group alone
    assert groups == [["l0", "l1"], ["l2"], ["l3"], ["l4", "l5"], ["l6"]]
    assert layer_groups(stats, stats.layers, "training", layer_bytes=size.get, max_bytes=10, max_layers=1) == [
        [fqn] for fqn in stats.layers]
    assert layer_groups(stats, stats.layers, "training", layer_bytes=size.get) == [[f"l{i}" for i in range(6)], ["l6"]]


def test_working_bytes_prices_operands_and_weight_copies():
    s = _Stats([(4, 8)]).layers["l0"]  # X 8 x 4, G 8 x 8, W 8 x 4
    assert working_bytes(s, 2) == 4 * (3 * (32 + 64) + 5 * 32)
    assert MAX_GROUP_BYTES == 1 << 30
    assert inspect.signature(layer_groups).parameters["max_bytes"].default == MAX_GROUP_BYTES


def test_a_rounds_groups_are_capped_by_their_working_bytes(monkeypatch):
    """The round passes each layer's working_bytes to layer_groups (the default cap MAX_GROUP_BYTES): with a
    cap of one layer's bytes, every group holds one layer."""
    import lightning_snip.round_inputs as div

    seen, real = [], div.layer_groups

    def spy(*args, layer_bytes, **kw):
        assert "max_bytes" not in kw  # the default: MAX_GROUP_BYTES
        groups = real(*args, layer_bytes=layer_bytes, max_bytes=min(layer_bytes(f) for f in args[1]), **kw)
        seen.append(groups)
        return groups

    monkeypatch.setattr(div, "layer_groups", spy)
    model, loss_fn = _demo()
    stats = collect_stats(model, loss_fn, layers=convert_linears(model))
    try:
        estimate_divergence(stats, [Format.MXFP4, Format.FP8], noise_draws=1, probes=1, group_layers=16)
    finally:
        stats.release()
    assert len(seen) == 3 and all(len(g) == 1 for groups in seen for g in groups)
    assert sorted(g[0] for g in seen[0]) == sorted(stats.layers)


class _Round:
    """What _GradientBits and _quantized_bmm read of a round's inputs."""

    def __init__(self, shapes, generator):
        self.stats = _Stats(shapes)
        self.recipe, self.generator = QuantRecipe(), generator


def test_gradient_bits_are_drawn_in_layer_order_only_when_a_group_needs_them():
    from lightning_snip.weight_divergence import _GradientBits

    shapes = [(32, 64), (32, 96), (32, 64)]
    keys = [(f"l{i}", f) for i in range(3) for f in (Format.FP8, Format.MXFP4, Format.NVFP4)]
    bits = _GradientBits(_Round(shapes, torch.Generator().manual_seed(3)), keys, "g_t")
    assert bits.keys == [k for k in keys if k[1] is not Format.FP8]  # FP8 rounds to nearest: no bits
    assert not bits.draws(("l0", Format.FP8)) and bits.draws(("l2", Format.MXFP4))
    again = torch.Generator().manual_seed(3)
    expected = {(fqn, f): random_bits(padded_numel((shapes[int(fqn[1])][1], 8), f, 1), again, "cpu")
                for fqn, f in bits.keys}
    # a group of l0 and l2 draws l1's bits in between and keeps them for l1's group
    taken = bits.take([("l0", Format.MXFP4), ("l2", Format.MXFP4)])
    assert bits._next == 5 and set(bits._drawn) == {("l0", Format.NVFP4), ("l1", Format.MXFP4), ("l1", Format.NVFP4)}
    assert torch.equal(taken[0], expected["l0", Format.MXFP4]) and torch.equal(taken[1], expected["l2", Format.MXFP4])
    assert torch.equal(bits.take([("l1", Format.NVFP4)])[0], expected["l1", Format.NVFP4])
    with pytest.raises(KeyError, match="already taken"):
        bits.take([("l0", Format.MXFP4)])
    with pytest.raises(KeyError, match="rounds without these bits"):
        bits.take([("l0", Format.FP8)])


def test_groups_of_one_hold_one_layers_bits():
    from lightning_snip.weight_divergence import _GradientBits

    keys = [(f"l{i}", Format.MXFP4) for i in range(4)]
    bits = _GradientBits(_Round([(32, 64)] * 4, torch.Generator().manual_seed(0)), keys, "g")
    for key in keys:
        bits.take([key])
        assert not bits._drawn and bits._next == keys.index(key) + 1


def test_interleaved_groups_hold_the_bits_of_few_other_layers():
    """Blocks of q, k, o, down (q and o of one shape): groups of 4 in the order of their first member draw
    ahead, and hold, at most 6 other layers' bits (shape by shape, the q/o groups first, it was 15: every
    k and down layer's before the last q/o group)."""
    from lightning_snip.weight_divergence import _GradientBits

    r = _Round([(32, 64), (32, 32), (32, 64), (64, 32)] * 8, torch.Generator().manual_seed(0))
    fqns = list(r.stats.layers)
    bits = _GradientBits(r, [(fqn, Format.MXFP4) for fqn in fqns], "g")
    held = []
    for group in layer_groups(r.stats, fqns, "training", max_layers=4):
        bits.take([(fqn, Format.MXFP4) for fqn in group])
        held.append(len(bits._drawn))
    assert max(held) == 6 and held[-1] == 0


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("operand", ["g", "g_t"])
def test_a_groups_gradient_gemm_is_quantized_matmul_layer_by_layer(fmt, operand):
    """_quantized_bmm of a stack against quantized_matmul (the training GEMMs' path, not the stacked
    quantizers), one layer after another from the same generator: stochastic rounding included, with the recipe's
    2D NVFP4 weight scales on dgrad's W^T and each layer's own RHT on wgrad's operands."""
    from lightning_snip.weight_divergence import _GradientBits, _quantized_bmm
    from lightning_snip.gemm import quantized_matmul

    torch.manual_seed(0)
    rows, out, k = 40, 48, 70  # G: rows x out; dgrad contracts over out (G, W^T), wgrad over rows (G^T, X^T)
    shapes = [(k, out)] * 3
    grads = torch.randn(3, rows, out) * torch.tensor([1e-2, 1.0, 50.0]).view(3, 1, 1)
    others = torch.randn(3, k, out) if operand == "g" else torch.randn(3, k, rows)
    if operand == "g_t":
        grads = grads.transpose(1, 2).contiguous()
    group = ["l0", "l1", "l2"]
    r = _Round(shapes, torch.Generator().manual_seed(11))
    r.stats.layers = {fqn: dataclasses.replace(s, x=torch.zeros(rows, k), g=torch.zeros(rows, out))
                      for fqn, s in r.stats.layers.items()}
    got = _quantized_bmm(r, grads, others, fmt, group, _GradientBits(r, [(f, fmt) for f in group], operand),
                         wgrad=operand == "g_t")
    generator = torch.Generator().manual_seed(11)
    for i in range(3):
        one = quantized_matmul(grads[i], others[i], fmt, recipe=QuantRecipe(), a_is_grad=True, generator=generator,
                               b_is_weight=operand == "g", hadamard=layer_signs(f"l{i}") if operand == "g_t" else None,
                               out_dtype=torch.float32)
        assert torch.equal(got[i], one), i


def _demo():
    from lightning_snip.demo.model import LlamaConfig, TinyLlama

    model = TinyLlama(LlamaConfig(dim=64, num_layers=3, num_heads=2, num_kv_heads=1, hidden_dim=96))
    tokens = torch.randint(0, 256, (4, 33))
    return model, lambda: model.loss((tokens[:, :-1], tokens[:, 1:]))


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 256, (4, 17))

    def loss_fn():
        logits = model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, 256).float(), tokens[:, 1:].reshape(-1))

    return model, loss_fn


def dump(result) -> str:
    """Every field of every layer's LayerDivergence (DivergenceResult.as_dict holds LD, WD and one more)."""
    out = {}
    for fqn, layer in result.layers.items():
        row = {}
        for f in dataclasses.fields(layer):
            value = getattr(layer, f.name)
            row[f.name] = ({k.value: dataclasses.astuple(v) if dataclasses.is_dataclass(v) else v for k, v in value.items()}
                           if isinstance(value, Mapping) else value)
        out[fqn] = row
    return json.dumps(out, sort_keys=True, default=repr)


def _rounds(make, formats, *, bf16=False, propagation=Propagation.PROBE, **kw):
    torch.manual_seed(0)
    model, loss = make()
    autocast = (lambda: torch.autocast("cpu", torch.bfloat16)) if bf16 else contextlib.nullcontext

    def loss_fn():
        with autocast():
            return loss()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    layers = convert_linears(model)
    out = {}
    for group_layers in (16, 2, 1):
        stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt, propagation=propagation)
        try:
            result = estimate_divergence(stats, formats, noise_draws=2, probes=3, group_layers=group_layers,
                                         generator=torch.Generator().manual_seed(5), **kw)
        finally:
            stats.release()
        out[group_layers] = dump(result)
    return out


@pytest.mark.parametrize("make", [_demo, _hf_llama], ids=["demo", "hf_llama"])
def test_a_round_with_groups_is_the_round_layer_by_layer_bit_for_bit(make):
    rounds = _rounds(make, ALL)
    assert rounds[16] == rounds[1] and rounds[2] == rounds[1]


def test_groups_keep_the_round_under_bf16_autocast_exact_propagation_and_tensorwise_fp8():
    rounds = _rounds(_hf_llama, [Format.FP8, Format.MXFP4], bf16=True, propagation=Propagation.EXACT,
                     recipe=QuantRecipe(fp8_scaling=Fp8Scaling.TENSORWISE))
    assert rounds[16] == rounds[1]


def test_group_layers_is_checked():
    model, loss_fn = _demo()
    stats = collect_stats(model, loss_fn, layers=convert_linears(model))
    try:
        with pytest.raises(ValueError, match="group_layers: invalid value 0; allowed: an integer >= 1"):
            estimate_divergence(stats, [Format.MXFP4], group_layers=0)
    finally:
        stats.release()


def test_the_default_groups_on_an_accelerator_only(monkeypatch):
    """group_layers=None: one layer at a time on a CPU (bound by arithmetic and caches), MAX_GROUP_LAYERS on
    an accelerator (bound by launches), read from the statistics' device."""
    import lightning_snip.round_inputs as div
    from lightning_snip.groups import MAX_GROUP_LAYERS, default_group_layers

    assert default_group_layers("cpu") == 1 and default_group_layers(torch.device("cuda", 1)) == MAX_GROUP_LAYERS
    assert default_group_layers("meta") == MAX_GROUP_LAYERS
    import lightning_snip.groups as groups

    devices, largest, real = [], [], div.layer_groups

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        largest.append(max((len(group) for group in out), default=0))
        return out

    monkeypatch.setattr(div, "layer_groups", spy)
    monkeypatch.setattr(groups, "default_group_layers", lambda device: devices.append(torch.device(device).type) or 3)
    model, loss_fn = _demo()
    stats = collect_stats(model, loss_fn, layers=convert_linears(model))
    try:
        estimate_divergence(stats, [Format.MXFP4], noise_draws=1, probes=1)
    finally:
        stats.release()
    assert set(devices) == {"cpu"} and max(largest) == 3
