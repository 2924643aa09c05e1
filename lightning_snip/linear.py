"""SNIPLinear: an nn.Linear whose forward, dgrad and wgrad GEMMs follow a switchable format.

For X (N x k), W (m x k), G = dL/dY (N x m), each GEMM quantizes both operands along its own
contraction axis (docs/method.md section 1):

    fwd    Y  = Q(X) Q(W)^T      contraction over k
    dgrad  dX = Q(G) Q(W)        contraction over m
    wgrad  dW = Q(G)^T Q(X)      contraction over N (tokens)

Forward operands round to nearest; gradient operands of FP4 GEMMs round stochastically (recipe).
Every GEMM is ``gemm.quantized_matmul(a, b)`` = a @ b^T with the contraction along dim 1 of both.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_snip.formats import Format, Fp8Dtype, Fp8Scaling, QuantRecipe, Rounding
from lightning_snip.gemm import opaque_quantized_matmul, quantized_matmul
from lightning_snip.hadamard import sign_tensor
from lightning_snip.rng import generator_of, token_for

logger = logging.getLogger(__name__)


class _SNIPLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fmt: Format, backward_fmt: Format, recipe: QuantRecipe, generator, tap=None,
                rht_signs=None):
        x2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2d, weight)
        ctx.fmt, ctx.recipe, ctx.x_shape, ctx.has_bias = backward_fmt, recipe, x.shape, bias is not None
        ctx.generator, ctx.tap, ctx.rht_signs = generator, tap, rht_signs
        y = quantized_matmul(x2d, weight, fmt, recipe=recipe, b_is_weight=True)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        fmt, recipe, generator = ctx.fmt, ctx.recipe, ctx.generator
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.tap is not None:  # (a no-op unless a first-order sampler records this step)
            first_order_tap(x2d, g, weight, ctx.tap)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dX (N x k) = G (N x m) @ W (m x k): contraction over m.
            grad_x = quantized_matmul(g, weight.t(), fmt, recipe=recipe, a_is_grad=True, b_is_weight=True,
                                      generator=generator).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # dW (m x k) = G^T (m x N) @ X (N x k): contraction over tokens. Traced with a block format,
            # the token axis's padding to whole blocks is symbolic, and inductor's backward then failed
            # its stride checks when the token count changed (torch 2.13): opaque there instead.
            wgrad = opaque_quantized_matmul if fmt.block_size and torch.compiler.is_compiling() else quantized_matmul
            grad_w = wgrad(g.t(), x2d.t(), fmt, recipe=recipe, a_is_grad=True, hadamard=ctx.rht_signs,
                           generator=generator).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class SNIPLinear(nn.Linear):
    """An ``nn.Linear`` whose three GEMMs run in ``self.format``; switchable between steps.

    The Parameters, their names and the state_dict are exactly those of ``nn.Linear``, so a
    checkpoint loads strictly into the unconverted model. ``allowed_formats`` lists what this
    layer's shape supports (block formats need in/out features divisible by their block size).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        format: Format | str = Format.BF16,
        recipe: QuantRecipe = QuantRecipe(),
        allowed_formats: Iterable[Format] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_switching(format, recipe, allowed_formats)

    def _init_switching(self, format, recipe: QuantRecipe, allowed_formats: Iterable[Format] | None) -> None:
        self._recipe = recipe
        self.allowed_formats = frozenset(allowed_formats) if allowed_formats is not None else supported_formats(
            self.in_features, self.out_features
        )
        self.pinned: Format | None = None  # set by convert_linears; plans may not change it
        # dgrad/wgrad format when it differs from the forward's (None: same as ``format``): per-GEMM
        # plans (Granularity.GEMM), and measuring one direction alone (divergence_fidelity.py).
        self._backward_format: Format | None = None
        # Random source of the stochastic rounding of gradient operands; None: torch's global one.
        # SNIPCallback gives every layer one generator per rank, seeded per step from the run's seed.
        self.generator = None
        # The layer's first-order tap (new_tap): its backward hands X and G to the sampler that records it. Eager
        # code calls it only while ``tap_open`` (the sampled steps); a compiled graph always holds it (see forward).
        self.first_order_tap: torch.Tensor | None = None
        self.tap_open = False
        # The sign vector of the wgrad GEMM's random Hadamard transform (QuantRecipe.wgrad_hadamard): a function of
        # the layer's name (hadamard.layer_signs; convert_linears names it), the same on every rank.
        self.rht_signs: torch.Tensor = sign_tensor("")  # (a CPU tensor, not a buffer: the state_dict is nn.Linear's)
        self._format = Format.BF16
        self.format = format

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, format: Format | str = Format.BF16, recipe: QuantRecipe = QuantRecipe()):
        """Build a SNIPLinear that shares ``linear``'s Parameter objects (optimizer state stays valid)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        new.format = format
        return new

    @classmethod
    def convert_in_place(cls, linear: nn.Linear, *, format: Format | str = Format.BF16,
                         recipe: QuantRecipe = QuantRecipe()) -> "SNIPLinear":
        """Turn ``linear`` itself into a SNIPLinear (its class changes; the object, its Parameters and
        every hook on it stay). For modules that others hold by identity: FSDP2 all-gathers a
        block's parameters into the very module objects it recorded at ``fully_shard``, so a new
        module in their place would never see its weights. A class that a wrapper composed with
        nn.Linear (FSDP2's ``FSDPLinear`` when a linear is sharded on its own) keeps the wrapper."""
        linear.__class__ = _switchable_class(type(linear))
        linear._init_switching(format, recipe, None)
        return linear

    @property
    def format(self) -> Format:
        return self._format

    @format.setter
    def format(self, value: Format | str) -> None:
        fmt = Format.parse(value)
        if fmt not in self.allowed_formats:
            allowed = ", ".join(sorted(f.value for f in self.allowed_formats))
            raise ValueError(
                f"format: {fmt.value} is not supported by a {self.in_features}->{self.out_features} layer; "
                f"allowed: {allowed}"
            )
        self._format = fmt
        self._update_gemm_formats()

    def _update_gemm_formats(self) -> None:
        # What forward reads: the forward and backward formats' names and the recipe in one string. A
        # compiled graph guards on it (a new assignment recompiles once). Not the Format members (or the
        # recipe's enums) themselves: dynamo (torch 2.13) guarded an enum attribute of only the first of
        # two layers holding the same member, so a later change of the second's ran the stale graph
        # (tests/test_compile.py::test_a_new_format_assignment_recompiles_once_and_a_seen_one_never).
        backward = self._backward_format or self._format
        self._gemm_formats = f"{self._format.value}/{backward.value}|{self._recipe.key}"

    @property
    def recipe(self) -> QuantRecipe:
        return self._recipe

    @recipe.setter
    def recipe(self, value: QuantRecipe) -> None:
        if not isinstance(value, QuantRecipe):
            raise TypeError(f"recipe: expected a QuantRecipe, got {type(value).__name__}")
        self._recipe = value
        self._update_gemm_formats()

    def __setstate__(self, state) -> None:
        # A deep copy or an unpickled layer gets a copy of the RNG token; layers that name one generator
        # must share one token, or a compiled graph may reorder their draws (the token's mutation is
        # what orders them). A token from another process names nothing here: torch's default generator
        # until the callback (or the user) assigns one.
        super().__setstate__(state)
        if "rht_signs" not in state:  # (a layer pickled before the recipe's knobs existed: their recipe key too)
            self.rht_signs = sign_tensor("")
            self._update_gemm_formats()
        token = state.get("_rng_token")
        if token is not None:
            self._rng_token = token_for(generator_of(token, missing_ok=True))

    @property
    def generator(self) -> torch.Generator | None:
        """The random source of stochastic rounding (None: torch's default generator). Held as an RNG
        token (lightning_snip.rng), which a compiled graph draws through; a deep copy of the layer
        draws from the same generator as the original."""
        return generator_of(self._rng_token)

    @generator.setter
    def generator(self, value: torch.Generator | None) -> None:
        self._rng_token = token_for(value)

    @property
    def backward_format(self) -> Format | None:
        return self._backward_format

    @backward_format.setter
    def backward_format(self, value: Format | str | None) -> None:
        fmt = None if value is None else Format.parse(value, field_name="backward_format")
        if fmt is not None and fmt not in self.allowed_formats:
            allowed = ", ".join(sorted(f.value for f in self.allowed_formats))
            raise ValueError(f"backward_format: {fmt.value} is not supported by a {self.in_features}->"
                             f"{self.out_features} layer; allowed: {allowed}")
        self._backward_format = fmt
        self._update_gemm_formats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Traced by torch.compile into the model's graph in every format (no graph break; the GEMMs'
        # quantizers fuse with their neighbours), guarded on the formats (_update_gemm_formats).
        forward_format, backward_format, recipe = _GEMM_FORMATS[self._gemm_formats]
        # The tap is in an eager step's graph only on a sampled step (a bf16 layer keeps F.linear otherwise); a
        # compiled graph always holds it (one opaque call per layer, a no-op on unsampled steps), so starting or
        # stopping a sample recompiles nothing (``tap_open`` is not read while tracing: nothing guards on it).
        tap = self.first_order_tap if torch.compiler.is_compiling() or self.tap_open else None
        if forward_format is Format.BF16 and backward_format is Format.BF16 and tap is None:
            return F.linear(x, self.weight, self.bias)
        weight, bias = self.weight, self.bias
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # As torch's own linear under autocast: operands cast to the autocast dtype (the weight
            # cast is differentiable, so dW reaches the fp32 master weight), output in that dtype.
            dtype = torch.get_autocast_dtype(device_type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
            with torch.autocast(device_type, enabled=False):
                return _SNIPLinearFunction.apply(x, weight, bias, forward_format, backward_format, recipe, self._rng_token,
                                                 tap, self.rht_signs)
        return _SNIPLinearFunction.apply(x, weight, bias, forward_format, backward_format, recipe, self._rng_token, tap,
                                         self.rht_signs)

    def extra_repr(self) -> str:
        backward = "" if self._backward_format is None else f", backward_format={self._backward_format.value}"
        return f"{super().extra_repr()}, format={self._format.value}{backward}"


# First-order taps. LD's first-order term is sampled on live training steps from each layer's X and G
# (lightning_snip.first_order). Hooks broke a compiled graph at every layer (those steps had to run eagerly);
# what torch lacks, written here by hand: a tap, a CPU int64 tensor [key] a layer holds, and one custom
# operator its backward calls with X and G, opaque to torch.compile (one node in the compiled backward, no
# graph break, no recompile to start or stop sampling). Declared to mutate the tap, so no compiled graph
# drops the call. It hands the operands to the receiver registered under the tap's key, if any: a no-op
# on steps that are not sampled.
_TAP_KEYS = itertools.count((os.getpid() << 32) + 1)  # (as rng.py's keys: unique to this process)
_TAP_RECEIVERS: dict[int, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = {}


def new_tap() -> torch.Tensor:
    """A fresh first-order tap, to assign to a layer's ``first_order_tap``."""
    return torch.tensor([next(_TAP_KEYS)], dtype=torch.int64, device="cpu")


def set_tap_receiver(tap: torch.Tensor, receive: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None) -> None:
    """``receive(x2d, g, weight)`` gets the layer's GEMM operands in each backward until set to None:
    X (tokens x in_features) in the GEMM's operand dtype, G (tokens x out_features) and the weight the
    forward used."""
    if receive is None:
        _TAP_RECEIVERS.pop(int(tap[0]), None)
    else:
        _TAP_RECEIVERS[int(tap[0])] = receive


@torch.library.custom_op("lightning_snip::first_order_tap", mutates_args=("tap",))
def first_order_tap(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, tap: torch.Tensor) -> None:
    receive = _TAP_RECEIVERS.get(int(tap[0]))
    if receive is not None:
        receive(x, g, weight)


@first_order_tap.register_fake
def _first_order_tap_fake(x, g, weight, tap) -> None:
    return None


_HADAMARD_CHOICES = ((), (Format.MXFP4,), (Format.NVFP4,), (Format.MXFP4, Format.NVFP4))
_RECIPES = {r.key: r for r in (QuantRecipe(fp8_scaling=a, fp8_grad_dtype=b, fp4_grad_rounding=c, wgrad_hadamard=h,
                                           nvfp4_weight_scales_2d=d)
                               for a in Fp8Scaling.resolved() for b in Fp8Dtype for c in Rounding
                               for h in _HADAMARD_CHOICES for d in (False, True))}
# "fwd/bwd|recipe" -> (forward Format, backward Format, QuantRecipe): SNIPLinear._gemm_formats' values.
_GEMM_FORMATS = {f"{f.value}/{b.value}|{key}": (f, b, r) for f in Format for b in Format for key, r in _RECIPES.items()}

_SWITCHABLE_CLASSES: dict[type, type] = {}


def _switchable_class(linear_cls: type) -> type:
    """SNIPLinear, or for a wrapper class composed with nn.Linear (``class FSDPLinear(FSDPModule,
    nn.Linear)``), the same wrapper composed with SNIPLinear."""
    if linear_cls is nn.Linear or issubclass(linear_cls, SNIPLinear):
        return SNIPLinear if linear_cls is nn.Linear else linear_cls
    if is_fsdp_composed(linear_cls):
        if linear_cls not in _SWITCHABLE_CLASSES:
            extra = {k: v for k, v in vars(linear_cls).items() if k == "__deepcopy__"}
            name = linear_cls.__name__.replace("Linear", "") + "SNIPLinear"
            _SWITCHABLE_CLASSES[linear_cls] = type(name, (linear_cls.__bases__[0], SNIPLinear), extra)
        return _SWITCHABLE_CLASSES[linear_cls]
    return SNIPLinear


def is_fsdp_composed(linear_cls: type) -> bool:
    """``class FSDPLinear(FSDPModule, nn.Linear)``: what FSDP2's fully_shard makes of a sharded linear."""
    bases = linear_cls.__bases__
    if len(bases) != 2 or bases[1] is not nn.Linear:
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return issubclass(bases[0], FSDPModule)


def supported_formats(in_features: int, out_features: int) -> frozenset[Format]:
    """Formats whose scale blocks divide both contraction axes that a weight takes part in (k and m).

    The token axis of wgrad is zero-padded instead, since batch shapes vary from step to step.
    """
    return frozenset(
        f for f in Format if f.block_size is None or (in_features % f.block_size == 0 and out_features % f.block_size == 0)
    )
