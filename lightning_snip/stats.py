"""The statistics step: one high-precision pass over a bounded slice of a batch that records, per
switchable layer, its input X, output gradient G, weight W and the AdamW state of W.

The slice holds at most ``max_rows`` token rows (whole samples, or a prefix of one sample longer than
that), which bounds the recorded tensors. Further passes over the same slice serve divergence.py:
noise-injected passes (the curvature), and for WD's propagated term either forward-mode probes
(Propagation.PROBE: one pass per probe for all layers, no graph kept) or one vector-Jacobian product
per layer on the recording pass's retained graph (Propagation.EXACT).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection  # (Lightning's own batch walk)
from torch import nn

from lightning_snip.adamw import AdamState, read_adam_state
from lightning_snip.formats import Choice
from lightning_snip.gemm import mm_fp32
from lightning_snip.linear import SNIPLinear
from lightning_snip.convert import high_precision
from lightning_snip.probes import forward_mode_pass, probe_passes
from lightning_snip.sharding import is_sharded

logger = logging.getLogger(__name__)

LossFn = Callable[[], torch.Tensor]


class RoundPrecision(Choice):
    """The dtype of a statistics round's GEMM operands (each layer's X, G, W and their quantized forms).

    TRAINING: the dtype the layer's GEMMs ran in during the recording pass (LayerStats.compute_dtype)
        when it is bf16: X, G and W cast to bf16 (SNIPLinear casts the fp32 master weight to the autocast
        dtype before quantizing, so these are the operands the training GEMMs see), quantized in bf16 and
        multiplied with fp32 sums (gemm.mm_fp32: bf16 tensor cores on a GPU, where an fp32 GEMM is
        about 15x slower). fp32 and fp16 layers (an fp16 G without its loss scale underflows) run as FP32.
    FP32: every operand upcast to fp32 and the fp32 master weight quantized (the earlier round, kept as a
        reference to measure against: benchmarks/gpu_check.py).
    Every elementwise sum of the round is fp32 or fp64 in both.
    """

    TRAINING = "training"
    FP32 = "fp32"


@dataclass
class LayerStats:
    """One layer's record: X (rows x k), G (rows x m) of the same rows, W (m x k) (its AdamW state is the
    Statistics' ``param_adam`` under ``weight_name``).

    ``num_samples``: how many independent samples (sequences) the rows come from, in order (rows of
    one sample are contiguous). Divergence estimates use it to measure their own sampling error:
    tokens of one sequence are correlated, sequences are not."""

    fqn: str
    x: torch.Tensor
    g: torch.Tensor
    weight: torch.Tensor
    num_samples: int = 0
    # The weight's name among the model's parameters: not "<fqn>.weight" when it is tied to another
    # module's (an lm_head sharing the embedding), whose name named_parameters() reports instead.
    weight_name: str = ""
    # The dtype the layer's GEMM ran in during the recording pass (its output's: the autocast dtype
    # under *-mixed precision): the statistics round quantizes and multiplies X, G, W in it, as the
    # training GEMMs do (RoundPrecision).
    compute_dtype: torch.dtype = torch.float32
    # The input had a leading sample dimension over token dimensions ((batch, seq, features) and up):
    # rows of one sample are contiguous and samples independent. A 2-D input's rows may be tokens of
    # one sequence (a flattened MLP input): the error probe then gives the layer one sign, not one per row.
    leading_sample_dim: bool = False

    @property
    def num_rows(self) -> int:
        return self.x.shape[0]

    def operand_dtype(self, precision: RoundPrecision) -> torch.dtype:
        """The dtype the round's GEMMs of this layer take their operands in (RoundPrecision)."""
        if RoundPrecision(precision) is RoundPrecision.TRAINING and self.compute_dtype == torch.bfloat16:
            return torch.bfloat16
        return torch.float32


