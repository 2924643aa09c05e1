"""WD's forward-mode probes batched into one pass (probes.probe_passes): the same numbers as one pass
per probe, bit for bit, on the demo model and on a Hugging Face Llama; a model that cannot run them
batched falls back to one pass per probe with one warning."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_snip.probes as probes_module
import lightning_snip.stats as stats_module
from lightning_snip.statistics_round import measured_formats
from lightning_snip.convert import convert_linears
from lightning_snip.statistics_round import estimate_divergence
from lightning_snip.formats import Format
from lightning_snip.stats import collect_stats


def _demo():
    from lightning_snip.demo.model import LlamaConfig, TinyLlama

    model = TinyLlama(LlamaConfig(dim=32, num_layers=2, num_heads=2, num_kv_heads=1, hidden_dim=64))
    tokens = torch.randint(0, 256, (2, 17))
    return model, lambda: model.loss((tokens[:, :-1], tokens[:, 1:]))


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(config)
    model.train()  # attention dropout on: the probes replay the recording pass's draws
    tokens = torch.randint(0, 256, (2, 17))

    def loss_fn():
        logits = model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, 256).float(), tokens[:, 1:].reshape(-1))

    return model, loss_fn


def _trained(make, pins=None):
    torch.manual_seed(0)
    model, loss_fn = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    return model, loss_fn, opt, convert_linears(model, pins=pins)


def _round(model, loss_fn, opt, layers, *, batched: bool, forwards: list | None = None):
    if not batched:
        probes_module._unbatched_models.add(model)
    try:
        stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
        handle = model.register_forward_hook(lambda *_: forwards.append(1)) if forwards is not None else None
        try:
            result = estimate_divergence(stats, [Format.FP8, Format.MXFP4], noise_draws=0, probes=4,
                                         generator=torch.Generator().manual_seed(3))
        finally:
            if handle is not None:
                handle.remove()
            stats.release()
    finally:
        if not batched:
            probes_module._unbatched_models.discard(model)
    return result.layers


@pytest.mark.parametrize("make", [_demo, _hf_llama], ids=["demo", "hf_llama"])
def test_batched_probes_give_one_pass_per_probes_numbers_bit_for_bit(make, caplog):
    model, loss_fn, opt, layers = _trained(make)
    passes = {True: [], False: []}
    with caplog.at_level(logging.WARNING, logger="lightning_snip"):
        results = {batched: _round(model, loss_fn, opt, layers, batched=batched, forwards=passes[batched])
                   for batched in (True, False)}
    assert not [r for r in caplog.records if "could not run batched" in r.getMessage()]
    # every parameter got its tangent in the batched pass too (else: "... were not used ..." per round)
    assert not [r for r in caplog.records if "were not used" in r.getMessage()]
    # No curvature draws: the probes are the round's only forward passes after the recording one.
    assert (len(passes[True]), len(passes[False])) == (1, 4)
    one, each = results[True], results[False]
    assert set(one) == set(each) == set(layers)
    for fqn in layers:
        for fmt in (Format.FP8, Format.MXFP4):
            assert one[fqn].wd_propagated[fmt] == each[fqn].wd_propagated[fmt], (fqn, fmt)
            assert one[fqn].wd_propagated_stderr[fmt] == each[fqn].wd_propagated_stderr[fmt], (fqn, fmt)
            assert one[fqn].weight_divergence[fmt] == each[fqn].weight_divergence[fmt], (fqn, fmt)
    assert any(one[fqn].wd_propagated[Format.MXFP4] > 0 for fqn in layers)


class _NoVmapTanh(torch.autograd.Function):
    """A custom op with a forward-mode derivative but no vmap rule (as a user's fused kernel may be)."""

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_forward(output)
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)

    @staticmethod
    def jvp(ctx, tangent):
        (y,) = ctx.saved_tensors
        return tangent * (1 - y * y)


