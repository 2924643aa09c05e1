"""SNIPCallback on a real Trainer in the setups LLM users train with: mixed precision, gradient
accumulation, torch.compile, and modules written without lightning_snip in mind (no ``snip_loss``,
dropout, ``self.log``, manual optimization, tied weights, layers built in ``configure_model``)."""

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

import lightning_snip.controller as ctl
import lightning_snip.first_order as first_order
import lightning_snip.evidence as evidence_mod
import lightning_snip.statistics_round as statistics_round
from lightning_snip.controller import SNIPController
from lightning_snip.callback import SNIPCallback
from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM
from lightning_snip.formats import Format
from lightning_snip.gemm import quantized_matmul
from lightning_snip.linear import SNIPLinear
from lightning_snip.convert import high_precision
from lightning_snip.stats import collect_stats
from test_callback import SMALL, _fit, _snip


class _TinyMLP(nn.Module):
    """A model lightning_snip did not write: residual MLP with dropout, optionally a tied head."""

    def __init__(self, tied: bool = False, p: float = 0.25) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 64)
        self.up = nn.Linear(64, 128)
        self.drop = nn.Dropout(p)
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 256, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(self.drop(F.gelu(self.up(h))))
        return self.head(h)


class _UserLM(pl.LightningModule):
    """No snip_loss: the statistics round runs training_step. Counts its log calls and records the
    dropout masks of its real training steps (``recording`` is set by _TrainingStepFlag)."""

    def __init__(self, *, manual: bool = False, tied: bool = False, in_configure_model: bool = False):
        super().__init__()
        self.automatic_optimization = not manual
        self.tied = tied
        self.net = None if in_configure_model else _TinyMLP(tied)
        self.num_logs = 0
        self.recording = False
        self.masks: list[torch.Tensor] = []

    def configure_model(self):
        if self.net is None:
            self.net = _TinyMLP(self.tied)
        self.net.drop.register_forward_hook(self._record_mask)

    def _record_mask(self, module, args, output):
        if self.recording:
            self.masks.append(output == 0)

    def log(self, *args, **kwargs):
        self.num_logs += 1
        super().log(*args, **kwargs)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.net(inputs)
        loss = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
        self.log("train/loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class _TrainingStepFlag(pl.Callback):
    """Marks the real training step (after SNIPCallback's batch-start hook, where a round runs)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.recording = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.recording = False


def _user_snip(**kw):
    return _snip(pins={}, **kw)  # the user model's head is "head", not "lm_head"


def _finite_round(snip):
    """The last round produced finite, non-trivial divergences for every unpinned layer's FP4 format (a
    pinned one is measured in its pin only: the LM head, in bf16 by default, in none)."""
    layers = snip.history[-1]["divergence"]["layers"]
    unpinned = [d for fqn, d in layers.items() if snip.layers[fqn].pinned is None]
    pinned = [d for fqn, d in layers.items() if snip.layers[fqn].pinned is Format.BF16]
    wd = [d["weight_divergence"]["mxfp4"] for d in unpinned]
    ld = [d["loss_divergence"]["mxfp4"] for d in unpinned]
    return (bool(unpinned) and all(math.isfinite(v) and v > 0 for v in wd) and all(math.isfinite(v) for v in ld)
            and any(v != 0 for v in ld) and all(d["weight_divergence"]["mxfp4"] == math.inf for d in pinned))


# ---------------------------------------------------------------- mixed precision


def test_bf16_mixed_trains_and_the_round_runs_under_autocast(tmp_path, monkeypatch):
    seen = []
    real = statistics_round.collect_stats

    def spy(*args, **kwargs):
        stats = real(*args, **kwargs)
        seen.append(stats.layers["model.layers.0.attn.o"].x.dtype)  # attention output: bf16 under autocast
        return stats

    monkeypatch.setattr(statistics_round, "collect_stats", spy)
    snip = SNIPCallback(_snip(initial_format="mxfp4"))
    trainer, _ = _fit(tmp_path, snip, precision="bf16-mixed")
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert snip.num_plans_applied == 2 and _finite_round(snip)
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))


def test_16_mixed_trains_with_a_loss_scale_and_plans(tmp_path):
    # Lightning maps precision="16-mixed" to bf16 on CPU; the plugin gives real fp16 autocast + GradScaler.
    plugin = MixedPrecision("16-mixed", "cpu")
    snip = SNIPCallback(_snip(initial_format="mxfp4"))
    _fit(tmp_path, snip, plugins=[plugin])
    assert plugin.scaler.get_scale() > 1
    assert snip.num_plans_applied == 2 and _finite_round(snip)


def test_snip_linear_follows_autocast_like_torch_linear():
    layer = SNIPLinear(64, 32, format="mxfp4")
    x = torch.randn(8, 64, requires_grad=True)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            y, ref = layer(x), F.linear(x, layer.weight, layer.bias)
        assert y.dtype == ref.dtype == dtype
        y.float().sum().backward()
        assert x.grad.dtype == layer.weight.grad.dtype == torch.float32  # grads reach fp32 master tensors
        assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 0.3  # FP4 error, not garbage
        x.grad = layer.weight.grad = layer.bias.grad = None


def test_fp16_statistics_keep_small_gradients_with_a_loss_scale():
    torch.manual_seed(0)
    module = DemoLM(SMALL)
    from lightning_snip.convert import convert_linears

    layers = convert_linears(module)
    tokens = torch.randint(0, 256, (8, 33))
    batch = (tokens[:, :-1], tokens[:, 1:])

    def loss_fn(dtype):
        def fn():
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                # x 1/256: per-token gradients as small as those of a 64k-token batch's mean loss
                return module.snip_loss(batch) / 256
        return fn

    ref = collect_stats(module, loss_fn(None), layers=layers)
    scaled = collect_stats(module, loss_fn(torch.float16), layers=layers, loss_scale=2.0**16)
    unscaled = collect_stats(module, loss_fn(torch.float16), layers=layers)
    fqn = "model.layers.0.mlp.up"  # deepest from the loss: the smallest gradients
    ref_g = ref.layers[fqn].g

    def rel(stats):
        return float((stats.layers[fqn].g - ref_g).norm() / ref_g.norm())

    assert scaled.layers[fqn].g.dtype == torch.float32
    assert rel(scaled) < 0.02
    assert rel(unscaled) > 2 * rel(scaled)  # without the scale fp16 loses them (subnormal / zero)
    for stats in (ref, scaled, unscaled):
        stats.release()


# ---------------------------------------------------------------- accumulation, compile


def test_accumulate_4_runs_one_round_and_one_solve_per_optimizer_step(tmp_path, monkeypatch):
    solves = []
    real = SNIPController.start_solve

    def spy(self, stats_step, apply_step, *args):
        solves.append(stats_step)
        return real(self, stats_step, apply_step, *args)

    monkeypatch.setattr(SNIPController, "start_solve", spy)
    snip = SNIPCallback(_snip())
    trainer, _ = _fit(tmp_path, snip, max_steps=8, accumulate_grad_batches=4)
    assert trainer.global_step == 8
    assert snip.num_stats_rounds == 2 and solves == [2, 6] and snip.num_plans_applied == 2


def _counting_aot_eager(calls: list):
    """dynamo's aot_eager backend, counting the calls of the graphs it compiled into ``calls[0]``."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        compiled = aot_eager(gm, example_inputs)

        def run(*args):
            calls[0] += 1
            return compiled(*args)

        return run

    return backend


