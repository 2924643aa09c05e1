"""Swap nn.Linear modules for SNIPLinear in place, and apply a plan (fqn -> Format) to them."""

from __future__ import annotations

import contextlib
import fnmatch
import logging
from collections.abc import Callable, Collection, Mapping, Sequence

from torch import nn

from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.hadamard import sign_tensor
from lightning_snip.linear import SNIPLinear, is_fsdp_composed
from lightning_snip.plan import BACKWARD, FORWARD, Granularity, gemm_key, split_key
from lightning_snip.sharding import is_sharded

logger = logging.getLogger(__name__)

LinearFilter = Callable[[str, nn.Linear], bool]


def glob_filter(include: Sequence[str] = ("*",), exclude: Sequence[str] = ()) -> LinearFilter:
    """A filter keeping layers whose fqn matches an ``include`` glob and no ``exclude`` glob."""

    def keep(fqn: str, _module: nn.Linear) -> bool:
        return any(fnmatch.fnmatchcase(fqn, p) for p in include) and not any(
            fnmatch.fnmatchcase(fqn, p) for p in exclude
        )

    return keep


class UnmatchedPinsError(ValueError):
    """A pin glob matches no converted layer; ``patterns`` holds them (the caller names its own field)."""

    def __init__(self, patterns: Sequence[str], message: str) -> None:
        super().__init__(message)
        self.patterns = tuple(patterns)


def _check_pins_match(pin_formats: Mapping[str, Format], optional_pins: Collection[str], names: Sequence[str]) -> None:
    unused = [p for p in pin_formats if p not in optional_pins and not any(fnmatch.fnmatchcase(fqn, p) for fqn in names)]
    if unused:
        shown = names if len(names) <= 4 else [*names[:3], "...", names[-1]]
        raise UnmatchedPinsError(unused, f"pins: pattern(s) {unused} match no converted layer; the converted layers "
                                         f"are {', '.join(shown)} ({len(names)} in all)")


def matching_pins(fqn: str, pin_formats: Mapping[str, Format]) -> list[tuple[str, Format]]:
    """The pins (glob, format) that match ``fqn``, in order: the last one's format is the layer's."""
    return [(glob, fmt) for glob, fmt in pin_formats.items() if fnmatch.fnmatchcase(fqn, glob)]


def _pin_of(fqn: str, pin_formats: Mapping[str, Format], head_format: Format | None, overlaps: list[str]) -> Format | None:
    """The format the pins fix ``fqn`` to: the last matching pin's (extra_pins come after pins; one that names the
    output head wins over the automatic one, ``head_format``); a layer pins of different formats match is noted in
    ``overlaps``."""
    matched = matching_pins(fqn, pin_formats)
    if len({f for _, f in matched}) > 1:
        overlaps.append(f"{fqn}: {', '.join(f'{p}={f.value}' for p, f in matched)} -> {matched[-1][1].value}")
    return matched[-1][1] if matched else head_format


