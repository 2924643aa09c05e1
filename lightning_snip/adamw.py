"""AdamW's update maths: the state of one weight and the maps the weight divergence needs.

The statistics round (lightning_snip.divergence) asks how far AdamW's next update moves when a
gradient is off by an error: exactly (AdamState.update_deviation), linearized
(AdamState.update_sensitivity, for the forward-mode probes) and the update's own energy. Each map
is a chain of 10-20 elementwise ops over a parameter's moments; eagerly every op is a pass over
parameter-sized memory (on an H200 at width 4096 the eager chains were most of a round's device
time), so each runs compiled as one pass (kernels.run_compiled). The hyper-parameters come as one
fp32 tensor ``h`` (AdamState.coefficients: beta1, 1 - beta1, beta2, 1 - beta2, 1 - beta2^t, eps,
lr / (1 - beta1^t), for the step t whose update is perturbed), not as Python floats, which a
compiled graph specializes on: the bias corrections change every step, and every round would recompile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from lightning_snip.kernels import run_compiled
from lightning_snip.sharding import is_sharded


@dataclass(frozen=True)
class AdamState:
    """AdamW's state for one weight: its moments (views of the optimizer's tensors, valid until the
    next optimizer step; the statistics round uses them before that) and its group's hyper-parameters."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int  # steps taken (0: none yet, zero moments)
    lr: float
    beta1: float
    beta2: float
    eps: float

    def coefficients(self) -> torch.Tensor:
        """The compiled update maps' hyper-parameters (this module's kernels) for the
        next step t = step + 1: beta1, 1 - beta1, beta2, 1 - beta2, 1 - beta2^t, eps, lr / (1 - beta1^t),
        computed in double and stored as one fp32 tensor on the moments' device."""
        b1, b2, t = self.beta1, self.beta2, self.step + 1
        values = [b1, 1 - b1, b2, 1 - b2, 1 - b2**t, self.eps, self.lr / (1 - b1**t)]
        return torch.tensor(values, dtype=torch.float32).to(self.exp_avg.device, non_blocking=True)

    def preconditioner(self) -> torch.Tensor:
        """A = 1 / (sqrt(v_hat) + eps), the elementwise scale AdamW applies to a gradient change."""
        v_hat = self.exp_avg_sq.float() / (1 - self.beta2**self.step)
        return 1.0 / (v_hat.sqrt() + self.eps)

    def update(self) -> torch.Tensor:
        """AdamW's step (without weight decay): lr * m_hat / (sqrt(v_hat) + eps)."""
        return self.lr * self.exp_avg.float() / (1 - self.beta1**self.step) * self.preconditioner()

    def after(self, grad: torch.Tensor | None) -> "AdamState":
        """The state after one more step with gradient ``grad`` (None: unchanged moments, step + 1).

        The update that a gradient error perturbs is the *next* one, whose moments already hold the
        step's own gradient: v grows with an unusually large gradient, which damps both the update's
        sensitivity and (through m) enlarges the update the deviation is measured against."""
        if grad is None:
            return dataclasses.replace(self, step=self.step + 1)
        g = grad.float()
        return dataclasses.replace(
            self,
            exp_avg=self.beta1 * self.exp_avg.float() + (1 - self.beta1) * g,
            exp_avg_sq=self.beta2 * self.exp_avg_sq.float() + (1 - self.beta2) * g * g,
            step=self.step + 1,
        )

    def update_deviation(self, grad: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """How far AdamW's next update (no weight decay) moves when this step's gradient ``grad``
        becomes ``grad + delta``: exact per element, not linearized. ``delta`` may carry leading
        batch dimensions.

        Linearizing, delta * lr (1 - beta1) / (1 - beta1^t) / (sqrt(v_hat) + eps), breaks where v is
        about 0 (an embedding row or element whose gradients were all 0 so far): there 1/eps (1e8)
        multiplies the error, while AdamW's real update moves by at most about lr, because the error
        also enters v. Written as a difference that does not cancel: u2 - u1 =
        c (dm / (s2 + eps) - m1 (s2 - s1) / ((s1 + eps)(s2 + eps))), s = sqrt(v_hat)."""
        return run_compiled(_adam_deviation_kernel, self.exp_avg, self.exp_avg_sq, grad, delta, self.coefficients())

    def next_update_energy(self, grad: torch.Tensor | None) -> torch.Tensor:
        """||u||^2 of AdamW's next update (no weight decay) after this step's gradient ``grad``, the
        same as ``after(grad).update().pow(2).sum()`` in one pass (a 0-d fp32 tensor)."""
        if grad is None:
            return self.after(None).update().pow(2).sum()
        return run_compiled(_adam_update_energy_kernel, self.exp_avg, self.exp_avg_sq, grad, self.coefficients())

    def update_sensitivity(self, grad: torch.Tensor | None) -> torch.Tensor:
        """dD/d(delta) at delta = 0, per element: the linear map that update_deviation becomes for
        small gradient errors (the forward-mode probes of WD's propagated term need a linear map).

        With m1, v1 the moments after this step's gradient g and s1 = sqrt(v1 / (1 - beta2^t)):
        lr / (1 - beta1^t) * ((1 - beta1) / (s1 + eps) - m1 (1 - beta2) g / ((1 - beta2^t) s1 (s1 + eps)^2)).
        Taken after the step, v1 >= (1 - beta2) g^2, so an element that has a gradient now is not
        scaled by 1/eps (the failure of the before-step linearization in the method text)."""
        g = torch.zeros_like(self.exp_avg, dtype=torch.float32) if grad is None else grad
        return run_compiled(_adam_sensitivity_kernel, self.exp_avg, self.exp_avg_sq, g, self.coefficients())

    def local(self) -> "AdamState":
        """This rank's shard of the moments (FSDP2: DTensors -> their local tensors)."""
        if not is_sharded(self.exp_avg):
            return self
        return dataclasses.replace(self, exp_avg=self.exp_avg.to_local(), exp_avg_sq=self.exp_avg_sq.to_local())

    def gradient_gain(self) -> float:
        """lr * (1 - beta1) / (1 - beta1^t): how much of a gradient change reaches this step's update."""
        return self.lr * (1 - self.beta1) / (1 - self.beta1**self.step)


def read_adam_state(optimizer: torch.optim.Optimizer | None, weight: nn.Parameter) -> AdamState | None:
    """AdamState of ``weight`` if ``optimizer`` keeps Adam-style moments for it, else None."""
    if optimizer is None:
        return None
    group = next((g for g in optimizer.param_groups if any(p is weight for p in g["params"])), None)
    if group is None:
        return None
    state = optimizer.state.get(weight, {})
    if "exp_avg" not in state or "exp_avg_sq" not in state:
        if "betas" not in group or state:
            return None
        # An Adam-family optimizer before its first step (snip.warmup_steps=0): zero moments, step 0.
        state = {"exp_avg": torch.zeros_like(weight), "exp_avg_sq": torch.zeros_like(weight), "step": 0}
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    step = int(state["step"]) if "step" in state else 1
    return AdamState(
        exp_avg=state["exp_avg"].detach(),
        exp_avg_sq=state["exp_avg_sq"].detach(),
        step=step,
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group.get("eps", 1e-8)),
    )


