"""Fixed-rule baseline policies: what SNIP's measured plans are compared with.

Each fills FP4 in a fixed order until the FP4 fraction is met (ordered_plan), except the uniform
and backward-only plans. ``BASELINES`` maps each policy's name to a function of the planner's
candidates and a PolicyContext: the benchmarks look policies up there. Pure Python, like the planner.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lightning_snip.formats import Format
from lightning_snip.plan import BACKWARD, FORWARD, Granularity, Plan, gemm_key, split_key
from lightning_snip.planner import LayerCandidates, fp4_target, gemm_items, split_directions

DEFAULT_LAYER_TYPE_ORDER = ("up", "gate", "down", "o", "v", "q", "k")
"""Layer types from the most to the least FP4-tolerant by a common rule of thumb (MLP first)."""


def layer_type(fqn: str) -> str:
    """A layer's type for the type rules: the fqn's last component without a ``_proj`` suffix, so that
    Hugging Face's names (``mlp.up_proj``, ``self_attn.q_proj``) rank as the demo's (``mlp.up``, ``attn.q``)."""
    name = fqn.rsplit(".", 1)[-1]
    return name[: -len("_proj")] if name.endswith("_proj") else name


def uniform_plan(layers: Sequence[LayerCandidates], fmt: Format | str) -> Plan:
    """Every unpinned layer in ``fmt``; pinned layers keep their pin.

    Raises:
        ValueError: ``fmt`` is not a candidate format of some unpinned layer.
    """
    fmt = Format.parse(fmt)
    missing = [layer.fqn for layer in layers if layer.pinned is None and fmt not in layer.loss_divergence]
    if missing:
        raise ValueError(f"fmt: {fmt.value} is not a candidate format of layer(s) {missing[:5]}")
    formats = {layer.fqn: layer.pinned or fmt for layer in layers}
    return _plan(layers, formats, f"uniform_{fmt.value}")


def ordered_plan(
    layers: Sequence[LayerCandidates],
    order: Sequence[str],
    *,
    fp4_fraction: float,
    policy: str,
    low: Format | str = Format.MXFP4,
    high: Format | str = Format.FP8,
) -> Plan:
    """Put layers in ``low`` in the given fqn order until ``fp4_fraction`` of FLOPs is FP4; the rest
    ``high``. Then trim the overshoot: walking the FP4 layers back from the last one added, return a
    layer to ``high`` wherever the target still holds without it, so every policy runs as close to
    the same fraction as layer sizes allow."""
    low, high = _low_high(low, high)
    target = fp4_target(layers, fp4_fraction)
    by_fqn = {layer.fqn: layer for layer in layers}
    total = sum(layer.flops for layer in layers)
    needed = target.fp4_fraction * total - 1e-9 * total
    formats = {layer.fqn: layer.pinned or _pick(layer, high, fp4=False) for layer in layers}
    fp4 = sum(layer.flops for layer in layers if formats[layer.fqn].is_fp4)
    added: list[str] = []
    for fqn in order:
        if total == 0 or fp4 >= needed:
            break
        layer = by_fqn[fqn]
        low_choice = _pick(layer, low, fp4=True)
        if layer.pinned is None and low_choice is not None:
            formats[fqn] = low_choice
            fp4 += layer.flops
            added.append(fqn)
    for fqn in reversed(added[:-1]):  # the last one added is what reached the target
        if fp4 - by_fqn[fqn].flops >= needed:
            formats[fqn] = _pick(by_fqn[fqn], high, fp4=False)
            fp4 -= by_fqn[fqn].flops
    return _plan(layers, formats, policy)


def _low_high(low: Format | str, high: Format | str) -> tuple[Format, Format]:
    """The baselines' two formats, parsed (a name such as "nvfp4" is a Format; an unknown one is an
    error naming the field, never a silent fallback to another candidate) and checked."""
    low, high = Format.parse(low, field_name="low"), Format.parse(high, field_name="high")
    if not low.is_fp4 or high.is_fp4:
        raise ValueError(f"low / high: need an FP4 format and a non-FP4 one, got {low.value} / {high.value}")
    return low, high


def _pick(layer: LayerCandidates, preferred: Format, *, fp4: bool) -> Format | None:
    """``preferred`` if it is a candidate of the layer, else its first candidate of the same kind."""
    candidates = [f for f in layer.loss_divergence if layer.loss_divergence[f] < math.inf]
    if preferred in candidates:
        return preferred
    same_kind = [f for f in candidates if f.is_fp4 == fp4]
    return same_kind[0] if same_kind else (None if fp4 else candidates[0])


def _items(layers: Sequence[LayerCandidates], granularity: Granularity | str) -> list[LayerCandidates]:
    """The layers themselves, or their forward and backward items at granularity gemm."""
    return gemm_items(layers) if Granularity(granularity) is Granularity.GEMM else list(layers)


def _policy(name: str, granularity: Granularity | str) -> str:
    return f"{name}_gemm" if Granularity(granularity) is Granularity.GEMM else name


def random_plan(layers: Sequence[LayerCandidates], *, fp4_fraction: float, seed: int,
                granularity: Granularity | str = Granularity.LAYER, **kw) -> Plan:
    """FP4 for layers (granularity gemm: GEMM directions) in a random order up to the fraction."""
    items = _items(layers, granularity)
    order = [item.fqn for item in items]
    random.Random(seed).shuffle(order)
    return ordered_plan(items, order, fp4_fraction=fp4_fraction, policy=_policy("random", granularity), **kw)


def min_rel_err_plan(layers: Sequence[LayerCandidates], relative_error: Mapping[str, float], *, fp4_fraction: float, **kw) -> Plan:
    """FP4 first for the layers with the smallest relative local quantization error."""
    order = sorted((layer.fqn for layer in layers), key=lambda f: relative_error[f])
    return ordered_plan(layers, order, fp4_fraction=fp4_fraction, policy="min_rel_err", **kw)


def layer_type_plan(
    layers: Sequence[LayerCandidates], *, fp4_fraction: float, type_order: Sequence[str] = DEFAULT_LAYER_TYPE_ORDER,
    granularity: Granularity | str = Granularity.LAYER, edges_last: bool = False, **kw
) -> Plan:
    """FP4 first for layer types early in ``type_order`` (the fqn's last component); unknown types last.
    Granularity gemm: every backward GEMM (in type order) before any forward GEMM (in type order),
    the fixed rule behind "FP4 backward barely hurts" (issue 12). Within a type, layers in model
    order. ``edges_last`` adds first_last's rule (policy "layer_type_edges"): in each direction the
    first and last blocks' layers come after every other block's, and within a type the blocks fill
    from the middle outwards."""
    rank = {t: i for i, t in enumerate(type_order)}
    edge = _distance_to_edge(layers) if edges_last else {}

    def key(item_fqn: str):
        fqn, direction = split_key(item_fqn)
        distance = edge.get(fqn, 1.0)
        return (direction == FORWARD, distance <= 0, rank.get(layer_type(fqn), len(rank)), -distance)

    items = _items(layers, granularity)
    order = sorted((item.fqn for item in items), key=key)
    name = "layer_type_edges" if edges_last else "layer_type"
    return ordered_plan(items, order, fp4_fraction=fp4_fraction, policy=_policy(name, granularity), **kw)


def block_index(fqn: str) -> int | None:
    """The first integer component of an fqn ("layers.3.attn.q" -> 3), or None."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", fqn)
    return int(match.group(1)) if match else None