def convert_linears(
    model: nn.Module,
    *,
    filter: LinearFilter | None = None,
    pins: Mapping[str, Format | str] | None = None,
    optional_pins: Collection[str] = (),
    output_head_format: Format | str | None = None,
    initial_format: Format | str = Format.BF16,
    recipe: QuantRecipe = QuantRecipe(),
) -> dict[str, SNIPLinear]:
    """Replace every selected ``nn.Linear`` in ``model`` by a SNIPLinear sharing its Parameters.

    Args:
        model: converted in place.
        filter: ``(fqn, module) -> bool``; None selects every nn.Linear.
        pins: fqn glob -> format; a matching layer is fixed to that format (``layer.pinned``) and no
            plan may change it; a layer several globs match takes the last one's (a warning says so where their
            formats differ). Every pin must match a selected layer, but those in ``optional_pins``
            (SNIPConfig's default pin of the LM head, on a model that has none).
        output_head_format: where given, the model's output head (find_output_head), when selected and
            matched by no pin, is pinned to it (SNIPConfig's default pins: bf16).
        initial_format: the format of unpinned layers until the first plan. Where a layer's shape
            does not support it (block formats need dimensions divisible by the block), the layer
            stays in bf16 and a warning names it.
        recipe: rounding and scaling choices shared by all layers.

    Returns:
        fqn -> SNIPLinear, in module order. Already converted layers are returned too.

    Raises:
        ValueError: the filter selects no layer, a pin matches none, or a pinned format does not
            fit the layer's shape.
    """
    initial = Format.parse(initial_format, field_name="initial_format")
    pin_formats = {pattern: Format.parse(f, field_name=f"pins[{pattern}]") for pattern, f in (pins or {}).items()}
    head_format = None if output_head_format is None else Format.parse(output_head_format, field_name="output_head_format")
    head = find_output_head(model) if head_format is not None else None
    paths = {}  # fqn -> the module's path in the (possibly wrapped) model, for the swap
    targets = []
    for path, m in model.named_modules():
        fqn = layer_fqn(path)
        if isinstance(m, nn.Linear) and fqn and (filter is None or filter(fqn, m)):
            paths[fqn] = path
            targets.append((fqn, m))
    if not targets:
        raise ValueError("filter: selects no nn.Linear layer of the model; check the include/exclude patterns")
    _check_pins_match(pin_formats, optional_pins, [fqn for fqn, _ in targets])

    converted: dict[str, SNIPLinear] = {}
    overlaps: list[str] = []  # layers matched by pins of different formats
    for fqn, linear in targets:
        if isinstance(linear, SNIPLinear):
            layer = linear
        elif _held_by_identity(linear):
            layer = SNIPLinear.convert_in_place(linear, recipe=recipe)
        else:
            layer = SNIPLinear.from_linear(linear, recipe=recipe)
        pinned = _pin_of(fqn, pin_formats, head_format if fqn == head else None, overlaps)
        if pinned is not None and pinned not in layer.allowed_formats:
            raise ValueError(f"pins: layer {fqn} ({layer.in_features}->{layer.out_features}) cannot run in {pinned.value}")
        layer.pinned, layer.rht_signs = pinned, sign_tensor(fqn)  # (the wgrad's RHT signs: the same on every rank)
        start = pinned or initial
        if start not in layer.allowed_formats:
            logger.warning(
                "layer %s (%d->%d): dimensions not divisible by the %s block size %s; it stays in bf16 and "
                "plans will only give it %s",
                fqn, layer.in_features, layer.out_features, start.value, start.block_size,
                sorted(f.value for f in layer.allowed_formats),
            )
            start = Format.BF16
        layer.format = start
        if layer is not linear:
            parent_name, _, child = paths[fqn].rpartition(".")
            setattr(model.get_submodule(parent_name), child, layer)
        converted[fqn] = layer
    if overlaps:
        logger.warning("SNIP: %d layer(s) match pins of different formats; the last matching pin wins (extra_pins come "
                       "after pins): %s", len(overlaps), "; ".join(overlaps[:3]) + ("; ..." if len(overlaps) > 3 else ""))
    return converted


def find_output_head(model: nn.Module) -> str | None:
    """The fqn of the nn.Linear whose output feeds the loss (an LM head by any name), or None.

    Found by what it is, the first rule that names a Linear of ``model`` winning:

    1. the output embedding the model declares (a Hugging Face model's ``get_output_embeddings()``);
    2. a Linear whose weight is an nn.Embedding's (a tied head);
    3. a Linear whose ``out_features`` is the vocabulary: the size the model declares (``config.vocab_size``,
       ``get_input_embeddings().num_embeddings``) or, where it declares none, an nn.Embedding's
       ``num_embeddings`` (GPT-NeoX checkpoints' ``embed_out``, a Llama-style ``output``); of several, the
       last registered (a head comes after the blocks in the usual layouts).

    Not by position alone: the forward order is unknown until a forward pass, and registration order is not
    it (a model may register its head first, or a pooler or value head after it); a Linear picked by
    position would silently leave the plan. A model with none of the above (a classifier whose ``score``
    has ``num_labels`` outputs) has no head found: SNIPController's setup then warns, naming the largest
    Linear. A vocabulary size that an inner layer happens to share is the rule's known blind spot.
    """
    linears = {layer_fqn(path): m for path, m in model.named_modules() if isinstance(m, nn.Linear) and path}
    fqn_of = {id(m): fqn for fqn, m in linears.items()}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    declared_sizes = set()
    for module in model.modules():
        declared = _declared_embedding(module, "get_output_embeddings")
        if declared is not None and id(declared) in fqn_of:
            return fqn_of[id(declared)]
        vocab_size = getattr(getattr(module, "config", None), "vocab_size", None)
        if isinstance(vocab_size, int) and not isinstance(vocab_size, bool):
            declared_sizes.add(vocab_size)
        declared = _declared_embedding(module, "get_input_embeddings")
        if isinstance(declared, nn.Embedding):
            declared_sizes.add(declared.num_embeddings)
    tables = {id(e.weight) for e in embeddings}
    tied = [fqn for fqn, m in linears.items() if id(m.weight) in tables]
    if tied:
        return tied[-1]
    sizes = declared_sizes or {e.num_embeddings for e in embeddings}
    vocabulary = [fqn for fqn, m in linears.items() if m.out_features in sizes]
    return vocabulary[-1] if vocabulary else None