class _CustomOpModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 32)
        self.second = nn.Linear(32, 16)
        self.x, self.target = torch.randn(24, 32), torch.randn(24, 16)

    def forward(self, x):
        return self.second(_NoVmapTanh.apply(self.first(x)))


def test_a_model_the_probes_cannot_batch_runs_one_pass_per_probe_after_one_warning(caplog):
    def make():
        model = _CustomOpModel()
        return model, lambda: F.mse_loss(model(model.x), model.target)

    model, loss_fn, opt, layers = _trained(make)
    with caplog.at_level(logging.WARNING, logger="lightning_snip"):
        fallback = [_round(model, loss_fn, opt, layers, batched=True) for _ in range(2)]
        assert model in probes_module._unbatched_models  # remembered for the model's later rounds
        reference = _round(model, loss_fn, opt, layers, batched=False)
    warned = [r.getMessage() for r in caplog.records if "could not run batched" in r.getMessage()]
    assert len(warned) == 1 and "one pass per probe" in warned[0], warned
    for result in fallback:
        for fqn in layers:
            assert result[fqn].wd_propagated[Format.MXFP4] == reference[fqn].wd_propagated[Format.MXFP4]
        assert result["second"].wd_propagated[Format.MXFP4] > 0  # "first" has nothing upstream


def test_under_bf16_autocast_batched_probes_agree_to_bf16_rounding():
    """Under bf16 autocast the batched tangents' GEMMs round along other paths than one pass per probe's:
    the propagated term agrees to bf16 rounding (measured 0.9% on the demo), against a per-round relative
    standard error of ~sqrt(2 / 4) = 71% with 4 probes."""
    model, loss_fn, opt, layers = _trained(_demo)

    def autocast_loss():
        with torch.autocast("cpu", torch.bfloat16):
            return loss_fn()

    results = {batched: _round(model, autocast_loss, opt, layers, batched=batched) for batched in (True, False)}
    worst = max(abs(results[True][f].wd_propagated[m] - results[False][f].wd_propagated[m])
                / max(abs(results[False][f].wd_propagated[m]), 1e-30) for f in layers for m in (Format.FP8, Format.MXFP4))
    assert worst < 0.05
    assert all(results[True][f].loss_divergence == results[False][f].loss_divergence for f in layers)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one_pass_per_probe"])
def test_the_pass_runs_without_tangents_after_the_last_measured_layer(batched, caplog):
    """The LM head pinned to bf16 is measured by no format: the probe pass drops its tangents after the
    last block's down_proj, so the head's output (4 x the logits' tangents on SmolLM2) carries none, and
    every measured value is the same bit for bit as a pass that carries them to the loss."""
    import torch.autograd.forward_ad as fwAD

    model, loss_fn, opt, layers = _trained(_hf_llama, pins={"*lm_head": "bf16"})
    head_tangents: list[bool] = []
    probing = []

    def head_hook(module, args, output):
        if probing:
            head_tangents.append(fwAD.unpack_dual(output).tangent is not None)

    model.lm_head.register_forward_hook(head_hook)

    def round_(to_the_loss: bool):
        if not batched:
            probes_module._unbatched_models.add(model)
        stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
        probe = stats._probe

        def traced(tangents_of, measure, probes, wanted):
            probing.append(1)
            try:  # a layer never called: the pass carries tangents to the loss, as before 2026-12-03
                return probe(tangents_of, measure, probes, wanted | {"<never called>"} if to_the_loss else wanted)
            finally:
                probing.clear()

        stats._probe = traced
        try:
            return estimate_divergence(stats, [Format.MXFP4], noise_draws=0, probes=4, allowed=measured_formats(layers),
                                       generator=torch.Generator().manual_seed(3)).layers
        finally:
            stats.release()
            probes_module._unbatched_models.discard(model)

    with caplog.at_level(logging.WARNING, logger="lightning_snip"):
        full = round_(to_the_loss=True)
        assert head_tangents and all(head_tangents)  # the check sees tangents where there are some
        head_tangents.clear()
        cut = round_(to_the_loss=False)
    assert head_tangents and not any(head_tangents), head_tangents
    # the head's and the final norm's parameters count as reached: no "were not used" warning
    assert not [r for r in caplog.records if "were not used" in r.getMessage()]
    measured = [fqn for fqn in layers if fqn != "lm_head"]
    assert any(cut[fqn].wd_propagated[Format.MXFP4] > 0 for fqn in measured)
    for fqn in measured:
        assert cut[fqn].wd_propagated[Format.MXFP4] == full[fqn].wd_propagated[Format.MXFP4], fqn
        assert cut[fqn].wd_propagated_stderr[Format.MXFP4] == full[fqn].wd_propagated_stderr[Format.MXFP4], fqn