class _CompiledLM(DemoLM):
    """The pattern torchtitan and Lightning's docs use: compile the model in configure_model (DemoLM's own steps call
    the compiled module). ``graph_calls[0]``
    counts the calls of its compiled graphs (a step that ran eagerly made none)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.graph_calls = [0]

    def configure_model(self):
        self.model = torch.compile(self.model, backend=_counting_aot_eager(self.graph_calls))


class _CompileCounter(pl.Callback):
    """Frames dynamo compiled during each step, with the format assignment the step ran; and the steps whose
    training forward ran eagerly (no compiled graph called after SNIP's hooks: its statistics round, in
    on_train_batch_start, runs eagerly on purpose). Put it after the SNIPCallback."""

    def __init__(self, snip):
        self.snip, self.rows, self.eager_steps = snip, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from torch._dynamo.utils import counters

        self.step = trainer.global_step
        self.before = counters["frames"]["total"]
        self.calls_before = pl_module.graph_calls[0]
        self.formats = tuple((layer.format, layer.backward_format) for layer in self.snip.layers.values())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from torch._dynamo.utils import counters

        self.rows.append((self.formats, counters["frames"]["total"] - self.before))
        if pl_module.graph_calls[0] == self.calls_before:
            self.eager_steps.append(self.step)


@pytest.mark.compiled_quantizers
def test_compiled_model_trains_gets_plans_and_recompiles_only_for_new_plans(tmp_path, monkeypatch):
    # (the error probe's curvature passes run the compiled model too)
    torch._dynamo.reset()
    snip = SNIPCallback(_snip(first_order_steps=2))
    counter = _CompileCounter(snip)
    sampled = {}  # step -> layers whose first-order term was sampled in it
    real_add = first_order.FirstOrderTerms.add

    def add(self, fqn, *args):
        sampled.setdefault(counter.step, set()).add(fqn)
        return real_add(self, fqn, *args)

    monkeypatch.setattr(first_order.FirstOrderTerms, "add", add)
    # Hitting the limit would silently fall back to eager (and make "no recompiles" trivially true).
    # (dynamo's own patch: monkeypatch's undo deletes the config entry, which breaks the next test)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        _fit(tmp_path, snip, max_steps=12, module=_CompiledLM(SMALL), callbacks=[counter])
    assert snip.num_stats_rounds == 3 and snip.num_plans_applied == 3
    assert "model.layers.0.attn.q" in snip.layers  # names without torch.compile's "_orig_mod"
    assert _finite_round(snip)
    # The SNIPLinear layers are traced into the model's graph (no graph break): one frame per compile.
    # A step compiles only under a format assignment no compiled step ran before (a new plan: once,
    # for all its changed layers); sampling the first-order term compiles nothing (its taps are in the graph).
    compiled = [formats for formats, frames in counter.rows if frames]
    assert all(frames <= 1 for _, frames in counter.rows), counter.rows
    assert len(compiled) == len(set(compiled)) >= 2, counter.rows  # never twice for one assignment
    assert compiled[0] == counter.rows[0][0]  # the first compiled step ran the initial plan
    # Every assignment a compiled step ran was compiled at its first such step, and only then.
    seen = set()
    for formats, frames in counter.rows:
        if frames:
            assert formats not in seen
            seen.add(formats)
    # No training step ran eagerly: the first-order steps sampled every switchable layer inside the compiled graph.
    assert counter.eager_steps == []
    switchable = {fqn for fqn, layer in snip.layers.items() if layer.pinned is None}
    assert sampled == {step: switchable for step in (0, 1, 4, 5, 8, 9)}, sorted(sampled)  # (rounds at 2, 6, 10)
    assert snip.history[-1]["divergence"]["layers"]


# ---------------------------------------------------------------- modules users write


def _masks_of(tmp_path, replan: bool):
    module = _UserLM()
    snip = SNIPCallback(_user_snip(replan=replan, initial_format="mxfp4"))
    _fit(tmp_path, snip, max_steps=8, module=module, callbacks=[_TrainingStepFlag()])
    return module, snip


def test_round_without_snip_loss_has_no_side_effects(tmp_path):
    module, snip = _masks_of(tmp_path / "snip", replan=True)
    assert snip.num_stats_rounds == 2 and snip.num_plans_applied == 2 and _finite_round(snip)
    assert module.num_logs == 8  # one per training step: the rounds' training_step logged nothing
    # Dropout masks of the training steps are those of a run without statistics rounds: the rounds
    # leave the global RNG stream where it was (and stochastic rounding draws from its own).
    reference, _ = _masks_of(tmp_path / "frozen", replan=False)
    assert len(module.masks) == len(reference.masks) == 8
    for a, b in zip(module.masks, reference.masks):
        assert torch.equal(a, b)


def test_statistics_re_runs_see_the_same_dropout_masks_and_leave_the_rng_alone():
    torch.manual_seed(0)
    net = _TinyMLP(p=0.5)
    from lightning_snip.convert import convert_linears

    layers = convert_linears(net)
    tokens = torch.randint(0, 256, (4, 17))
    masks = []
    net.drop.register_forward_hook(lambda m, a, out: masks.append(out == 0))

    def loss_fn():
        logits = net(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))

    state = torch.get_rng_state()
    stats = collect_stats(net, loss_fn, layers=layers)
    stats.output_grads_with_noise({"up": torch.zeros(64, 128)})
    stats.output_grads_with_noise({"up": torch.ones(64, 128)})
    stats.release()
    assert len(masks) == 3 and masks[0].any()
    assert all(torch.equal(masks[0], m) for m in masks[1:])
    assert torch.equal(torch.get_rng_state(), state)


def test_manual_optimization_module_steps_once_per_training_step(tmp_path):
    module = _UserLM(manual=True)
    snip = SNIPCallback(_user_snip())
    trainer, _ = _fit(tmp_path, snip, max_steps=8, module=module)
    assert trainer.global_step == 8
    optimizer = trainer.optimizers[0]
    steps = {int(s["step"]) for s in optimizer.state.values()}
    assert steps == {8}  # the rounds' training_step stepped nothing
    assert module.num_logs == 8
    assert snip.num_stats_rounds == 2 and snip.num_plans_applied == 2 and _finite_round(snip)


def test_layers_built_in_configure_model_are_converted(tmp_path):
    module = _UserLM(in_configure_model=True)
    snip = SNIPCallback(_user_snip())
    _fit(tmp_path, snip, max_steps=4, module=module)
    assert set(snip.layers) == {"net.up", "net.down", "net.head"}
    assert all(isinstance(getattr(module.net, n), SNIPLinear) for n in ("up", "down", "head"))
    assert snip.num_plans_applied == 1


def test_tied_head_weight_divergence_uses_the_shared_weights_adam_state(tmp_path):
    """WD's direct term of a head tied to the embedding, against a computation from the optimizer's
    raw state: the update of the next AdamW step of the *shared* parameter (lookup by identity)."""
    module = _UserLM(tied=True)
    snip = SNIPCallback(_user_snip(candidate_formats=("fp8", "mxfp4")))
    trainer, _ = _fit(tmp_path, snip, max_steps=4, module=module)
    assert snip.num_plans_applied == 1 and module.net.head.weight is module.net.embed.weight
    module.net.drop.p = 0.0
    optimizer = trainer.optimizers[0]
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(3))

    def loss_fn():
        logits = module.net(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))

    from lightning_snip.statistics_round import estimate_divergence

    stats = collect_stats(module, loss_fn, layers=snip.layers, optimizer=optimizer)
    assert stats.layers["net.head"].weight_name == "net.embed.weight"
    result = estimate_divergence(stats, [Format.FP8], noise_draws=0, recipe=snip.config.recipe)
    stats.release()

    # Independent computation: gradients by autograd, AdamW's next step from optimizer.state.
    params = dict(module.named_parameters())
    with high_precision(snip.layers):  # as the statistics pass (AdamW's 1/eps makes this matter)
        grads = dict(zip(params, torch.autograd.grad(loss_fn(), list(params.values()))))
    group = optimizer.param_groups[0]
    lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]

    def next_update(name, error=0.0):  # AdamW's next update (no weight decay) with gradient g + error
        state = optimizer.state[params[name]]
        t, g = int(state["step"]) + 1, grads[name].double() + error
        m = b1 * state["exp_avg"].double() + (1 - b1) * g
        v = b2 * state["exp_avg_sq"].double() + (1 - b2) * g**2
        return lr * m / (1 - b1**t) / ((v / (1 - b2**t)).sqrt() + eps)

    denominator = sum(float(next_update(n).pow(2).sum()) for n in params)
    net = module.net  # the head's input in high precision (the statistics pass runs every layer so)
    with torch.no_grad():
        e = net.embed(tokens[:, :-1])
        h = (e + F.linear(F.gelu(F.linear(e, net.up.weight, net.up.bias)), net.down.weight, net.down.bias)).reshape(-1, 64)
    logits = (h @ net.head.weight.t()).detach().requires_grad_()
    g = torch.autograd.grad(F.cross_entropy(logits, tokens[:, 1:].reshape(-1)), logits)[0]
    e_w = quantized_matmul(g.t(), h.t(), Format.FP8, recipe=snip.config.recipe, a_is_grad=True) - g.t() @ h
    deviation = next_update("net.embed.weight", e_w.double()) - next_update("net.embed.weight")
    expected = float(deviation.pow(2).sum()) / denominator
    assert result.layers["net.head"].wd_direct[Format.FP8] == pytest.approx(expected, rel=1e-3)


# ---------------------------------------------------------------- strategies, RNG, failures


def test_deepspeed_is_rejected_at_setup_by_name():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    class _Trainer:
        strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # no deepspeed install needed

    with pytest.raises(ValueError, match="trainer.strategy: DeepSpeedStrategy is not supported"):
        SNIPCallback(_snip()).setup(_Trainer(), DemoLM(SMALL), "fit")


def test_stochastic_rounding_streams_are_per_rank_and_reproducible(tmp_path):
    seeds = {ctl.stream_seed(0, rank, step, 0) for rank in range(4) for step in range(100)}
    assert len(seeds) == 400  # distinct per rank and step

    def final_weights(path):
        snip = SNIPCallback(_snip(initial_format="mxfp4", replan=False))
        _, module = _fit(path, snip, max_steps=3)
        layer = snip.layers["model.layers.0.mlp.up"]
        assert layer.generator is snip.controller.sr_generator
        return torch.cat([p.detach().flatten() for p in module.parameters()])

    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert torch.equal(a, b)  # same seed, same SR draws: bit-identical runs
    # The draws are the callback's: a different rank's stream changes the result.
    original = ctl.stream_seed
    try:
        ctl.stream_seed = lambda seed, rank, step, batch_idx: original(seed, rank + 1, step, batch_idx)
        c = final_weights(tmp_path / "c")
    finally:
        ctl.stream_seed = original
    assert not torch.equal(a, c)


def test_repeated_statistics_failures_raise_with_the_cause(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected statistics failure")

    monkeypatch.setattr(statistics_round, "collect_stats", broken)
    snip = SNIPCallback(_snip(interval=2, max_consecutive_failures=3))  # rounds at 2, 4, 6
    with pytest.raises(RuntimeError, match=r"3 statistics rounds or solves in a row.*injected statistics failure"):
        _fit(tmp_path, snip, max_steps=10)
    assert snip.num_stats_rounds == 3


def test_failures_are_tolerated_when_the_user_asks(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(evidence_mod, "solve_plan", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected solver failure")))
    snip = SNIPCallback(_snip(interval=2, max_consecutive_failures=None))
    _fit(tmp_path, snip, max_steps=10)
    assert snip.num_consecutive_failures == 4 and snip.num_plans_applied == 0
    assert "injected solver failure" in caplog.text


def test_a_success_resets_the_failure_count(tmp_path, monkeypatch):
    real = statistics_round.collect_stats
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) % 2:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(statistics_round, "collect_stats", flaky)
    snip = SNIPCallback(_snip(interval=2, max_consecutive_failures=2))
    _fit(tmp_path, snip, max_steps=10)  # fail, succeed, fail, succeed: never two in a row
    assert snip.num_plans_applied == 2


# ---------------------------------------------------------------- a model from another library


class _HFLlamaLM(pl.LightningModule):
    """Hugging Face transformers' LlamaForCausalLM as users wrap it: tied embeddings, attention
    dropout, no snip_loss."""

    def __init__(self, checkpointing: bool = False):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True, attention_dropout=0.1)
        self.llama = LlamaForCausalLM(config)
        if checkpointing:  # activation checkpointing recomputes blocks inside the round's backward passes
            self.llama.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.llama(input_ids=inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_hugging_face_llama_trains_and_plans_under_bf16_mixed(tmp_path, checkpointing):
    pytest.importorskip("transformers")
    module = _HFLlamaLM(checkpointing)
    snip = SNIPCallback(_snip(pins={"*lm_head": "bf16"}, initial_format="mxfp4"))
    trainer, _ = _fit(tmp_path, snip, module=module, precision="bf16-mixed")
    assert len(snip.layers) == 15 and "llama.model.layers.1.mlp.down_proj" in snip.layers
    assert snip.num_plans_applied == 2 and _finite_round(snip)
    assert module.llama.lm_head.weight is module.llama.model.embed_tokens.weight
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))
    assert snip.plan.fp4_fraction >= 0.6


def test_fp16_round_lowers_an_overflowing_loss_scale_instead_of_losing_the_round(tmp_path, monkeypatch):
    import lightning_snip.stats as stats_module

    scales = []
    real = stats_module.collect_stats

    def overflowing(*args, loss_scale=1.0, **kwargs):
        scales.append(loss_scale)
        stats = real(*args, loss_scale=loss_scale, **kwargs)
        if loss_scale > 2.0**10:  # as if the scaled loss overflowed fp16: infinite output gradients
            for s in stats.layers.values():
                s.g = torch.full_like(s.g, float("inf"))
        return stats

    monkeypatch.setattr(statistics_round, "collect_stats", overflowing)
    snip = SNIPCallback(_snip(initial_format="mxfp4"))
    _fit(tmp_path, snip, max_steps=4, plugins=[MixedPrecision("16-mixed", "cpu")])
    assert scales[0] > 2.0**10 and scales[1] == scales[0] / 256, scales  # retried at a lower scale
    assert snip.num_plans_applied == 1 and _finite_round(snip)


class _BatchNormLM(DemoLM):
    """A forward that updates a buffer (BatchNorm's running statistics)."""

    def __init__(self):
        super().__init__(SMALL)
        self.norm = nn.BatchNorm1d(SMALL.vocab_size)

    def snip_loss(self, batch):
        inputs, targets = batch
        logits = self.norm(self.model(inputs).transpose(1, 2)).transpose(1, 2)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch, batch_idx):
        return self.snip_loss(batch)


