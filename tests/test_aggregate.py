import json
import math

import pytest

from lightning_snip.aggregate import DivergenceAggregate
from lightning_snip.formats import Format

MXFP4, NVFP4, FP8 = Format.MXFP4, Format.NVFP4, Format.FP8


def _round(ld: dict, wd: dict | None = None) -> dict:
    """One round's values: fqn -> {format: value}."""
    return {"loss_divergence": ld, "weight_divergence": wd if wd is not None else {k: {MXFP4: 0.0} for k in ld}}


def test_ema_values_with_startup_correction():
    agg = DivergenceAggregate(decay=0.5)
    agg.update(_round({"a": {MXFP4: 4.0}}, {"a": {MXFP4: 1.0}}))
    # One round: its own value (the start-up bias is divided out).
    assert agg.values("loss_divergence") == {"a": {MXFP4: 4.0}}
    agg.update(_round({"a": {MXFP4: 1.0}}, {"a": {MXFP4: 3.0}}))
    # s = 0.5*(0.5*4) + 0.5*1 = 1.5, w = 0.5*0.5 + 0.5 = 0.75 -> 2.0 (weights 1/3, 2/3)
    assert agg.values("loss_divergence")["a"][MXFP4] == pytest.approx(2.0)
    assert agg.values("weight_divergence")["a"][MXFP4] == pytest.approx((0.25 * 1 + 0.5 * 3) / 0.75)
    agg.update(_round({"a": {MXFP4: 7.0}}))
    expected = (0.125 * 4 + 0.25 * 1 + 0.5 * 7) / (0.125 + 0.25 + 0.5)
    assert agg.values("loss_divergence")["a"][MXFP4] == pytest.approx(expected)
    assert agg.num_rounds == 3


@pytest.mark.parametrize("decay", [0.0, 0.3, 0.9])
def test_decay_sets_the_weight_of_history(decay):
    agg = DivergenceAggregate(decay=decay)
    values = [3.0, -1.0, 2.0, 5.0]
    for v in values:
        agg.update(_round({"a": {NVFP4: v}}))
    weights = [decay ** (len(values) - 1 - i) for i in range(len(values))]
    expected = sum(w * v for w, v in zip(weights, values)) / sum(weights)
    assert agg.values("loss_divergence")["a"][NVFP4] == pytest.approx(expected)
    if decay == 0.0:
        assert agg.values("loss_divergence")["a"][NVFP4] == 5.0  # the last round alone


def test_non_finite_round_reads_inf_until_a_finite_one_returns():
    agg = DivergenceAggregate(decay=0.5)
    agg.update(_round({"a": {MXFP4: 2.0}, "b": {MXFP4: math.inf}}))
    agg.update(_round({"a": {MXFP4: math.nan}, "b": {MXFP4: math.inf}}))
    values = agg.values("loss_divergence")
    assert values["a"][MXFP4] == math.inf and values["b"][MXFP4] == math.inf
    agg.update(_round({"a": {MXFP4: 4.0}, "b": {MXFP4: math.inf}}))
    # The NaN round was never folded in: history 2 (weight 0.25), then 4 (weight 0.5).
    assert agg.values("loss_divergence")["a"][MXFP4] == pytest.approx((0.25 * 2 + 0.5 * 4) / 0.75)
    assert agg.values("loss_divergence")["b"][MXFP4] == math.inf


def test_state_dict_round_trip_through_json():
    agg = DivergenceAggregate(decay=0.7)
    for v in (1.0, 2.0, math.inf):
        agg.update(_round({"a": {MXFP4: v, FP8: v / 10}, "b": {MXFP4: 2 * v}}))
    restored = DivergenceAggregate(decay=0.7)
    restored.load_state_dict(json.loads(json.dumps(agg.state_dict(), allow_nan=True)))
    assert restored.num_rounds == 3
    for metric in ("loss_divergence", "weight_divergence"):
        assert restored.values(metric) == agg.values(metric)
    restored.update(_round({"a": {MXFP4: 5.0, FP8: 0.5}, "b": {MXFP4: 1.0}}))
    agg.update(_round({"a": {MXFP4: 5.0, FP8: 0.5}, "b": {MXFP4: 1.0}}))
    assert restored.values("loss_divergence") == agg.values("loss_divergence")


@pytest.mark.parametrize("decay", [-0.1, 1.0, 2, "high", None])
def test_invalid_decay_names_the_field(decay):
    with pytest.raises(ValueError, match=r"decay: invalid value .*allowed: a number in \[0, 1\)"):
        DivergenceAggregate(decay=decay)


def test_unknown_metric_is_rejected():
    with pytest.raises(ValueError, match="metric: invalid value 'ld'"):
        DivergenceAggregate(0.5).values("ld")


def test_formats_stay_format_members_until_written_out():
    """The aggregate keys formats by Format (a name only in its saved state): a format name is refused, naming
    where it was found."""
    agg = DivergenceAggregate(0.5)
    with pytest.raises(TypeError, match=r"values\['loss_divergence'\]\['a'\]: format keys must be Format members, got 'mxfp4'"):
        agg.update(_round({"a": {"mxfp4": 1.0}}))
    agg.update(_round({"a": {MXFP4: 1.0}}))
    state = agg.state_dict()
    assert {entry[2] for entry in state["entries"]} == {"mxfp4"}  # written out by name
    restored = DivergenceAggregate(0.5)
    restored.load_state_dict(state)
    assert list(restored.values("loss_divergence")["a"]) == [MXFP4]