class Propagation(Choice):
    """How WD's propagated term, sum_k ||D_k(J_kl^T E_X)||^2 over the parameters k upstream of layer l
    (the dgrad error's effect on their updates), is computed.

    PROBE: forward-mode random probes. For a random sign vector r over all parameters and
        Lambda_k = dD_k/de at 0 (AdamState.update_sensitivity), one forward pass with parameter
        tangents Lambda * r gives at every layer's input the tangent t_l = J_l(Lambda r), and
        <t_l, E_X(l, p)>^2 is an unbiased estimate of ||Lambda J_l^T E_X(l, p)||^2 (E[r r^T] = I).
        One pass per probe covers every layer and format: the round's cost is linear in depth, and
        tangents exist one module's parameters at a time. Per layer and round the relative standard
        error is at most sqrt(2 / probes) (the estimate's own spread is reported with it). It
        estimates the linearized update deviation: AdamW's D is not linear, and where an error is
        large against the gradient (early steps) the linear map overstates it (measured 1.05-3x).
        Needs forward-mode derivatives of every op (ForwardModeUnsupportedError otherwise), and a
        parameter used outside the module that registers it gets no tangent for that use.
    EXACT: one vector-Jacobian product per layer through every upstream layer, on the recording
        pass's retained graph, with D_k exact (not linearized). Quadratic in depth, and holds the
        graph and every parameter's gradient; for small models and as the reference for PROBE.
    """

    PROBE = "probe"
    EXACT = "exact"