def test_input_tangents_names_a_layer_it_did_not_record():
    model, loss_fn, opt, layers = _trained(_demo)
    stats = collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    try:
        with pytest.raises(ValueError, match=r"layers: \['nope'\] were not recorded"):
            stats.input_tangents(lambda *a: None, lambda *a: None, 2, layers=["nope"])
        with pytest.raises(TypeError, match="layers: expected a collection of layer names, got the string 'lm_head'"):
            stats.input_tangents(lambda *a: None, lambda *a: None, 2, layers="lm_head")
    finally:
        stats.release()


class _SinkModel(nn.Module):
    """A module after the last measured layer that writes into a list argument its caller reads."""

    class Sink(nn.Module):
        def forward(self, x, sink):
            sink.append(x.pow(2).mean())
            return x

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 8)
        self.sink = self.Sink()
        self.x = torch.randn(12, 16)

    def forward(self, x):
        sink: list = []
        y = self.sink(self.second(torch.tanh(self.first(x))), sink)
        return y, torch.stack(sink).sum()


def test_a_module_after_the_last_measured_layer_gets_its_list_argument_itself(caplog):
    def make():
        model = _SinkModel()
        def loss_fn():
            y, sunk = model(model.x)
            return y.pow(2).mean() + sunk

        return model, loss_fn

    model, loss_fn, opt, layers = _trained(make)
    with caplog.at_level(logging.WARNING, logger="lightning_snip"):
        result = _round(model, loss_fn, opt, layers, batched=True)
    assert not [r for r in caplog.records if "could not run batched" in r.getMessage()]
    assert model not in probes_module._unbatched_models
    assert result["second"].wd_propagated[Format.MXFP4] > 0


def test_activation_checkpointing_measures_every_layer_as_without_it():
    """Under activation checkpointing the backward re-runs each block's forward: the recording pass
    counted those calls, so the probe pass waited for a second call that never came and WD's propagated
    term read 0 for the layers of every checkpointed block (a Hugging Face Llama: 24 of 28 values)."""
    model, loss_fn, opt, layers = _trained(_hf_llama)
    plain = _round(model, loss_fn, opt, layers, batched=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        checkpointed = _round(model, loss_fn, opt, layers, batched=True)
    finally:
        model.gradient_checkpointing_disable()
    for fqn in layers:
        for fmt in (Format.FP8, Format.MXFP4):
            assert checkpointed[fqn].wd_propagated[fmt] == plain[fqn].wd_propagated[fmt], (fqn, fmt)
            assert checkpointed[fqn].weight_divergence[fmt] == plain[fqn].weight_divergence[fmt], (fqn, fmt)
    assert all(checkpointed[fqn].wd_propagated[Format.MXFP4] > 0 for fqn in layers)


def test_reentrant_activation_checkpointing_fails_the_round_naming_the_cause():
    """Reentrant checkpointing runs the blocks' forward without autograd: the recording pass has no
    output gradients to take; the round fails (the callback keeps its plan) with the way out named."""
    model, loss_fn, opt, layers = _trained(_hf_llama)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    try:
        with pytest.raises(RuntimeError, match=r"carry no gradient in the recording pass.*use_reentrant=False"):
            collect_stats(model, loss_fn, layers=layers, optimizer=opt)
    finally:
        model.gradient_checkpointing_disable()
