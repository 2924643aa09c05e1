"""LD's first-order term <G, dY> sampled on live training steps, so the round averages it over many batches.

One batch's first-order term is mostly that batch's noise (signed, its sampling error larger than its mean); the
``first_order_steps`` training steps before each statistics round also measure it, on ``max_rows`` token
rows of each step's batch, while their own backward pass runs: FirstOrderSampler (through each layer's first-order tap) hands the rows to
FirstOrderTerms, and FirstOrderRecorder is the controller's switch for it. Written here: no library samples a
layer's input and output gradient on a training step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping

import torch

from lightning_snip.config import SNIPConfig
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.gemm import mm_fp32, quantized_matmul
from lightning_snip.kernels import own_work
from lightning_snip.linear import SNIPLinear, new_tap, set_tap_receiver


class FirstOrderSampler:
    """Each layer's input rows X and output-gradient rows G of ordinary training steps (``max_rows`` token
    rows spread over the step's batch), handed to ``measure`` while the backward pass runs, so LD's
    first-order term <G, dY> can be averaged over many batches instead of one (FirstOrderTerms).
    ``measure(fqn, x, g, weight, total_rows)`` sees the weight the forward pass used: the optimizer has not
    stepped yet.

    The operands come through each layer's first-order tap (lightning_snip.linear.first_order_tap), given
    here: a compiled model samples in its compiled graph. Use as ``with sampler.recording(offset): <one
    training step's forward and backward>``. The step runs in the layers' current formats: G is the
    gradient at the point training is at.
    """

    def __init__(self, layers: Mapping[str, SNIPLinear], max_rows: int,
                 measure: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, int], None]) -> None:
        self.layers = layers
        self.max_rows = max_rows
        self.measure = measure
        for layer in layers.values():  # (before a compile: a tap given later would recompile once)
            if layer.first_order_tap is None:
                layer.first_order_tap = new_tap()

    @contextlib.contextmanager
    def recording(self, offset: int = 0):
        """Sample the steps inside the block. ``offset`` shifts the rows sampled (a stride's phase), so
        successive steps sample all token positions, not every stride-th one alone."""
        taps = [(layer.first_order_tap, self._receiver(fqn, offset)) for fqn, layer in self.layers.items()]
        for (tap, receive), layer in zip(taps, self.layers.values()):
            set_tap_receiver(tap, receive)
            layer.tap_open = True
        try:
            yield self
        finally:
            for (tap, _), layer in zip(taps, self.layers.values()):
                set_tap_receiver(tap, None)
                layer.tap_open = False

    def _receiver(self, fqn: str, offset: int):
        def receive(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> None:
            total_rows = x.shape[0]
            stride = max(1, -(-total_rows // self.max_rows))  # ceil: the samples cover the whole batch
            rows = slice(offset % stride, None, stride)
            # The rows in the dtype of the round's GEMM operands (RoundPrecision.TRAINING: bf16 where the
            # layer's GEMM ran in bf16), so this term and the round's own are measured on the same operands.
            sampled_x = x[rows].to(torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
            self.measure(fqn, sampled_x, g[rows].float(), weight.detach(), total_rows)

        return receive


class FirstOrderTerms:
    """LD's first-order term <G, dY> of sampled training batches, per (fqn, format): the evidence of
    LD (loss_divergence). Its ``add`` is a FirstOrderSampler's ``measure``.

    A sample holds ``rows`` of a batch of ``total_rows`` rows; the sum over them is scaled by
    total_rows / rows, an estimate of the whole batch's term. ``grad_scale`` is divided out of the
    recorded gradients (1 / accumulate_grad_batches, times an AMP loss scale). A non-finite sample
    (an overflowing fp16 step) is dropped.
    """

    def __init__(self, formats: Iterable[Format], *, recipe: QuantRecipe = QuantRecipe()) -> None:
        self.formats = [f for f in dict.fromkeys(formats) if f is not Format.BF16]
        self.recipe = recipe
        self.grad_scale = 1.0
        self.values: dict[tuple[str, Format], list[float]] = {}
        # (key, the sum <G, dY> as a device scalar, total_rows, rows, grad_scale): read in one transfer by take(),
        # not one per layer and format (each a device sync in the middle of the backward pass)
        self._pending: list[tuple[tuple[str, Format], torch.Tensor, int, int, float]] = []

    def add(self, fqn: str, x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, total_rows: int) -> None:
        """``x`` in the dtype of the round's GEMM operands (FirstOrderSampler: bf16 where the layer's
        GEMM ran in bf16; the weight is cast to it, as autocast casts it), ``g`` in fp32."""
        with torch.no_grad(), own_work():
            w = weight.to(x.dtype)
            y = mm_fp32(x, w)
            g = g.float()
            for fmt in self.formats:
                dy = quantized_matmul(x, w, fmt, recipe=self.recipe, b_is_weight=True, out_dtype=torch.float32) - y
                self._pending.append(((fqn, fmt), (g * dy).sum(), total_rows, x.shape[0], self.grad_scale))

    def take(self) -> dict[tuple[str, Format], list[float]]:
        """The values collected so far, and a fresh start."""
        if self._pending:
            sums = torch.stack([p[1] for p in self._pending]).tolist()
            for (key, _, total_rows, rows, grad_scale), total in zip(self._pending, sums):
                value = total * total_rows / rows / grad_scale
                if math.isfinite(value):
                    self.values.setdefault(key, []).append(value)
            self._pending = []
        values, self.values = self.values, {}
        return values


class FirstOrderRecorder:
    """LD's first-order term sampled on live training steps: FirstOrderSampler's taps on the
    unpinned layers (pinned ones never change format, so their LD is never used), measuring into
    FirstOrderTerms."""

    def __init__(self, layers: Mapping[str, SNIPLinear], config: SNIPConfig) -> None:
        self.terms = FirstOrderTerms(config.candidate_formats, recipe=config.recipe)
        self.sampler = FirstOrderSampler({fqn: layer for fqn, layer in layers.items() if layer.pinned is None},
                                         config.max_rows, self.terms.add)
        self._recording: contextlib.ExitStack | None = None

    def start(self, step: int, grad_scale: float) -> None:
        if self._recording is not None:
            return
        self.terms.grad_scale = grad_scale
        self._recording = contextlib.ExitStack()
        self._recording.enter_context(self.sampler.recording(offset=step))

    def stop(self) -> None:
        if self._recording is not None:
            self._recording.close()
            self._recording = None

    def stop_and_take(self) -> dict[tuple[str, Format], list[float]]:
        """Stop, and the terms sampled since the last take."""
        self.stop()
        return self.terms.take()

