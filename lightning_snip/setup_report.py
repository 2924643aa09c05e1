"""The run's setup lines: what SNIP converted and pinned, which GEMM kernels run, and settings that have no effect.

Written once at fit start, on one rank (SNIPController.log_setup).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from lightning_snip.config import SNIPConfig
from lightning_snip.convert import log_output_head
from lightning_snip.evidence import describe_target
from lightning_snip.formats import Format
from lightning_snip.gemm import describe_kernels, emulated_layers, warn_if_fp4_emulated
from lightning_snip.linear import SNIPLinear

logger = logging.getLogger(__name__)


def log_setup(config: SNIPConfig, layers: Mapping[str, SNIPLinear], device, head: str | None = None) -> None:
    """The run's setup lines: layers, the output head pinned by what it is (``head``: find_output_head's answer; or
    a warning that the default pins matched nothing, or that the pins a user wrote leave it switchable), GEMM
    kernels (a warning where a GPU emulates FP4), what replan=False turns off (call on one rank)."""
    cfg = config
    num_pinned = sum(1 for layer in layers.values() if layer.pinned is not None)
    logger.info("SNIP: %d converted layers (%d pinned, %d switchable), initial format %s", len(layers), num_pinned,
                len(layers) - num_pinned, cfg.initial_format)
    log_output_head(layers, cfg.pin_formats, cfg.output_head_format, head=head,
                    head_globs=tuple(SNIPConfig().pin_formats),  # (the default pins' globs)
                    layers_chosen=cfg.include != ("*",) or bool(cfg.exclude))
    formats = sorted({Format.parse(f) for f in (cfg.initial_format, *cfg.candidate_formats, *cfg.pin_formats.values())},
                     key=lambda f: f.value)
    logger.info("SNIP: GEMM kernels: %s", describe_kernels(formats, device))
    warn_if_fp4_emulated(formats, device)
    for fmt, names in emulated_layers(formats, device, layers).items():
        if names:  # which layers run emulated although the format has a native kernel: said once
            shown = ", ".join(f"{n} ({layers[n].in_features}->{layers[n].out_features})" for n in names[:8])
            logger.info("SNIP: %d layer(s) run %s emulated (weight dimensions not multiples of %d): %s%s",
                        len(names), fmt.value, 16 if fmt is Format.FP8 else 32, shown, ", ..." if len(names) > 8 else "")
        else:
            logger.info("SNIP: every layer that can run %s has weight dimensions its native kernel takes", fmt.value)
    if cfg.replan:
        logger.info("SNIP: target %s", describe_target(layers, cfg))
    else:  # (what replan=False turns off, said: it is not only the rounds)
        logger.info("SNIP: replan=False: the given plan (or the initial format) holds for the whole run; no statistics "
                    "round, loss watch or plan canary runs")
