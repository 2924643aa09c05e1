"""The default pins keep the output head in bf16 whatever its name (found by what it is:
lightning_snip.convert.find_output_head), and say at setup when they pin nothing."""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_snip.config import SNIPConfig
from lightning_snip.controller import SNIPController
from lightning_snip.convert import find_output_head
from lightning_snip.formats import Format

torch.set_num_threads(1)

VOCAB = 320  # no inner layer of the models below has 320 outputs


class _Block(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.dense = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)


class _NeoXLike(nn.Module):
    """GPT-NeoX's layout as its checkpoints name it: embed_in, layers, embed_out."""

    def __init__(self):
        super().__init__()
        self.embed_in = nn.Embedding(VOCAB, 64)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.embed_out = nn.Linear(64, VOCAB, bias=False)


class _MetaLlamaLike(nn.Module):
    """Meta's / GGUF's Llama layout: tok_embeddings, layers, output; the head registered first, so that
    registration order cannot be what finds it."""

    def __init__(self):
        super().__init__()
        self.output = nn.Linear(64, VOCAB, bias=False)
        self.tok_embeddings = nn.Embedding(VOCAB, 64)
        self.layers = nn.ModuleList(_Block() for _ in range(2))


def _attach(model, config=None, caplog=None):
    controller = SNIPController(config or SNIPConfig())
    controller.attach(model)
    if caplog is not None:
        with caplog.at_level(logging.INFO, logger="lightning_snip"):
            controller.log_setup("cpu")
    return controller


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("lightning_snip")]


@pytest.mark.parametrize("model, head", [(_NeoXLike, "embed_out"), (_MetaLlamaLike, "output")])
def test_a_head_by_another_name_stays_bf16_at_the_defaults(model, head, caplog):
    controller = _attach(model(), caplog=caplog)
    layer = controller.layers[head]
    assert layer.pinned is Format.BF16 and layer.format is Format.BF16
    assert [fqn for fqn, other in controller.layers.items() if other.pinned is not None] == [head]
    assert f"SNIP: pinned the output head {head} (64->{VOCAB}, out_features = vocabulary) in bf16" in caplog.text
    assert "SNIP: 9 converted layers (1 pinned, 8 switchable)" in caplog.text
    assert not _warnings(caplog)


def test_a_tied_head_is_found_and_stays_tied():
    """A Hugging Face Llama with tied embeddings: its head is lm_head (found by name, by its declared output
    embedding and by the tie); the converted head still holds the embedding's Parameter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert find_output_head(model) == "lm_head"
    controller = _attach(model)
    assert controller.layers["lm_head"].pinned is Format.BF16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(layer.pinned is not None for layer in controller.layers.values()) == 1


def test_a_tied_head_by_any_name_is_found_by_the_tie():
    """No declared vocabulary and two embedding tables of one size (token and position): the tie decides."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(64, 64)
            self.wpe = nn.Embedding(64, 64)
            self.layers = nn.ModuleList(_Block() for _ in range(2))
            self.unembed = nn.Linear(64, 64, bias=False)
            self.unembed.weight = self.wte.weight
            self.pool = nn.Linear(64, 64)  # registered after the head, of the vocabulary's size

    model = Tied()
    assert find_output_head(model) == "unembed"
    controller = _attach(model)
    assert [fqn for fqn, layer in controller.layers.items() if layer.pinned is not None] == ["unembed"]
    assert model.unembed.weight is model.wte.weight


def test_a_declared_output_embedding_comes_first_and_a_shared_size_goes_to_the_last_registered():
    class Declared(nn.Module):  # a Hugging Face-style model whose head is padded past the vocabulary
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 64)
            self.layers = nn.ModuleList(_Block() for _ in range(2))
            self.decoder = nn.Linear(64, 384)
            self.extra = nn.Linear(64, VOCAB)  # of the vocabulary's size, but not the declared one

        def get_output_embeddings(self):
            return self.decoder

    assert find_output_head(Declared()) == "decoder"

    class Shared(_NeoXLike):  # the MLP's 4 x 64 outputs are the vocabulary's size too
        def __init__(self):
            super().__init__()
            self.embed_in = nn.Embedding(256, 64)
            self.embed_out = nn.Linear(64, 256, bias=False)

    assert [fqn for fqn, m in Shared().named_modules() if isinstance(m, nn.Linear) and m.out_features == 256] == [
        "layers.0.up", "layers.1.up", "embed_out"]
    assert find_output_head(Shared()) == "embed_out"

    class Encoder(nn.Module):  # declares its vocabulary; a position table shares the MLP's size; no LM head
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(vocab_size=VOCAB)
            self.tokens, self.positions = nn.Embedding(VOCAB, 64), nn.Embedding(256, 64)
            self.layers = nn.ModuleList(_Block() for _ in range(2))

    assert find_output_head(Encoder()) is None