class Statistics:
    """What one statistics pass recorded.

    PROBE keeps no autograd graph; EXACT keeps the recording pass's graph until ``release()``.
    Parameter gradients of the slice: kept for parameters that are not a switchable layer's own
    weight (embeddings, norms, biases, tied weights); a switchable layer's weight gradient is G^T X of
    its recorded rows, recomputed when needed (``param_grad``) instead of held for the whole model.
    """

    def __init__(self, loss: float, layers: dict[str, LayerStats], param_grads: dict[str, torch.Tensor],
                 param_adam: dict[str, AdamState | None], inputs: dict[str, torch.Tensor],
                 params: dict[str, nn.Parameter], rerun: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]],
                 loss_scale: float = 1.0, layer_modules: Mapping[str, SNIPLinear] | None = None, *,
                 propagation: Propagation = Propagation.EXACT, recomputed: Mapping[str, str] | None = None,
                 probe: Callable | None = None, sharded: bool = False):
        self.loss = loss
        self._loss_scale = loss_scale
        self._batched_vjp = True
        self._layers = layer_modules or {}
        self.layers = layers
        self.propagation = propagation
        # FSDP2: weights and optimizer state are DTensors; sums over parameter elements are taken on
        # this rank's shard and summed over ranks (divergence.py).
        self.sharded = sharded
        # Every trainable parameter of the model (by name) and its Adam state. Dgrad errors reach all
        # upstream parameters, not only switchable ones.
        self.param_grads = param_grads
        self.param_adam = param_adam
        self.param_names = list(params)
        self._recomputed = dict(recomputed or {})  # parameter name -> fqn whose G^T X is its gradient
        self._inputs = inputs  # fqn -> X with its graph (EXACT: for the vector-Jacobian products)
        self._params = params
        self._rerun = rerun
        self._probe = probe
        self._operand_cache: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def operands(self, fqn: str, precision: RoundPrecision = RoundPrecision.TRAINING) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``fqn``'s X and G in the dtype of the round's GEMMs (RoundPrecision), cast once and
        kept until ``release()``: every use would otherwise launch its own cast kernels (a round at
        width 1024 on a GPU is bound by kernel launches), and fp32 layers are not copied at all."""
        s = self.layers[fqn]
        dtype = s.operand_dtype(precision)
        key = (fqn, dtype)
        if key not in self._operand_cache:
            self._operand_cache[key] = (s.x.to(dtype), s.g.to(dtype))
        return self._operand_cache[key]

    def parameter(self, name: str) -> nn.Parameter:
        """The registered parameter ``name`` (a DTensor shard under FSDP2)."""
        return self._params[name]

    def param_grad(self, name: str, precision: RoundPrecision = RoundPrecision.TRAINING) -> torch.Tensor | None:
        """The slice's float32 gradient of parameter ``name`` (None: it received none). A weight
        recomputed as its layer's G^T X takes its operands in ``precision`` (RoundPrecision), as the
        wgrad GEMM of training did."""
        if name in self.param_grads:
            return self.param_grads[name]
        fqn = self._recomputed.get(name)
        if fqn is None:
            return None
        x, g = self.operands(fqn, precision)
        return mm_fp32(g.t(), x.t())

    def has_grad(self, name: str) -> bool:
        """Whether ``name`` received a gradient on the slice (without computing it)."""
        return name in self.param_grads or name in self._recomputed

    def is_recomputed(self, name: str) -> bool:
        """Whether ``name``'s gradient is exactly its layer's G^T X (not held, see param_grad)."""
        return name in self._recomputed

    def propagate_input_grad(self, fqn: str, grad_inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """J^T e: the change of every upstream parameter's gradient when the gradient arriving at
        ``fqn``'s input changes by e (Propagation.EXACT only). ``grad_inputs`` stacks several e
        (num x rows x k); one batched vector-Jacobian product returns, per parameter name, the
        stacked changes (num x param shape)."""
        if self.propagation is not Propagation.EXACT:
            raise RuntimeError("statistics: propagate_input_grad needs collect_stats(..., propagation=Propagation.EXACT)")
        x = self._inputs[fqn]
        if not x.requires_grad:
            return {}
        names = list(self._params)
        params = [self._params[n] for n in names]
        scale = self._loss_scale  # fp16: keep the tiny gradient changes out of the subnormal range
        stacked = (grad_inputs.reshape(-1, *x.shape) * scale).to(x.dtype)
        # Layers in the formats of the recording pass: activation checkpointing recomputes its region
        # during this backward and requires the same computation as the forward it replays.
        with high_precision(self._layers):
            return self._vjp(x, names, params, stacked, scale)

    def _vjp(self, x, names, params, stacked, scale) -> dict[str, torch.Tensor]:
        if self._batched_vjp:
            try:
                grads = torch.autograd.grad(x, params, grad_outputs=stacked, retain_graph=True, allow_unused=True,
                                            is_grads_batched=True)
                return {n: g.float() / scale for n, g in zip(names, grads) if g is not None}
            except RuntimeError as err:
                # Activation checkpointing recomputes its region inside the batched (vmap) backward,
                # which it does not support: one product per vector instead, for the rest of the round.
                logger.info("statistics: batched vector-Jacobian product failed (%s); one per format instead",
                            str(err).splitlines()[0])
                self._batched_vjp = False
        per_vector = [torch.autograd.grad(x, params, grad_outputs=e, retain_graph=True, allow_unused=True) for e in stacked]
        return {n: torch.stack([grads[i] for grads in per_vector]).float() / scale
                for i, n in enumerate(names) if per_vector[0][i] is not None}

    def input_tangents(self, tangents_of: Callable[[str, nn.Parameter, range], torch.Tensor],
                       measure: Callable[[str, torch.Tensor], torch.Tensor], probes: int,
                       layers: Iterable[str] | None = None) -> tuple[list[dict[str, torch.Tensor]], set[str]]:
        """``probes`` forward-mode passes over the slice (Propagation.PROBE), batched into one pass
        where the model allows it (_probe_passes). Each trainable parameter's tangents come from
        ``tangents_of(name, param, which)``, stacked, one per probe of the range ``which`` (called when the
        module owning it runs; a parameter used by two modules must get the same tangents);
        ``measure(fqn, t)`` maps one probe's input tangent t = J_l(tangents) of each layer (rows x k,
        float32) to a tensor, and must be a pure function of t (it runs under torch.func.vmap).
        ``layers``: the layers ``measure`` reads (None: every recorded layer); once the last of them
        has been read, the rest of the pass (the LM head, the loss) runs without tangents: nothing it
        computes reaches a measured input. Returns, per probe, each layer's measured value, and the
        names of the parameters that got a tangent or ran only after the last measured layer."""
        if self._probe is None:
            raise RuntimeError("statistics: input_tangents needs collect_stats(..., propagation=Propagation.PROBE)")
        if probes < 1:
            raise ValueError(f"probes: invalid value {probes!r}; allowed: an integer >= 1")
        if isinstance(layers, str):
            raise TypeError(f"layers: expected a collection of layer names, got the string {layers!r}")
        wanted = frozenset(self.layers if layers is None else layers)
        unknown = sorted(wanted - set(self.layers))
        if unknown:
            raise ValueError(f"layers: {unknown[:5]} were not recorded; allowed: the recorded layers ({len(self.layers)})")
        return self._probe(tangents_of, measure, probes, wanted)

    def output_grads_with_noise(self, noise: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Re-run the slice with ``noise[fqn]`` (rows x m) added to each layer's output; return the
        output gradients G' (rows x m) of every layer."""
        return self._rerun(noise)

    @property
    def layer_modules(self) -> Mapping[str, SNIPLinear]:
        """The recorded layers' modules by fqn (the same objects round after round)."""
        return self._layers

    def release(self) -> None:
        self._inputs.clear()
        self._operand_cache.clear()
        self._rerun = None
        self._probe = None
        self._layers = {}