def _distance_to_edge(layers: Sequence[LayerCandidates]) -> dict[str, float]:
    """fqn -> blocks to the nearer of the first and last block; -inf outside any block."""
    blocks = [b for b in (block_index(layer.fqn) for layer in layers) if b is not None]
    lo, hi = (min(blocks), max(blocks)) if blocks else (0, 0)
    out = {}
    for layer in layers:
        b = block_index(layer.fqn)
        out[layer.fqn] = -math.inf if b is None else min(b - lo, hi - b)
    return out


def first_last_plan(layers: Sequence[LayerCandidates], *, fp4_fraction: float, **kw) -> Plan:
    """Keep the first and last blocks high: FP4 fills from the middle block outwards; layers outside
    any block (embeddings, heads) go last."""
    edge = _distance_to_edge(layers)
    order = sorted((layer.fqn for layer in layers), key=edge.__getitem__, reverse=True)
    return ordered_plan(layers, order, fp4_fraction=fp4_fraction, policy="first_last", **kw)


def industry_tail_plan(layers: Sequence[LayerCandidates], *, fp4_fraction: float, first_blocks: int = 2,
                       tail_share: float = 0.15, granularity: Granularity | str = Granularity.LAYER, **kw) -> Plan:
    """The industry's default rule (after NVIDIA's NVFP4 pretraining recipe, which keeps the first two and the
    last eight of 62 blocks in BF16, ~16% together, nvfp4_recipe_plan; torchtitan's tail rule; here the first two
    and the last ``tail_share`` of blocks, 15% by default): FP4 fills the unprotected
    blocks first, from the middle of that range outwards; past the rule's natural fraction, the first
    ``first_blocks`` blocks next (the last first), then the last ceil(``tail_share`` * blocks) blocks
    (the earliest first: the final blocks stay high longest); layers outside any block (embeddings,
    heads) last. ``natural_fp4_fraction`` gives the fraction the rule reaches without the extension.
    Granularity gemm (policy "industry_tail_gemm"): every backward GEMM first (in the rule's order),
    then the forwards in the rule's order: forwards stay in FP8 as long as the target allows.
    """
    if not (isinstance(first_blocks, int) and first_blocks >= 0):
        raise ValueError(f"first_blocks: must be an integer >= 0, got {first_blocks!r}")
    if not (isinstance(tail_share, (int, float)) and 0 <= tail_share <= 1):
        raise ValueError(f"tail_share: must be a number in [0, 1], got {tail_share!r}")
    rank = _industry_tail_rank(layers, first_blocks, tail_share)

    def key(item_fqn: str):
        fqn, direction = split_key(item_fqn)
        return (direction == FORWARD, rank[fqn])

    items = _items(layers, granularity)
    order = sorted((item.fqn for item in items), key=key)
    return ordered_plan(items, order, fp4_fraction=fp4_fraction, policy=_policy("industry_tail", granularity), **kw)


