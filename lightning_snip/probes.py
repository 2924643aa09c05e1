"""WD's forward-mode probe pass (stats.Propagation.PROBE): parameter tangents in, each layer's input tangent out.

One forward-mode pass per probe (or all probes batched in one vmapped pass where the model allows it) over the
statistics slice, with every trainable parameter given the tangent ``tangents_of`` builds and each measured
layer's input tangent handed to ``measure``; no autograd graph is kept, and the tangents exist one module's
parameters at a time. Written here: torch has forward-mode AD and vmap, nothing that runs a model's parameters
as duals module by module.
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from lightning_snip.convert import high_precision

logger = logging.getLogger(__name__)


class ForwardModeUnsupportedError(RuntimeError):
    """The model runs an operation without a forward-mode derivative (a custom autograd.Function
    without ``jvp``, a fused kernel): Propagation.PROBE cannot run on it."""


try:
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack as _clear_functorch
except ImportError:  # another torch: the probes run one pass each
    _clear_functorch = None


_unbatched_models: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def unbatch_probes(model: nn.Module, unbatched: bool = True) -> None:
    """Run ``model``'s WD probes one forward-mode pass per probe (``unbatched``), as a model whose
    batched pass failed does, or batched again (False): the same numbers either way; for timing one
    against the other (benchmarks/stats_cost.py's ``+unbatched``)."""
    if unbatched:
        _unbatched_models.add(model)
    else:
        _unbatched_models.discard(model)


def probe_passes(model, run, tangents_of, probes: int, *, batched: bool) -> tuple[list[dict], set[str]]:
    """Statistics.input_tangents: ``probes`` forward-mode passes of ``run`` (forward_mode_pass).

    Batched: one pass under torch.func.vmap over the probe index, in which each parameter carries the
    probes' tangents stacked (a batched forward gradient): the primal forward and each weight's
    update sensitivity (its recomputed G^T X) are computed once for all probes, not once per probe,
    and the tangents' GEMMs of every layer run batched (the round 0.86-0.89x, benchmarks/results/
    stats_cost_2026-12-02.md; the same numbers in fp32, within bf16 rounding under autocast). torch.func has no forward-mode pass over a module with lazily created tangents, so
    a dummy torch.func.jvp opens the forward-AD level the parameters' duals are made at. A model that
    fails there (an operation with no vmap rule, an in-place write of a batched value) runs one pass
    per probe from then on, with a warning. FSDP2 (``batched`` False): one pass per probe, so every
    rank runs the same collectives."""
    if batched and _clear_functorch is not None and model not in _unbatched_models:
        def one(k):
            def tangent_of(name, param):
                # Outside the transforms (torch's own helper for leaving them; private): the draws
                # and the compiled AdamW kernels see plain tensors, as in an unbatched pass
                # (torch.compile refuses to trace under functorch); only the selection is batched.
                with _clear_functorch():
                    stacked = tangents_of(name, param, range(probes))
                return stacked[k]

            def probe_pass(anchor):
                values, names = run(tangent_of, dual_level=False)
                seen.update(names)
                return anchor, values

            anchor = torch.zeros(())
            return torch.func.jvp(probe_pass, (anchor,), (anchor,))[0][1]

        seen: set[str] = set()
        try:
            with torch.no_grad():
                values = torch.vmap(one, randomness="same")(torch.arange(probes))
        except ForwardModeUnsupportedError:
            raise  # unbatched it fails the same way
        except Exception as err:  # noqa: BLE001 - any vmap failure falls back to the same passes unbatched
            _unbatched_models.add(model)
            logger.warning("statistics: the WD probes could not run batched in one pass (%s: %s); one pass per probe "
                           "for this model (same numbers, slower)", type(err).__name__, (str(err).splitlines() or [""])[0][:200])
        else:
            return [{fqn: v[k] for fqn, v in values.items()} for k in range(probes)], seen
    out, touched = [], set()
    for probe in range(probes):
        values, names = run(lambda name, param, probe=probe: tangents_of(name, param, range(probe, probe + 1))[0])
        out.append(values)
        touched |= names
    return out, touched


def forward_mode_pass(model, loss_fn, layers, owner_names, rng_states, tangent_of, *, measure, recorded_calls,
                       wanted: frozenset[str], dual_level: bool = True) -> tuple[dict[str, torch.Tensor], set[str]]:
    """One probe pass: ``loss_fn`` once under forward-mode AD (no backward, no graph); returns each
    layer's ``measure`` of its input tangent and the names of the parameters that got a tangent or
    whose module ran only after the last measured layer.

    A forward pre-hook on every module that owns trainable parameters swaps them for dual tensors
    (primal: the parameter, tangent: ``tangent_of``) while the module runs, so tangents exist one
    module's parameters at a time. Attention runs in SDPA's math kernel: the fused CPU and CUDA
    kernels have no forward-mode derivative. ``dual_level`` False: inside a forward-AD level the
    caller opened (_probe_passes' batched pass).

    Once every layer of ``wanted`` has been measured, the modules that run after it get no tangents
    and their inputs' tangents are dropped: the rest of the pass (on SmolLM2 the 49152-wide LM head
    and its loss, 4 tangents each) runs as a plain forward, and the measured values are the same bit
    for bit. torch has no way to end a forward early inside torch.func.vmap (its values leave only
    as the function's return), so the pass still runs to the loss."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hooks = _ProbeHooks(owner_names, tangent_of, measure, recorded_calls, wanted)
    owners = list({id(m): m for m in model.modules() if any((id(m), a) in owner_names for a in m._parameters)}.values())
    with contextlib.ExitStack() as stack:
        # A module's pre-hooks in this order, after any of its own (FSDP2's all-gather and input casts: a
        # layer's input as the recording pass saw it): measure a layer's input, drop tangents, swap in duals.
        for fqn, layer in layers.items():
            stack.callback(layer.register_forward_pre_hook(hooks.measure_input(fqn, layer.in_features)).remove)
        if wanted:
            for module in model.modules():
                stack.callback(module.register_forward_pre_hook(hooks.drop_tangents, with_kwargs=True).remove)
        for module in owners:
            stack.callback(module.register_forward_pre_hook(hooks.swap_in).remove)
            # First among the module's post-forward hooks: FSDP2's reshards after it.
            stack.callback(module.register_forward_hook(hooks.restore, prepend=True, always_call=True).remove)
        try:
            with (torch.no_grad(), fwAD.dual_level() if dual_level else contextlib.nullcontext(),
                  sdpa_kernel([SDPBackend.MATH]), high_precision(layers), rng_states.replayed()):
                loss_fn()
        except NotImplementedError as err:
            # torch: "Trying to use forward AD with <op> that does not support it", or for an
            # autograd.Function: "You must implement the jvp function ... with forward mode AD".
            if "forward AD" not in str(err) and "forward mode AD" not in str(err):
                raise
            raise ForwardModeUnsupportedError(
                f"statistics: the model runs an operation without a forward-mode derivative ({str(err).splitlines()[0]}); "
                "WD's probes cannot run on it (exact propagation can)") from err
        finally:
            for module in owners:  # a module whose forward raised
                hooks.restore(module)
    return hooks.values, hooks.touched


class _ProbeHooks:
    """The module hooks of one probe pass (forward_mode_pass) and what they collect: each measured layer's
    value, the parameters touched, the calls per layer."""

    def __init__(self, owner_names, tangent_of, measure, recorded_calls, wanted: frozenset[str]):
        self.owner_names, self.tangent_of, self.measure = owner_names, tangent_of, measure
        self.recorded_calls = recorded_calls
        self.swapped: dict[int, list[tuple[str, nn.Parameter]]] = {}
        self.touched: set[str] = set()
        self.values: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {}
        self.pending = set(wanted)  # wanted layers not measured yet

    def swap_in(self, module, args) -> None:
        saved = self.swapped.setdefault(id(module), [])
        for attr, p in list(module._parameters.items()):
            name = self.owner_names.get((id(module), attr)) if p is not None else None
            if name is None:
                continue
            self.touched.add(name)
            if not self.pending:  # after the last measured layer: its tangent cannot reach a measured input
                continue
            module._parameters[attr] = fwAD.make_dual(p.detach(), self.tangent_of(name, p).to(p.dtype))
            saved.append((attr, p))

    def restore(self, module, *_) -> None:
        for attr, p in reversed(self.swapped.pop(id(module), [])):
            module._parameters[attr] = p

    def measure_input(self, fqn: str, in_features: int):
        """The pre-hook measuring layer ``fqn``'s input tangent: before the layer runs, so the last measured
        layer's own output needs no tangent."""
        def hook(module, args):
            self.calls[fqn] = self.calls.get(fqn, 0) + 1
            if self.calls[fqn] != self.recorded_calls.get(fqn, 1):
                return  # a layer called several times: the recording pass kept its last call's X
            tangent = fwAD.unpack_dual(args[0]).tangent
            if tangent is not None:
                value = self.measure(fqn, tangent.reshape(-1, in_features).float())
                if value is not None:
                    self.values[fqn] = value
            self.pending.discard(fqn)

        return hook

    def drop_tangents(self, module, args, kwargs):
        return None if self.pending else _plain_arguments(args, kwargs)


def _plain(value):
    """``value`` without its forward-mode tangent: a tensor's primal, a tuple's items' (e.g. rotary
    embeddings' (cos, sin)); anything else, a list or dict among them, is the very object (a module that
    writes into a list argument writes where its caller reads), as is a tensor without a tangent."""
    if isinstance(value, torch.Tensor):
        unpacked = fwAD.unpack_dual(value)
        return unpacked.primal if unpacked.tangent is not None else value
    if type(value) is tuple:
        items = tuple(_plain(v) for v in value)
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


def _plain_arguments(args: tuple, kwargs: dict):
    """A forward pre-hook's (args, kwargs) without tangents (_plain), or None where none carried one."""
    new_args, new_kwargs = tuple(_plain(a) for a in args), {k: _plain(v) for k, v in kwargs.items()}
    if all(a is b for a, b in zip(new_args, args)) and all(new_kwargs[k] is v for k, v in kwargs.items()):
        return None
    return new_args, new_kwargs

