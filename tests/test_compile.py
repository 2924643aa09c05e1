"""SNIPLinear under torch.compile: traced into the model's graph in every format, bit-equal to eager,
recompiled once per new format assignment (the format is a guard), stochastic rounding included."""

import copy
import functools

import pytest
import torch
from torch import nn

from lightning_snip import gemm, rng
from lightning_snip.formats import Format
from lightning_snip.linear import SNIPLinear

QUANTIZED = [Format.FP8, Format.MXFP8, Format.MXFP4, Format.NVFP4]


class _Block(nn.Module):
    """Two SNIPLinears around an activation: an MLP as a transformer block has it."""

    def __init__(self):
        super().__init__()
        self.up = SNIPLinear(64, 128)
        self.down = SNIPLinear(128, 64, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _block(fmt, backward_fmt=None, generator=None):
    torch.manual_seed(0)
    block = _Block()
    for layer in (block.up, block.down):
        layer.format = fmt
        layer.backward_format = backward_fmt
        layer.generator = generator
    return block


def _loss(block, x):
    return block(x).square().sum()


@pytest.mark.parametrize("fmt", [Format.BF16, *QUANTIZED])
def test_layer_traces_without_graph_breaks(fmt):
    generator = torch.Generator().manual_seed(0)  # stochastic rounding of FP4 gradients draws from it
    block = _block(fmt, generator=generator)
    x = torch.randn(2, 32, 64, requires_grad=True)
    torch._dynamo.reset()
    # explain traces the forward and, inside the autograd.Function, its backward (where SR draws).
    explanation = torch._dynamo.explain(functools.partial(_loss, block))(x)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


@pytest.mark.parametrize("kernel, fmt", [(gemm.Kernel.TORCHAO_FP8, Format.FP8), (gemm.Kernel.TORCHAO_BLOCK, Format.MXFP8),
                                         (gemm.Kernel.TORCHAO_BLOCK, Format.MXFP4), (gemm.Kernel.TORCHAO_BLOCK, Format.NVFP4)])
def test_torchao_training_paths_trace_without_graph_breaks(monkeypatch, kernel, fmt):
    # The GPU paths (torchao's float8 and MX / NVFP4 training tensors), forced on this CPU; the block
    # formats take torchao's emulated GEMM, as no CPU has block-scaled ones.
    monkeypatch.setattr(gemm, "kernel_for", lambda f, device: kernel)
    monkeypatch.setattr(gemm, "torchao_block_mm", functools.partial(gemm.torchao_block_mm, emulate=True))
    block = _block(fmt, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(functools.partial(_loss, block))(torch.randn(2, 32, 64, requires_grad=True))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


def _run(block, x, generator, seed, compiled):
    block = copy.deepcopy(block)  # the copy draws from the same generator (its RNG token names it)
    generator.manual_seed(seed)
    fn = torch.compile(block) if compiled else block
    x = x.clone().requires_grad_()
    y = fn(x)
    y.square().sum().backward()
    return y.detach(), x.grad, block.up.weight.grad, block.down.weight.grad, block.up.bias.grad, generator.get_state()


@pytest.mark.compiled_quantizers
@pytest.mark.parametrize("fmt, backward_fmt", [(Format.FP8, None), (Format.MXFP4, None), (Format.NVFP4, None),
                                               (Format.MXFP8, Format.MXFP4), (Format.BF16, Format.NVFP4)])
def test_compiled_layer_is_bit_equal_to_eager(fmt, backward_fmt):
    generator = torch.Generator().manual_seed(0)
    block = _block(fmt, backward_fmt, generator)
    x = torch.randn(2, 48, 64)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        eager = _run(block, x, generator, 5, compiled=False)
        compiled = _run(block, x, generator, 5, compiled=True)
        other_seed = _run(block, x, generator, 6, compiled=True)
    names = ("output", "dX", "dW up", "dW down")
    for name, e, c in zip(names, eager, compiled):
        assert torch.equal(e, c), name
    # The bias gradient is a sum over tokens whose order inductor chooses (as for nn.Linear's own).
    torch.testing.assert_close(compiled[4], eager[4], rtol=1e-6, atol=1e-5)
    assert torch.equal(eager[5], compiled[5])  # the same number of draws from the generator
    stochastic = (backward_fmt or fmt).is_fp4
    # Another seed rounds the FP4 gradients differently (the compiled graph draws at run time).
    assert torch.equal(compiled[2], other_seed[2]) is not stochastic
    assert torch.equal(compiled[0], other_seed[0])  # forward: round to nearest


@pytest.mark.compiled_quantizers
def test_compiled_torchao_fp8_path_is_bit_equal_to_eager(monkeypatch):
    # torchao.float8's training tensors and torch._scaled_mm, as on an FP8 GPU (this CPU has the op).
    monkeypatch.setattr(gemm, "kernel_for", lambda f, device: gemm.Kernel.TORCHAO_FP8)
    generator = torch.Generator().manual_seed(0)
    block = _block(Format.FP8, generator=generator)
    x = torch.randn(2, 48, 64)
    torch._dynamo.reset()
    eager = _run(block, x, generator, 5, compiled=False)
    compiled = _run(block, x, generator, 5, compiled=True)
    for name, e, c in zip(("output", "dX", "dW up", "dW down"), eager, compiled):
        assert torch.equal(e, c), name


@pytest.mark.compiled_quantizers
@pytest.mark.parametrize("fmt", [Format.MXFP8, Format.MXFP4, Format.NVFP4])
def test_compiled_block_formats_follow_changing_token_counts(fmt):
    # Token counts that are no multiple of the block: wgrad pads its token axis. Traced, that padding
    # was symbolic and inductor's backward failed its stride checks at the third count (review).
    generator = torch.Generator().manual_seed(0)
    block = _block(fmt, generator=generator)
    compiled = torch.compile(block)
    torch._dynamo.reset()
    for tokens in (32, 48, 40, 17, 29):
        x = torch.randn(2, tokens, 64)
        results = []
        for fn in (block, compiled):
            block.zero_grad()
            generator.manual_seed(tokens)
            xx = x.clone().requires_grad_()
            fn(xx).square().sum().backward()
            results.append((xx.grad, block.up.weight.grad, block.down.weight.grad))
        for name, e, c in zip(("dX", "dW up", "dW down"), *results):
            assert torch.equal(e, c), (tokens, name)


class _Twins(nn.Module):
    """Two blocks, the second a deep copy of the first: both name one generator."""

    def __init__(self, block):
        super().__init__()
        self.a, self.b = block, copy.deepcopy(block)

    def forward(self, x):
        return self.a(x) + self.b(x).relu()


@pytest.mark.compiled_quantizers
def test_deep_copied_layers_draw_in_eager_order_when_compiled():
    # A deep copy shares its original's generator and token (SNIPLinear.__setstate__): with a token
    # copy each, inductor was free to reorder the two blocks' draws (review: dX and dW differed).
    generator = torch.Generator().manual_seed(0)
    twins = _Twins(_block(Format.MXFP4, generator=generator))
    assert twins.b.up._rng_token is twins.a.up._rng_token and twins.b.up.generator is generator
    x = torch.randn(2, 32, 64)
    results = []
    for fn in (twins, torch.compile(twins)):
        twins.zero_grad()
        generator.manual_seed(3)
        xx = x.clone().requires_grad_()
        fn(xx).square().sum().backward()
        results.append([xx.grad] + [p.grad for n, p in twins.named_parameters() if n.endswith("weight")])
    assert all(torch.equal(e, c) for e, c in zip(*results))


def test_a_recipe_change_recompiles():
    from lightning_snip.formats import Fp8Scaling, QuantRecipe

    block = _block(Format.FP8)
    compiled = torch.compile(block, backend="aot_eager")
    x = torch.randn(2, 32, 64)
    rowwise, tensorwise = QuantRecipe(), QuantRecipe(fp8_scaling=Fp8Scaling.TENSORWISE)
    with torch.no_grad():
        for up, down in [(rowwise, rowwise), (tensorwise, rowwise), (rowwise, rowwise), (tensorwise, rowwise),
                         (tensorwise, tensorwise)]:
            block.up.recipe, block.down.recipe = up, down
            assert torch.equal(compiled(x), block(x))
    with pytest.raises(TypeError, match="recipe: expected a QuantRecipe, got str"):
        block.up.recipe = "rowwise"


def test_a_new_format_assignment_recompiles_once_and_a_seen_one_never():
    from torch._dynamo.utils import counters

    block = _block(Format.FP8, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(block, backend="aot_eager")
    x = torch.randn(2, 32, 64, requires_grad=True)
    plans = [(Format.FP8, Format.FP8), (Format.MXFP4, Format.FP8), (Format.FP8, Format.FP8), (Format.MXFP4, Format.FP8),
             (Format.MXFP4, Format.NVFP4), (Format.FP8, Format.FP8)]
    torch._dynamo.reset()
    frames = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for up, down in plans:
            block.up.format, block.down.format = up, down
            before = counters["frames"]["total"]
            for _ in range(2):
                _loss(compiled, x).backward()
            frames.append(counters["frames"]["total"] - before)
            # The graph run is this assignment's (a stale one would round in other formats).
            with torch.no_grad():
                assert torch.equal(compiled(x), block(x)), (up, down)
    # Each new assignment compiles once, for all its changed layers; a seen one reuses its graph.
    # (Guards on the Format members themselves missed the second layer's change at the 5th.)
    assert frames == [1, 1, 0, 0, 1, 0]


def test_rng_tokens_name_their_generator():
    g, h = torch.Generator(), torch.Generator()
    assert rng.token_for(g) is rng.token_for(g)  # layers sharing a generator share its token
    assert rng.generator_of(rng.token_for(h)) is h
    assert rng.generator_of(rng.token_for(None)) is None
    layer = SNIPLinear(32, 32)
    layer.generator = g
    assert layer.generator is g and copy.deepcopy(layer).generator is g
    # The operator draws what an eager random_ draws from the same state, and counts its draws.
    token = rng.token_for(g)
    g.manual_seed(3)
    count = int(token[1])
    drawn = rng.random_bits_op(token, 9, torch.device("cpu"))
    state = g.get_state()
    g.manual_seed(3)
    assert torch.equal(drawn, torch.empty(5, dtype=torch.int64).random_(generator=g))
    assert torch.equal(state, g.get_state())  # exactly those words drawn
    assert int(token[1]) == count + 1
    assert token.device.type == "cpu" and rng.token_for(None).device.type == "cpu"
    with torch.device("meta"):
        assert SNIPLinear(32, 32).generator is None  # tokens stay on the CPU under a default device
    stranger = torch.tensor([10**9, 0])
    with pytest.raises(RuntimeError, match="names no generator in this process"):
        rng.generator_of(stranger)
    assert rng.generator_of(stranger, missing_ok=True) is None
    # A layer unpickled where its generator is unknown (another process) draws from torch's default.
    import pickle

    layer._rng_token = stranger
    assert pickle.loads(pickle.dumps(layer)).generator is None
    with pytest.raises(TypeError, match="generator: expected a torch.Generator or None, got int"):
        layer.generator = 3


def test_hugging_face_llama_traces_whole_with_layers_in_mixed_formats():
    transformers = pytest.importorskip("transformers")
    from lightning_snip.convert import convert_linears

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    layers = convert_linears(model)
    generator = torch.Generator().manual_seed(0)
    formats = [Format.FP8, Format.MXFP4, Format.NVFP4]
    for i, layer in enumerate(layers.values()):
        if layer.pinned is None:
            layer.format = formats[i % 3]
        layer.generator = generator
    ids = torch.randint(0, 256, (2, 32))

    def loss(ids):
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(loss)(ids)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    results = []
    for fn in (loss, torch.compile(loss, backend="aot_eager")):
        model.zero_grad()
        generator.manual_seed(1)
        value = fn(ids)
        value.backward()
        results.append((value.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