def test_round_leaves_buffers_as_it_found_them(tmp_path, monkeypatch):
    seen = []
    real = SNIPController.statistics_round

    def spy(self, pl_module, *args, **kwargs):
        before = pl_module.norm.running_mean.clone(), int(pl_module.norm.num_batches_tracked)
        real(self, pl_module, *args, **kwargs)
        seen.append(torch.equal(before[0], pl_module.norm.running_mean)
                    and before[1] == int(pl_module.norm.num_batches_tracked))

    monkeypatch.setattr(SNIPController, "statistics_round", spy)
    snip = SNIPCallback(_snip())
    _fit(tmp_path, snip, max_steps=4, module=_BatchNormLM())
    assert seen == [True] and snip.num_plans_applied == 1


def test_noise_guard_on_a_hugging_face_llama_under_bf16_mixed_and_accumulation(tmp_path):
    """The gradient-noise guard where users train: a module we did not write, bf16-mixed, 2 micro-
    batches per step, per-GEMM plans. Every ratio is finite; a threshold above all of them keeps
    every unpinned backward out of FP4 while forwards still take it."""
    pytest.importorskip("transformers")
    from lightning_snip.plan import BACKWARD, FORWARD, gemm_key

    snip = SNIPCallback(_snip(pins={"*lm_head": "bf16"}, granularity="gemm", fp4_fraction=0.3,
                              noise_guard_threshold=1e12))
    _fit(tmp_path, snip, module=_HFLlamaLM(), precision="bf16-mixed", accumulate_grad_batches=2)
    unpinned = {fqn for fqn, layer in snip.layers.items() if layer.pinned is None}
    assert set(snip.grad_noise_ratios) == unpinned
    assert all(0 < r < math.inf for r in snip.grad_noise_ratios.values())
    plan = snip.plan
    assert snip.num_plans_applied == 2 and set(plan.noise_guarded) == unpinned
    assert not any(plan[gemm_key(f, BACKWARD)].is_fp4 for f in unpinned)
    assert any(plan[gemm_key(f, FORWARD)].is_fp4 for f in unpinned)