def log_output_head(layers: Mapping[str, SNIPLinear], pins: Collection[str], head_format: Format | None, *,
                    layers_chosen: bool = False, head: str | None = None,
                    head_globs: Collection[str] = ()) -> None:
    """The setup lines about the output head (``head``: find_output_head's answer, None where it found none).
    Under the default pins (``head_format`` given; SNIPConfig.output_head_format): the head convert_linears pinned
    by what it is (a layer pinned to ``head_format`` that no glob of ``pins`` names), or, where no head was found
    or pinned by one of ``head_globs`` (the default pins') and no pin holds a layer in ``head_format`` (an unrelated
    pin to another format does not count), one warning naming the largest Linear and the pin that keeps it in bf16;
    none where include/exclude chose the layers (``layers_chosen``): a head left unconverted runs in the model's own
    precision. Under pins a user wrote (``head_format`` None, ``pins=[]`` included): a warning where the found head
    is converted and left switchable."""
    if head_format is None:  # the user's pins are exactly theirs; a head they leave switchable is said
        if head is not None and head in layers and layers[head].pinned is None:
            logger.warning("SNIP: the pins you wrote leave the output head %s (%d->%d, found by what it is) "
                           "switchable: a plan may put it in FP4; to keep it in bf16 add '%s=bf16' to pins, or use "
                           "extra_pins, which keeps the default pins", head, layers[head].in_features,
                           layers[head].out_features, head)
        return
    for fqn, layer in layers.items():
        if layer.pinned is head_format and not any(fnmatch.fnmatchcase(fqn, p) for p in pins):
            logger.info("SNIP: pinned the output head %s (%d->%d, out_features = vocabulary) in %s", fqn,
                        layer.in_features, layer.out_features, head_format.value)
    if layers_chosen or not layers or (head is not None and head in layers):
        return
    largest = max(layers, key=lambda fqn: layers[fqn].in_features * layers[fqn].out_features)
    # silent where the default pins' globs pinned a layer, or a pin holds one in head_format (the advice below, or
    # the user's own head pin); an extra pin to another format does not silence it
    if any(layer.pinned is head_format or (layer.pinned is not None and any(fnmatch.fnmatchcase(fqn, g)
                                                                           for g in head_globs))
           for fqn, layer in layers.items()):
        return
    logger.warning("SNIP: the default pins match no layer (no *lm_head, no Linear whose out_features is the "
                   "vocabulary), so an output head joins the plan; the largest Linear by FLOPs is %s (%d->%d): to "
                   "keep it in bf16, extra_pins=['%s=bf16'] (the app: 'snip.extra_pins=[\"%s=bf16\"]')", largest,
                   layers[largest].in_features, layers[largest].out_features, largest, largest)


def _declared_embedding(module: nn.Module, getter: str) -> nn.Module | None:
    """What a Hugging Face-style ``get_output_embeddings`` / ``get_input_embeddings`` returns, or None where
    the module has none: transformers' PreTrainedModel.get_input_embeddings (modeling_utils.py) raises
    NotImplementedError for a model whose embedding it cannot find, and a user's module may lack the attribute
    the getter reads; both mean "no declared embedding", not an error of the run."""
    method = getattr(module, getter, None)
    if not callable(method):
        return None
    try:
        found = method()
    except (NotImplementedError, AttributeError):
        return None
    return found if isinstance(found, nn.Module) else None