# --- the update maps, compiled (kernels.run_compiled) ---------------------------------------------


def _adam_sensitivity_kernel(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                             h: torch.Tensor) -> torch.Tensor:
    b1, c1, b2, c2, bc2, eps, gain = h[0], h[1], h[2], h[3], h[4], h[5], h[6]
    g = grad.float()
    m1 = b1 * exp_avg.float() + c1 * g
    s1 = ((b2 * exp_avg_sq.float() + c2 * g * g) / bc2).sqrt()
    through_v = torch.where(s1 > 0, m1 * c2 * g / (bc2 * s1.clamp_min(1e-38) * (s1 + eps) ** 2), torch.zeros_like(s1))
    return gain * (c1 / (s1 + eps) - through_v)


def _adam_deviation_kernel(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, delta: torch.Tensor,
                           h: torch.Tensor) -> torch.Tensor:
    b1, c1, b2, c2, bc2, eps, gain = h[0], h[1], h[2], h[3], h[4], h[5], h[6]
    g, d = grad.float(), delta.float()
    m1 = b1 * exp_avg.float() + c1 * g
    v1 = b2 * exp_avg_sq.float() + c2 * g * g
    dv = c2 * d * (2 * g + d)  # v2 - v1
    s1 = (v1 / bc2).sqrt()
    s2 = ((v1 + dv).clamp_min(0) / bc2).sqrt()
    ds = torch.where(s1 + s2 > 0, dv / bc2 / (s1 + s2), torch.zeros_like(dv))
    return gain * (c1 * d / (s2 + eps) - m1 * ds / ((s1 + eps) * (s2 + eps)))


def _adam_update_energy_kernel(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                               h: torch.Tensor) -> torch.Tensor:
    b1, c1, b2, c2, bc2, eps, gain = h[0], h[1], h[2], h[3], h[4], h[5], h[6]
    g = grad.float()
    m1 = b1 * exp_avg.float() + c1 * g
    v1 = b2 * exp_avg_sq.float() + c2 * g * g
    return (gain * m1 / ((v1 / bc2).sqrt() + eps)).pow(2).sum()