def collect_stats(
    model: nn.Module,
    loss_fn: LossFn,
    *,
    layers: Mapping[str, SNIPLinear],
    optimizer: torch.optim.Optimizer | None = None,
    loss_scale: float = 1.0,
    propagation: Propagation = Propagation.PROBE,
) -> Statistics:
    """Run ``loss_fn`` once with every layer of ``layers`` in high precision and record statistics.

    ``loss_fn`` computes the loss of the (already sliced) statistics batch. Formats are restored and
    hooks removed on return and on error. ``loss_scale`` multiplies the loss before every backward
    and is divided out of every recorded gradient (float32): under fp16 autocast, gradients of an
    unscaled mean loss fall into fp16's subnormal range (AMP's GradScaler exists for this reason).
    ``propagation``: see Propagation (EXACT keeps the graph: call ``release()`` after use).
    """
    propagation = Propagation(propagation)
    # FSDP2 leaves its root module unsharded after a forward without backward (a validation loop):
    # shard everything first, so every parameter below is the registered DTensor.
    _reshard(model)
    p = _ParameterMaps.of(model)
    sharded = any(is_sharded(t) for t in p.params.values())
    if sharded and propagation is Propagation.EXACT:
        raise ValueError("propagation: exact is not supported with sharded (FSDP2) parameters; allowed: probe")
    # Each layer's weight by its registered name: a DTensor under FSDP2 (all-gathered where needed,
    # sharding.dense), the Parameter otherwise.
    weight_names = {fqn: p.owner_names.get((id(layer), "weight"), fqn + ".weight") for fqn, layer in layers.items()}
    passes = _Passes(model, loss_fn, layers, p, weight_names, _RandomStreams.capture(model), propagation, loss_scale)
    loss, inputs, out_grads, param_grads, recomputed, recorded_calls = passes.run(None, record=True)

    def probe(tangents_of, measure, probes, wanted):
        try:
            run = functools.partial(forward_mode_pass, model, loss_fn, layers, p.trainable_owners, passes.rng_states,
                                    recorded_calls=recorded_calls, measure=measure, wanted=wanted)
            return probe_passes(model, run, tangents_of, probes, batched=not sharded)
        finally:
            _reshard(model)  # the probe pass has no backward: FSDP2 keeps its root unsharded after it

    recorded = {
        fqn: LayerStats(
            fqn=fqn,
            x=inputs[fqn].detach().reshape(-1, layers[fqn].in_features),
            g=out_grads[fqn],
            weight=p.all_params.get(weight_names[fqn], layers[fqn].weight).detach(),
            # (batch, ..., features) inputs: the leading dimension indexes samples; 2-D: each row is one.
            num_samples=int(inputs[fqn].shape[0]),
            leading_sample_dim=inputs[fqn].dim() >= 3,
            weight_name=weight_names[fqn],
            compute_dtype=passes.compute_dtypes.get(fqn, torch.float32),
        )
        for fqn in layers
    }
    exact = propagation is Propagation.EXACT
    return Statistics(
        loss=float(loss.detach()),
        layers=recorded,
        param_grads=param_grads,
        param_adam={n: read_adam_state(optimizer, t) for n, t in p.params.items()},
        inputs=inputs if exact else {},
        params=p.params,
        rerun=lambda noise: passes.run(noise, record=False)[2],
        loss_scale=loss_scale,
        layer_modules=layers,
        propagation=propagation,
        recomputed=recomputed,
        probe=None if exact else probe,
        sharded=sharded,
    )


