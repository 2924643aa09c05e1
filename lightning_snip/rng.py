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

A generator given a token is held while its token lives: the token is shared by the layers that draw
from the generator (and held by a compiled graph that names it), and when the last holder goes, the
registry forgets both. Key 0 names torch's default generator of the output's device. Tokens live on the CPU
(read by the operator on the host; no device sync per draw).
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref

import torch

_GENERATORS: dict[int, torch.Generator] = {}
# id(generator) -> its token (one shared token per generator), weakly: the layers hold the token
_TOKENS: dict[int, weakref.ref] = {}
# Keys unique to this process (its pid in the high bits): a token unpickled in another process never
# names an unrelated generator there.
_KEYS = itertools.count((os.getpid() << 32) + 1)
_LOCK = threading.RLock()  # (re-entered: a collection inside token_for may run _forget)
_DEFAULT_TOKEN = torch.zeros(2, dtype=torch.int64, device="cpu")  # key 0: torch's default generator


def token_for(generator: torch.Generator | None) -> torch.Tensor:
    """The RNG token naming ``generator`` (None: torch's default generator). Layers that share a
    generator share its token, so their draws stay ordered among each other in a compiled graph."""
    if generator is None:
        return _DEFAULT_TOKEN
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    with _LOCK:
        ref = _TOKENS.get(id(generator))
        token = ref() if ref is not None else None
        if token is None or _GENERATORS.get(int(token[0])) is not generator:
            key = next(_KEYS)
            _GENERATORS[key] = generator
            token = torch.tensor([key, 0], dtype=torch.int64, device="cpu")
            _TOKENS[id(generator)] = weakref.ref(token)
            weakref.finalize(token, _forget, key, id(generator))
        return token


def _forget(key: int, generator_id: int) -> None:
    """A token's last holder is gone: its generator leaves the registry (and the id its token entry)."""
    with _LOCK:
        _GENERATORS.pop(key, None)
        ref = _TOKENS.get(generator_id)
        if ref is not None and ref() is None:
            del _TOKENS[generator_id]


def num_registered() -> int:
    """Generators the registry holds now (each named by a live token)."""
    return len(_GENERATORS)


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


def stream_seed(seed: int, rank: int, step: int, batch_idx: int) -> int:
    """A 63-bit seed for one (rank, step, micro-batch) of a run seeded with ``seed``."""
    mixed = seed
    for value in (rank, step, batch_idx):
        mixed = (mixed * 6364136223846793005 + 1442695040888963407 + value) % (1 << 63)
    return mixed