def _held_by_identity(linear: nn.Linear) -> bool:
    """FSDP2-managed (DTensor parameters, or a class fully_shard composed): converted in place."""
    return is_fsdp_composed(type(linear)) or any(is_sharded(p) for p in linear.parameters(recurse=False))


def switchable_layers(model: nn.Module) -> dict[str, SNIPLinear]:
    """fqn -> SNIPLinear for every converted layer of ``model``."""
    return {layer_fqn(path): m for path, m in model.named_modules() if isinstance(m, SNIPLinear)}


# Path components that wrappers insert between a model and its own modules: torch.compile's
# OptimizedModule, activation checkpointing, FSDP1. They are not part of the user's layer names, so a
# plan (and every logged metric) names the same layer whether the model is wrapped or not.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def layer_fqn(path: str) -> str:
    """A module's name in the unwrapped model: ``path`` without wrapper components."""
    return ".".join(part for part in path.split(".") if part not in _WRAPPER_PARTS)


def apply_plan(model: nn.Module, plan: Mapping[str, Format | str]) -> None:
    """Set each listed layer's format. Validates the whole plan before changing anything.

    Keys are layer fqns, or per-GEMM keys ``<fqn>:forward`` / ``<fqn>:backward``
    (lightning_snip.plan.gemm_key): the forward GEMM's format and the backward GEMMs' (dgrad and wgrad).
    A layer key sets all three GEMMs.

    Raises:
        ValueError: a key is not a SNIPLinear of the model, a format is unknown or not allowed for
            that layer, the plan changes a pinned layer, or gives a layer only one direction.
    """
    layers = switchable_layers(model)
    resolved: dict[str, dict[str | None, Format]] = {}
    for key, value in plan.items():
        fqn, direction = split_key(key)
        if fqn not in layers:
            raise ValueError(f"plan: {key!r} is not a converted layer of the model")
        fmt = Format.parse(value, field_name=f"plan[{key}]")
        layer = layers[fqn]
        if layer.pinned is not None and fmt is not layer.pinned:
            raise ValueError(f"plan[{key}]: layer is pinned to {layer.pinned.value}, the plan says {fmt.value}")
        if fmt not in layer.allowed_formats:
            raise ValueError(f"plan[{key}]: {fmt.value} not allowed; allowed: {sorted(f.value for f in layer.allowed_formats)}")
        resolved.setdefault(fqn, {})[direction] = fmt
    for fqn, formats in resolved.items():
        if set(formats) not in ({None}, {FORWARD, BACKWARD}):
            raise ValueError(f"plan: layer {fqn!r} needs one format, or both a forward and a backward one; "
                             f"got {sorted(str(d) for d in formats)}")
    for fqn, formats in resolved.items():
        forward = formats.get(None, formats.get(FORWARD))
        backward = formats.get(None, formats.get(BACKWARD))
        layers[fqn].format = forward
        layers[fqn].backward_format = None if backward is forward else backward


def layer_assignment(layers: Mapping[str, SNIPLinear], granularity: Granularity) -> dict[str, Format]:
    """The formats in force, keyed as a plan of ``granularity`` keys them."""
    if granularity is Granularity.LAYER:
        return {fqn: layer.format for fqn, layer in layers.items()}
    out = {}
    for fqn, layer in layers.items():
        out[gemm_key(fqn, FORWARD)] = layer.format
        out[gemm_key(fqn, BACKWARD)] = layer.backward_format or layer.format
    return out


@contextlib.contextmanager
def high_precision(layers: Mapping[str, SNIPLinear]):
    """Run ``layers`` in bf16 (the run's own precision) inside the block; restore formats after. Their
    first-order taps are off in the block: torch's own linear runs (the round's batched and forward-mode
    derivatives go through it, not through the tap's operator)."""
    saved = {fqn: (layer.format, layer.backward_format, layer.first_order_tap) for fqn, layer in layers.items()}
    try:
        for layer in layers.values():
            layer.format, layer.backward_format, layer.first_order_tap = Format.BF16, None, None
        yield
    finally:
        for fqn, layer in layers.items():
            layer.format, layer.backward_format, layer.first_order_tap = saved[fqn]
