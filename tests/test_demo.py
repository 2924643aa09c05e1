"""The demo package's training helpers."""

from lightning_snip.demo.lightning import lr_factor


def test_warmup_then_cosine_schedule():
    factors = [lr_factor(step, warmup_steps=4, cosine_steps=20, min_lr_ratio=0.1) for step in range(24)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[4] == 1.0
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))  # non-increasing after the warmup
    assert abs(factors[12] - 0.55) < 1e-12  # half-way through the decay: the mean of 1 and 0.1
    assert factors[20:] == [0.1] * 4  # the floor from cosine_steps on
    assert [lr_factor(s, warmup_steps=0) for s in (0, 50)] == [1.0, 1.0]  # constant