def natural_fp4_fraction(layers: Sequence[LayerCandidates], *, first_blocks: int = 2, tail_share: float = 0.15) -> float:
    """The FP4 FLOPs fraction of the industry rule itself: every unpinned layer of an unprotected
    block in FP4, nothing else."""
    rank = _industry_tail_rank(layers, first_blocks, tail_share)
    total = sum(layer.flops for layer in layers)
    fp4 = sum(layer.flops for layer in layers if rank[layer.fqn][0] == 0 and layer.pinned is None
              and any(f.is_fp4 for f in layer.choices()))
    return fp4 / total if total else 0.0


def _industry_tail_rank(layers: Sequence[LayerCandidates], first_blocks: int, tail_share: float) -> dict[str, tuple]:
    """fqn -> sort key: (group, position in group); group 0 unprotected blocks, 1 the first blocks,
    2 the tail blocks, 3 outside any block."""
    blocks = sorted({b for b in (block_index(layer.fqn) for layer in layers) if b is not None})
    num_tail = math.ceil(tail_share * len(blocks) - 1e-9)
    first = set(blocks[:first_blocks])
    tail = set(blocks[len(blocks) - num_tail:]) - first if num_tail else set()
    free = [b for b in blocks if b not in first and b not in tail]
    middle = (free[0] + free[-1]) / 2 if free else 0.0
    rank = {}
    for layer in layers:
        b = block_index(layer.fqn)
        if b is None:
            rank[layer.fqn] = (3, 0.0)
        elif b in first:
            rank[layer.fqn] = (1, -b)
        elif b in tail:
            rank[layer.fqn] = (2, b)
        else:
            rank[layer.fqn] = (0, abs(b - middle))
    return rank


