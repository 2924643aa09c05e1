import copy

import pytest
import torch

from lightning_snip.adamw import read_adam_state


def _adamw_update(param, state, grad, lr=1e-3):
    """The update torch's own AdamW (weight decay 0) makes from ``state`` with gradient ``grad``."""
    p = torch.nn.Parameter(param.double())  # float64: the difference of two updates must not cancel
    opt = torch.optim.AdamW([p], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    opt.state[p] = {k: v.double() if k != "step" else v for k, v in copy.deepcopy(state).items()}
    p.grad = grad.double()
    opt.step()
    return param.double() - p.detach()


@pytest.mark.parametrize("kernels", ["eager", "compiled"])
@pytest.mark.parametrize("regime", ["trained", "never_seen"])
def test_update_deviation_is_torch_adamws_update_difference(regime, kernels, monkeypatch):
    # AdamState's maps run as lightning_snip.adamw's kernels: compiled by default (one pass over the
    # moments each), eager in the other tests; both must be torch's AdamW.
    monkeypatch.setenv("LIGHTNING_SNIP_QUANTIZERS", kernels)
    torch.manual_seed(0)
    param = torch.zeros(64, 32)
    if regime == "trained":
        state = {"step": torch.tensor(5.0), "exp_avg": 0.01 * torch.randn(64, 32),
                 "exp_avg_sq": 1e-4 * torch.rand(64, 32)}
        grad = 0.01 * torch.randn(64, 32)
    else:  # an embedding row that never had a gradient: v = 0, where 1/eps would amplify an error
        state = {"step": torch.tensor(5.0), "exp_avg": torch.zeros(64, 32), "exp_avg_sq": torch.zeros(64, 32)}
        grad = torch.zeros(64, 32)
    delta = 1e-4 * torch.randn(64, 32)
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    opt.state[p] = copy.deepcopy(state)
    adam = read_adam_state(opt, p)
    expected = _adamw_update(param, state, grad + delta) - _adamw_update(param, state, grad)
    got = adam.update_deviation(grad, delta)
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-5
    if regime == "never_seen":
        # AdamW moves such an element by about lr, whatever the error's size; the linearization
        # c * delta / eps would claim 1e4 x lr here.
        assert float(got.abs().max()) < 2e-3
        linearized = adam.gradient_gain() * delta / 1e-8
        assert float(linearized.abs().max()) > 100 * float(got.abs().max())
    # Batched deltas (one per format) give each its own deviation.
    both = adam.update_deviation(grad, torch.stack([delta, 2 * delta]))
    assert torch.allclose(both[0], got) and not torch.allclose(both[1], got)
    # The next update's energy (WD's denominator) is torch's AdamW update with this gradient, squared.
    energy = float(adam.next_update_energy(grad))
    assert energy == pytest.approx(float(_adamw_update(param, state, grad).pow(2).sum()), rel=1e-5)
    assert energy == pytest.approx(float(adam.after(grad).update().pow(2).sum()), rel=1e-5)