@dataclass(frozen=True)
class _ParameterMaps:
    """A model's parameters, by name and by where they sit."""

    all_params: dict[str, nn.Parameter]
    params: dict[str, nn.Parameter]  # the trainable ones
    registrations: dict[int, int]  # id -> how many modules register the parameter (tied: > 1)
    # (module, attribute) -> parameter name, read now, between forward passes. FSDP2 puts other
    # tensors (the all-gathered parameters) at those attributes while a module runs, so the passes
    # find parameters by where they sit, not by identity.
    owner_names: dict[tuple[int, str], str]
    trainable_owners: dict[tuple[int, str], str]

    @classmethod
    def of(cls, model: nn.Module) -> "_ParameterMaps":
        all_params = dict(model.named_parameters())
        params = {name: p for name, p in all_params.items() if p.requires_grad}
        name_of = {id(p): name for name, p in all_params.items()}  # parameter identity, not module path
        registrations: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            registrations[id(p)] = registrations.get(id(p), 0) + 1
        owner_names = {(id(m), attr): name_of[id(p)] for m in model.modules() for attr, p in m._parameters.items()
                       if p is not None and id(p) in name_of}
        trainable_owners = {key: name for key, name in owner_names.items() if name in params}
        return cls(all_params, params, registrations, owner_names, trainable_owners)


class _Passes:
    """The recording pass and the noise re-runs of one statistics round (collect_stats)."""

    def __init__(self, model, loss_fn, layers, maps: _ParameterMaps, weight_names, rng_states, propagation, loss_scale):
        self.model, self.loss_fn, self.layers, self.maps = model, loss_fn, layers, maps
        self.weight_names, self.rng_states = weight_names, rng_states
        self.propagation, self.loss_scale = propagation, loss_scale
        self.compute_dtypes: dict[str, torch.dtype] = {}

    def run(self, noise: Mapping[str, torch.Tensor] | None, record: bool):
        """One pass: (loss, layer inputs, output gradients, parameter gradients, the weights whose
        gradient is recomputed from G^T X instead of held, calls per layer)."""
        layers, params, loss_scale = self.layers, self.maps.params, self.loss_scale
        inputs: dict[str, torch.Tensor] = {}
        outputs: dict[str, torch.Tensor] = {}
        calls: dict[str, int] = {}
        used: dict[str, torch.Tensor] = {}  # name -> the tensor the forward computed with
        backward: list[bool] = []  # non-empty once the forward has returned
        # Every run (the recording one and each noise re-run) draws the same random numbers (dropout
        # masks), and the training run's streams are left where they were.
        with high_precision(layers), self.rng_states.replayed(), contextlib.ExitStack() as stack:
            for fqn, layer in layers.items():
                stack.callback(layer.register_forward_hook(self._output_hook(fqn, noise, record, inputs, outputs,
                                                                             calls, backward)).remove)
            if record:
                owners = self.maps.trainable_owners
                for module in {id(m): m for m in self.model.modules() if any(
                        (id(m), attr) in owners for attr in m._parameters)}.values():
                    stack.callback(module.register_forward_pre_hook(self._capture_hook(used)).remove)
            with torch.enable_grad():
                loss = self.loss_fn()
            backward.append(True)  # from here on a layer's forward is activation checkpointing's recompute
            missing = [f for f in layers if f not in outputs]
            if missing:
                raise RuntimeError(f"statistics: layers {missing[:5]} were not called by the loss function")
            no_grad = [f for f in layers if not outputs[f].requires_grad]
            if no_grad:  # (autograd's own words: "One of the differentiated Tensors does not require grad")
                raise RuntimeError(
                    f"statistics: the outputs of layers {no_grad[:5]} carry no gradient in the recording pass: the "
                    "forward ran under torch.no_grad, inside reentrant activation checkpointing (use "
                    "use_reentrant=False), or with the layer's weight and input both without gradient")
            # A weight's gradient is its layer's G^T X when the layer owns it alone and ran once;
            # otherwise (tied, shared, called twice) it is taken from autograd and held.
            names_w = self.weight_names
            recomputed = {} if not record or self.propagation is Propagation.EXACT else {
                names_w[fqn]: fqn for fqn in layers
                if names_w[fqn] in params and self.maps.registrations.get(id(params[names_w[fqn]])) == 1
                and calls[fqn] == 1}
            names = list(outputs)
            param_names = [n for n in params if n not in recomputed] if record else []
            grads = torch.autograd.grad(
                loss * loss_scale, [outputs[f] for f in names] + [used.get(n, params[n]) for n in param_names],
                retain_graph=record and self.propagation is Propagation.EXACT, allow_unused=True,
            )
        # (x / 1 is x, bit for bit: without a loss scale no copy of every gradient is made)
        unscale = (lambda g: g.float()) if loss_scale == 1.0 else (lambda g: g.float() / loss_scale)
        out_grads = {f: unscale(g.detach().reshape(-1, g.shape[-1])) for f, g in zip(names, grads[: len(names)])}
        param_grads = {n: unscale(g.detach()) for n, g in zip(param_names, grads[len(names):]) if g is not None}
        return loss, inputs, out_grads, param_grads, recomputed, calls

    def _capture_hook(self, used: dict):
        owners = self.maps.trainable_owners

        def capture(module, args):
            for attr, p in module._parameters.items():
                name = owners.get((id(module), attr))
                if name is not None and p is not None:
                    used.setdefault(name, p)

        return capture

    def _output_hook(self, fqn: str, noise, record: bool, inputs: dict, outputs: dict, calls: dict, backward: list):
        def hook(module, args, output):
            if noise is not None and fqn in noise:
                output = output + noise[fqn].reshape(output.shape).to(output.dtype)
            if backward:
                # Activation checkpointing's recompute during the backward: the same noise (its graph is
                # the forward's), but no second call counted (the probe pass, which has no backward, would
                # wait for it and never measure the layer: WD's propagated term was 0) and no X replaced.
                return output
            inputs[fqn] = args[0]
            calls[fqn] = calls.get(fqn, 0) + 1
            if record:
                self.compute_dtypes[fqn] = output.dtype
            outputs[fqn] = output
            return output

        return hook


