import pytest
from hydra import compose, initialize_config_dir
from omegaconf.errors import ValidationError

from lightning_snip.config import SNIPConfig
from lightning_snip.formats import Format
from lightning_snip.train import CONF_DIR, TrainConfig, register_configs, to_config


def _compose(overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_compose_with_overrides_builds_the_config():
    cfg = to_config(_compose(["trainer.max_steps=60", "snip.warmup_steps=10", "snip.interval=20", "snip.fp4_fraction=0.8",
                              "snip.candidate_formats=[fp8,nvfp4]", "model.num_layers=2", "data.path=/nonexistent/corpus.txt"]))
    assert isinstance(cfg, TrainConfig) and isinstance(cfg.snip, SNIPConfig)
    assert cfg.trainer.max_steps == 60 and cfg.snip.interval == 20 and cfg.snip.fp4_fraction == 0.8
    assert cfg.snip.candidate_formats == (Format.FP8, Format.NVFP4) and cfg.model.num_layers == 2
    assert cfg.snip.pin_formats == {"*lm_head": "bf16"} and cfg.data.path == "/nonexistent/corpus.txt"
    with pytest.raises(Exception):
        cfg.snip.interval = 3  # frozen once built


def test_defaults_match_the_dataclasses():
    cfg = to_config(_compose([]))
    assert cfg.snip == SNIPConfig()


@pytest.mark.parametrize(
    "override, field",
    [
        ("snip.fp4_fraction=1.5", "snip.fp4_fraction"),
        ("snip.interval=0", "snip.interval"),
        ("snip.fp4_fraction=-0.1", "snip.fp4_fraction: invalid value -0.1"),
        ("data.batch_size=0", "data.batch_size"),
    ],
)
def test_invalid_values_name_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        to_config(_compose([override]))


def test_a_removed_setting_says_it_was_removed_and_what_replaced_it():
    from lightning_snip.train import ConfigError, check_overrides

    with pytest.raises(TypeError, match=r"^noise_draws: removed on 2026-12-04: fixed at 2"):
        SNIPConfig(noise_draws=1)
    with pytest.raises(TypeError, match=r"^cost_budget: removed .*fp4_fraction"):
        SNIPConfig(fp4_fraction=0.5, cost_budget=0.4)
    with pytest.raises(ConfigError, match=r"^snip.first_order_rows: removed on 2026-12-04: .*max_rows"):
        check_overrides(["snip.first_order_rows=256"])


def test_wrong_type_is_rejected_by_the_schema():
    with pytest.raises(Exception, match="interval"):
        _compose(["snip.interval=often"])
    with pytest.raises(Exception, match="initial_format"):  # an Enum field: only its members
        _compose(["snip.initial_format=fp6"])
    with pytest.raises(Exception, match="fp4_fraction"):  # a number, never null (the target is always FP4 FLOPs)
        _compose(["snip.fp4_fraction=null"])


def test_choices_are_enums_read_by_value_or_name():
    """Enum-typed fields take the value as configs write it (any case) or the member's name, and
    hold the Enum; a library user's strings become the Enums too."""
    from lightning_snip.config import TargetScope
    from lightning_snip.plan import Granularity

    cfg = to_config(_compose(["snip.granularity=layer", "snip.target_scope=MODEL", "snip.initial_format=Mxfp4"]))
    assert cfg.snip.granularity is Granularity.LAYER and cfg.snip.target_scope is TargetScope.MODEL
    assert cfg.snip.initial_format is Format.MXFP4
    assert SNIPConfig(granularity="layer", fp8_scaling="tensorwise").granularity is Granularity.LAYER
    with pytest.raises(ValueError, match="^granularity: invalid value 'gems'; allowed: layer, gemm$"):
        SNIPConfig(granularity="gems")  # the library names its own field, without the app's prefix
    with pytest.raises(ValueError, match=r"^fp4_fraction: invalid value 1.5; allowed: a number in \[0, 1\]$"):
        SNIPConfig(fp4_fraction=1.5)


@pytest.mark.parametrize("override,expected", [
    (None, {"*lm_head": "bf16"}),
    ("snip.pins=[]", {}),  # clears them (a dict override would merge into the default)
    ('snip.pins=["*lm_head=bf16","*.attn.q=fp8"]', {"*lm_head": "bf16", "*.attn.q": "fp8"}),
    ('snip.extra_pins=["*.attn.q=fp8"]', {"*lm_head": "bf16", "*.attn.q": "fp8"}),  # adds one
])
def test_pins_from_the_command_line(override, expected):
    cfg = to_config(_compose([override] if override else []))
    assert cfg.snip.pin_formats == expected


@pytest.mark.parametrize("override,message", [
    ("snip.pins=[lm_head]", r"snip.pins\[0\]: 'lm_head' is not 'glob=format'"),
    ('snip.pins=["*lm_head=fp5"]', r"snip.pins\[\*lm_head\]: unknown format 'fp5'"),
    ("+snip.foo=1", r"snip.foo: unknown key; allowed: .*interval"),
    ("model.num_heads=3", r"model.num_heads: 3 does not divide model.dim 128; allowed: a divisor of 128"),
    ("model.dim=65", r"model.dim: 65 is not a multiple of model.num_heads 4; allowed: a multiple of 4"),  # the field set
    ("model.num_kv_heads=3", r"model.num_kv_heads: 3 does not divide model.num_heads 4; allowed: a divisor of 4"),
    ("model.dim=60", r"model.dim: 60 gives an odd head size 15"),
    ("data.seq_len=600", r"data.seq_len: 600 exceeds model.max_seq_len 512"),
    ("trainer.precision=bogus", r"trainer.precision: invalid value 'bogus'; allowed: 32-true"),
    ("snip.noise_guard_threshold=0", r"snip.noise_guard_threshold: invalid value 0.0; allowed: a finite number > 0"),
])
def test_composed_config_errors_name_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        to_config(_compose([override]))


def test_python_api_takes_a_mapping_of_pins():
    assert SNIPConfig(pins={"*.q": "fp8"}).pin_formats == {"*.q": "fp8"}
    # an extra pin that restates a glob of pins comes after them (the last matching pin wins: convert_linears)
    assert list(SNIPConfig(pins=["*=fp8", "*.q=bf16"], extra_pins=["*=mxfp4"]).pin_formats.items()) == [
        ("*.q", "bf16"), ("*", "mxfp4")]


@pytest.mark.parametrize("kw, message", [
    (dict(extra_pins=["*.q=blah"]), r"^extra_pins\[\*\.q\]: unknown format 'blah'"),  # (the field it was written in)
    (dict(include=[1]), r"^include: invalid value \[1\]; allowed: a list of glob strings"),
    (dict(exclude=["*head", None]), r"^exclude: invalid value \['\*head', None\]; allowed: a list of glob strings"),
])
def test_python_api_errors_name_the_field_written(kw, message):
    with pytest.raises(ValueError, match=message):
        SNIPConfig(**kw)


def test_group_layers_reaches_the_round(monkeypatch):
    """RoundSettings.group_layers (None: the device's default) is estimate_divergence's; bad settings fail naming the
    field."""
    import lightning_snip.statistics_round as statistics_round

    seen = []

    def estimate(*args, group_layers, probe_scale, antithetic, **kwargs):
        seen.append((group_layers, probe_scale, antithetic))
        raise RuntimeError("stop here")

    monkeypatch.setattr(statistics_round, "estimate_divergence", estimate)
    import torch
    from lightning_snip.convert import convert_linears
    from lightning_snip.demo.model import LlamaConfig, TinyLlama

    model = TinyLlama(LlamaConfig(dim=32, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=64))
    layers = convert_linears(model)
    tokens = torch.randint(0, 256, (2, 9))
    default = statistics_round.RoundSettings()
    for settings in (statistics_round.RoundSettings(group_layers=3, probe_scale=0.5, antithetic=True), default):
        with pytest.raises(RuntimeError, match="stop here"):
            statistics_round.run_statistics_round(model, (tokens[:, :-1], tokens[:, 1:]), model.loss, layers,
                                                  SNIPConfig(), settings=settings)
    assert seen == [(3, 0.5, True), (None, default.probe_scale, default.antithetic)]
    for bad in (dict(noise_draws=0), dict(wd_probes=2.0), dict(group_layers=True), dict(probe_scale=0),
                dict(probe_scale=1.5), dict(probe_scale=float("nan")), dict(probe_scale=True), dict(antithetic=1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            statistics_round.RoundSettings(**bad)