# The NVFP4 training recipe's high-precision layers: NVIDIA, "Pretraining Large Language Models with NVFP4" (2025),
# section 4: its 12B model keeps the linear layers of the first two and the last eight of its 62 blocks in BF16
# (about 16% of the linear layers), every other linear layer's three GEMMs in NVFP4. Applied here by block position,
# as shares of the depth, to any number of blocks (docs/method.md, "The NVFP4 recipe as a policy").
RECIPE_FIRST_BLOCKS = 2 / 62
RECIPE_LAST_BLOCKS = 8 / 62


def recipe_high_blocks(blocks: Sequence[int], *, first_share: float = RECIPE_FIRST_BLOCKS,
                       last_share: float = RECIPE_LAST_BLOCKS) -> set[int]:
    """The blocks the recipe keeps in high precision: the first round(first_share * n) and the last
    round(last_share * n) of the n ``blocks`` (at least one at each end; all of them where the two meet).
    SmolLM2's 30 blocks: 1 and 4 (5 of 30, 17%); 62 blocks: the paper's 2 and 8."""
    for name, share in (("first_share", first_share), ("last_share", last_share)):
        if not (isinstance(share, (int, float)) and 0 <= share <= 1):
            raise ValueError(f"{name}: must be a number in [0, 1], got {share!r}")
    blocks = sorted(set(blocks))
    n = len(blocks)
    if n == 0:
        return set()
    first, last = max(1, round(first_share * n)), max(1, round(last_share * n))
    if first + last >= n:
        return set(blocks)
    return set(blocks[:first]) | set(blocks[n - last:])


def nvfp4_recipe_plan(layers: Sequence[LayerCandidates], *, low: Format | str = Format.NVFP4,
                      high: Format | str = Format.BF16, first_share: float = RECIPE_FIRST_BLOCKS,
                      last_share: float = RECIPE_LAST_BLOCKS) -> Plan:
    """The published NVFP4 training recipe as a plan (policy "nvfp4_recipe"): every unpinned layer in ``low``
    (all three GEMMs; the recipe's numerics are QuantRecipe's defaults) but those of the recipe's high-precision
    blocks (recipe_high_blocks) and those outside any block (embeddings, heads), which run in ``high``; pins hold.
    A layer whose shape rules ``low`` out stays in ``high``. Its FP4 share is the rule's own, not a target.

    Raises:
        ValueError: ``low`` is not an FP4 format or a candidate of any unpinned layer; ``high`` is an FP4
            format or not a candidate of a layer that needs it.
    """
    low, high = Format.parse(low, field_name="low"), Format.parse(high, field_name="high")
    if not low.is_fp4 or high.is_fp4:
        raise ValueError(f"low / high: need an FP4 format and a non-FP4 one, got {low.value} / {high.value}")
    choices = {layer.fqn: layer.choices() for layer in layers}
    free = [layer.fqn for layer in layers if layer.pinned is None]
    if free and not any(low in choices[fqn] for fqn in free):
        raise ValueError(f"low: {low.value} is not a candidate format of any unpinned layer; add it to "
                         "candidate_formats (the recipe is NVFP4's)")
    protected = recipe_high_blocks([b for b in map(block_index, (layer.fqn for layer in layers)) if b is not None],
                                   first_share=first_share, last_share=last_share)
    formats: dict[str, Format] = {}
    for layer in layers:
        block = block_index(layer.fqn)
        fp4 = layer.pinned is None and block is not None and block not in protected and low in choices[layer.fqn]
        formats[layer.fqn] = layer.pinned or (low if fp4 else high)
    missing = [fqn for fqn, fmt in formats.items() if fmt is high and high not in choices[fqn]]
    if missing:
        raise ValueError(f"high: {high.value} is not a candidate format of layer(s) {missing[:5]}")
    return _plan(layers, formats, "nvfp4_recipe")


