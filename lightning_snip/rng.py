"""Random sources of stochastic rounding that torch.compile can trace.

Stochastic rounding draws its bits from a ``torch.Generator`` (SNIPCallback seeds one per rank per
step). Dynamo cannot trace a Generator: a traced SNIPLinear whose backward drew from one broke its
graph at every draw. What torch lacks, written here by hand: an *RNG token*, a small CPU int64 tensor
``[key, draws]`` that names a registered generator, and one custom operator,
``lightning_snip::random_bits(token, n, device)``, that draws from the generator the token names. A
custom operator is opaque to dynamo and inductor (no graph break, called as it is at run time), and
it declares that it mutates the token (it counts the draws), so that a compiled graph keeps every
draw, in program order: no common-subexpression merge of two equal-looking draws, no reordering.
The bits are those an eager ``random_(generator=...)`` draws from the same generator state, so a
compiled layer rounds bit for bit as its eager self.

Generators given a token are held for the process's lifetime (one per SNIPCallback and rank: a few
kilobytes each). Key 0 names torch's default generator of the output's device. Tokens live on the CPU
(read by the operator on the host; no device sync per draw).
"""

from __future__ import annotations

import itertools
import os
import threading

import torch

_GENERATORS: dict[int, torch.Generator] = {}
_TOKENS: dict[int, torch.Tensor] = {}  # id(generator) -> its token (one shared token per generator)
# Keys unique to this process (its pid in the high bits): a token unpickled in another process never
# names an unrelated generator there.
_KEYS = itertools.count((os.getpid() << 32) + 1)
_LOCK = threading.Lock()
_DEFAULT_TOKEN = torch.zeros(2, dtype=torch.int64, device="cpu")  # key 0: torch's default generator


def token_for(generator: torch.Generator | None) -> torch.Tensor:
    """The RNG token naming ``generator`` (None: torch's default generator). Layers that share a
    generator share its token, so their draws stay ordered among each other in a compiled graph."""
    if generator is None:
        return _DEFAULT_TOKEN
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    with _LOCK:
        token = _TOKENS.get(id(generator))
        if token is None or _GENERATORS.get(int(token[0])) is not generator:
            key = next(_KEYS)
            _GENERATORS[key] = generator
            token = _TOKENS[id(generator)] = torch.tensor([key, 0], dtype=torch.int64, device="cpu")
        return token


def generator_of(token: torch.Tensor, *, missing_ok: bool = False) -> torch.Generator | None:
    """The generator a token names (None: torch's default; also for a key unknown here when
    ``missing_ok``)."""
    key = int(token[0])
    if key == 0:
        return None
    generator = _GENERATORS.get(key)
    if generator is None and missing_ok:
        return None
    if generator is None:  # e.g. a token unpickled in another process, where nothing registered it
        raise RuntimeError(f"RNG token key {key} names no generator in this process; assign the layer's "
                           "generator again (SNIPLinear.generator = ...)")
    return generator


@torch.library.custom_op("lightning_snip::random_bits", mutates_args=("token",))
def random_bits_op(token: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """ceil(n / 2) random int64 words (grid.random_bits' layout) from the generator ``token`` names."""
    generator = generator_of(token)
    token[1] += 1
    return torch.empty((n + 1) // 2, dtype=torch.int64, device=device).random_(generator=generator)


@random_bits_op.register_fake
def _random_bits_fake(token: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    return torch.empty((n + 1) // 2, dtype=torch.int64, device=device)