def _reshard(model: nn.Module) -> None:
    """Reshard every FSDP2 module of ``model`` (nothing without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# Models whose probes failed to run batched (an operation without a vmap rule): one pass per probe.


@dataclass(frozen=True)
class _RandomStreams:
    """The global CPU and CUDA random states at one point, to replay from there."""

    cpu: torch.Tensor
    cuda_devices: tuple[int, ...]
    cuda: tuple[torch.Tensor, ...]

    @classmethod
    def capture(cls, model: nn.Module) -> "_RandomStreams":
        devices = tuple(sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"}))
        return cls(cpu=torch.get_rng_state(), cuda_devices=devices,
                   cuda=tuple(torch.cuda.get_rng_state(d) for d in devices))

    @contextlib.contextmanager
    def replayed(self):
        with torch.random.fork_rng(devices=list(self.cuda_devices)):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.cuda_devices, self.cuda):
                torch.cuda.set_rng_state(state, device)
            yield


def slice_batch(batch, max_rows: int, *, tokens_per_sample: int | None = None):
    """The first samples of ``batch`` (a tensor, or any collection of them Lightning moves to a device: a
    tuple, list, namedtuple, mapping such as Hugging Face's BatchEncoding, or a dataclass) holding at most
    ``max_rows`` token rows, in the batch's own type. ``tokens_per_sample`` defaults to the product of the
    first tensor's non-batch dimensions except a trailing feature dimension for float tensors.

    A sample longer than ``max_rows`` (a 4096-token sequence at max_rows 1024) is cut to its first
    ``max_rows`` tokens: every tensor whose dimension 1 has the sequence's length is sliced along it
    (a causal LM's prefix is a valid shorter sample). Samples with several token dimensions (an
    image's rows and columns) are kept whole: at least one sample."""
    tensors: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, tensors.append)  # (the batch's tensors in its own order)
    if not tensors:
        raise ValueError(f"statistics: the batch ({type(batch).__name__}) holds no tensor to slice; allowed: a "
                         "tensor or a tuple, list, namedtuple, mapping or dataclass of tensors")
    first = tensors[0]
    token_dims = first.shape[1:] if not first.is_floating_point() else first.shape[1:-1]
    if tokens_per_sample is None:
        tokens_per_sample = max(1, int(torch.Size(token_dims).numel()))
    num = max(1, min(first.shape[0], max_rows // tokens_per_sample))
    if tokens_per_sample > max_rows and len(token_dims) == 1:
        length = token_dims[0]
        return _map_tensors(batch, lambda t: t[:1, :max_rows] if t.dim() >= 2 and t.shape[1] == length else t[:1])
    return _map_tensors(batch, lambda t: t[:num])


def _map_tensors(batch, fn):
    try:
        return apply_to_collection(batch, torch.Tensor, fn)
    except ValueError as err:  # (apply_to_collection cannot rebuild a frozen dataclass)
        raise ValueError(f"statistics: cannot slice the batch ({type(batch).__name__}): {err}") from err