def backward_only_plan(layers: Sequence[LayerCandidates], *, low: Format | str = Format.MXFP4,
                       high: Format | str = Format.FP8) -> Plan:
    """Per-GEMM baseline (issue 12): every unpinned layer's backward GEMMs in the FP4 format ``low``
    and its forward in ``high``; FP4 share 2/3 of the unpinned layers' FLOPs. A layer without ``low``
    (or ``high``) as a candidate takes its first candidate of the same kind; pins hold both directions.
    """
    low, high = _low_high(low, high)
    formats: dict[str, Format] = {}
    for layer in layers:
        forward = layer.pinned or _pick(layer, high, fp4=False)
        backward = layer.pinned or _pick(layer, low, fp4=True) or forward
        formats[gemm_key(layer.fqn, FORWARD)], formats[gemm_key(layer.fqn, BACKWARD)] = forward, backward
    items = [item for layer in layers for item in split_directions(layer)]  # the per-direction FLOPs
    return _plan(items, formats, "backward_only")


def _plan(layers: Sequence[LayerCandidates], formats: Mapping[str, Format], policy: str) -> Plan:
    return Plan(formats=formats, flops={layer.fqn: layer.flops for layer in layers}, policy=policy,
                extra_cost={layer.fqn: layer.extra_cost for layer in layers if layer.extra_cost})


@dataclass(frozen=True, kw_only=True)
class PolicyContext:
    """What a baseline may use besides the candidates: the FP4 fraction to reach, a seed (random),
    the FP4 and non-FP4 formats, and each layer's relative quantization error (min_rel_err)."""

    fp4_fraction: float
    seed: int = 0
    low: Format = Format.MXFP4
    high: Format = Format.FP8
    relative_error: Mapping[str, float] | None = None


Baseline = Callable[[Sequence[LayerCandidates], PolicyContext], Plan]


def _min_rel_err(layers: Sequence[LayerCandidates], ctx: PolicyContext) -> Plan:
    if ctx.relative_error is None:
        raise ValueError("relative_error: min_rel_err needs each layer's relative quantization error; got None")
    rel_error = {layer.fqn: ctx.relative_error.get(layer.fqn, math.inf) for layer in layers}
    return min_rel_err_plan(layers, rel_error, fp4_fraction=ctx.fp4_fraction, low=ctx.low, high=ctx.high)


def _ordered(fn, **fixed) -> Baseline:
    return lambda layers, ctx: fn(layers, fp4_fraction=ctx.fp4_fraction, low=ctx.low, high=ctx.high, **fixed)


BASELINES: Mapping[str, Baseline] = {
    "all_bf16": lambda layers, ctx: uniform_plan(layers, Format.BF16),
    "all_fp8": lambda layers, ctx: uniform_plan(layers, Format.FP8),
    "all_fp4": lambda layers, ctx: uniform_plan(layers, ctx.low),
    "random": lambda layers, ctx: random_plan(layers, fp4_fraction=ctx.fp4_fraction, seed=ctx.seed, low=ctx.low,
                                              high=ctx.high),
    "random_gemm": lambda layers, ctx: random_plan(layers, fp4_fraction=ctx.fp4_fraction, seed=ctx.seed,
                                                   granularity=Granularity.GEMM, low=ctx.low, high=ctx.high),
    "min_rel_err": _min_rel_err,
    "layer_type": _ordered(layer_type_plan),
    "layer_type_gemm": _ordered(layer_type_plan, granularity=Granularity.GEMM),
    "layer_type_edges": _ordered(layer_type_plan, edges_last=True),
    "layer_type_edges_gemm": _ordered(layer_type_plan, granularity=Granularity.GEMM, edges_last=True),
    "first_last": _ordered(first_last_plan),
    "industry_tail": _ordered(industry_tail_plan),
    "industry_tail_gemm": _ordered(industry_tail_plan, granularity=Granularity.GEMM),
    "backward_only": lambda layers, ctx: backward_only_plan(layers, low=ctx.low, high=ctx.high),
    # NVFP4 by definition (ctx.low is the other rules' FP4 format), BF16 where the recipe keeps layers high
    "nvfp4_recipe": lambda layers, ctx: nvfp4_recipe_plan(layers),
}


def baseline_plan(name: str, layers: Sequence[LayerCandidates], context: PolicyContext) -> Plan:
    """The plan of the baseline called ``name`` (a key of BASELINES)."""
    if name not in BASELINES:
        raise ValueError(f"policy: unknown baseline {name!r}; valid: {', '.join(BASELINES)}")
    return BASELINES[name](layers, context)