def test_pins_a_user_wrote_disable_the_head_pin_and_setup_says_the_head_is_switchable(caplog):
    for pins in ([], ["layers.0.up=fp8"]):
        caplog.clear()
        written = _attach(_NeoXLike(), SNIPConfig(pins=pins), caplog=caplog)
        assert written.layers["embed_out"].pinned is None
        warnings = _warnings(caplog)
        assert len(warnings) == 1 and warnings[0].startswith("SNIP: the pins you wrote leave the output head "
                                                             "embed_out (64->")
        assert "add 'embed_out=bf16' to pins" in warnings[0]
    assert written.layers["layers.0.up"].pinned is Format.FP8
    caplog.clear()
    _attach(_NeoXLike(), SNIPConfig(pins=["embed_out=fp8"]), caplog=caplog)  # the head in a pin of theirs: their call
    assert not _warnings(caplog)
    # A pins list equal to the default is the default (the app's schema holds the default as a list).
    assert _attach(_NeoXLike(), SNIPConfig(pins=["*lm_head=bf16"])).layers["embed_out"].pinned is Format.BF16
    # extra_pins add to the default pins and keep them; a pin naming the head wins over the automatic one.
    extra = _attach(_NeoXLike(), SNIPConfig(extra_pins=["layers.0.up=fp8"]))
    assert extra.layers["embed_out"].pinned is Format.BF16 and extra.layers["layers.0.up"].pinned is Format.FP8
    own = _attach(_NeoXLike(), SNIPConfig(extra_pins=["embed_out=fp8"]), caplog=caplog)
    assert own.layers["embed_out"].pinned is Format.FP8
    assert "pinned the output head" not in caplog.text and not _warnings(caplog)


def test_a_classifier_head_is_not_guessed_and_setup_warns_naming_the_largest_linear(caplog):
    """A Hugging Face classifier: ``score`` has num_labels (3) outputs, not the vocabulary's, and nothing else
    identifies it. No layer is pinned, and one warning line names the largest Linear by FLOPs and the pin."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_labels=3, pad_token_id=0))
    assert find_output_head(model) is None
    controller = _attach(model, caplog=caplog)
    assert all(layer.pinned is None for layer in controller.layers.values())
    flops = {fqn: layer.in_features * layer.out_features for fqn, layer in controller.layers.items()}
    largest = "model.layers.0.mlp.gate_proj"  # 64 x 160, tied with up/down: the first in module order
    assert flops[largest] == max(flops.values())
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("SNIP: the default pins match no layer")
    assert f"the largest Linear by FLOPs is {largest} (64->160)" in warnings[0]
    assert f"extra_pins=['{largest}=bf16']" in warnings[0] and f"'snip.extra_pins=[\"{largest}=bf16\"]'" in warnings[0]
    # Following the advice silences it; so does choosing the layers (a head left out runs unconverted).
    for config in (SNIPConfig(extra_pins=[f"{largest}=bf16"]), SNIPConfig(exclude=["score"])):
        caplog.clear()
        _attach(LlamaForSequenceClassification(model.config), config, caplog=caplog)
        assert not _warnings(caplog)
    caplog.clear()  # a pin of the user's own holding the head (here the real one) in bf16 silences it too
    _attach(LlamaForSequenceClassification(model.config), SNIPConfig(extra_pins=["score=bf16"]), caplog=caplog)
    assert not _warnings(caplog)
    # An unrelated extra pin to another format does not: the head still joins the plan.
    caplog.clear()
    _attach(LlamaForSequenceClassification(model.config), SNIPConfig(extra_pins=["*.0.self_attn.q_proj=fp8"]),
            caplog=caplog)
    assert len(_warnings(caplog)) == 1 and _warnings(caplog)[0].startswith("SNIP: the default pins match no layer")


def test_the_lm_head_glob_needs_no_second_line(caplog):
    from lightning_snip.demo.model import LlamaConfig, TinyLlama

    controller = _attach(TinyLlama(LlamaConfig(dim=64, num_layers=1, num_heads=4, num_kv_heads=2, hidden_dim=160)),
                         caplog=caplog)
    assert [fqn for fqn, layer in controller.layers.items() if layer.pinned is not None] == ["lm_head"]
    assert "pinned the output head" not in caplog.text and not _warnings(caplog)
