"""The random Hadamard transform (RHT) of the NVFP4 training recipe, on the wgrad GEMM's operands.

The recipe (NVIDIA, "Pretraining Large Language Models with NVFP4", 2025; torchao's nvfp4_training) multiplies both
operands of the weight-gradient GEMM dW = G^T X along their contraction axis, the tokens, by one block-diagonal
orthonormal matrix of 16x16 blocks R = diag(s) H / 4 (H the 16x16 Hadamard matrix, s a random sign vector of the
layer). R R^T = I, so the product is unchanged before quantization; after it, an outlier token is spread over 16 and
the block scales fit the block better.

torchao builds R (hadamard_utils.get_rht_matrix, plain torch: used here) but applies it only inside its Triton
kernels for compute capability 10.x; the transform itself, a reshape and one small matmul, is written here so that
every device and the statistics round apply the same one.
"""

from __future__ import annotations

import functools
import zlib
import torch

HADAMARD_SIZE = 16  # the recipe's (and torchao's only) block of the transform
SIGN_SEED = 0x5EED  # the sign vectors' seed: a layer's signs are a function of its name (layer_signs)


def layer_signs(fqn: str, seed: int = SIGN_SEED) -> tuple[int, ...]:
    """A layer's RHT sign vector (16 of +-1) from (``seed``, its name) alone: the same on every rank and in a resumed
    run, with nothing to communicate or save beyond the layer's name."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(fqn.encode())) % 2**63)
    drawn = torch.randint(0, 2, (HADAMARD_SIZE,), generator=generator, device="cpu")  # (under a meta device too)
    return tuple(int(v) for v in drawn * 2 - 1)


def sign_tensor(fqn: str) -> torch.Tensor:
    """layer_signs as SNIPLinear holds them: an int8 tensor on the CPU, so that a compiled graph takes it as an input
    (no guard on its values: blocks compiled one by one share their graph although each has its own signs)."""
    return torch.tensor(layer_signs(fqn), dtype=torch.int8, device="cpu")


def check_signs(signs, field: str = "rht_signs") -> tuple[int, ...]:
    """``signs`` (a sequence, or a CPU tensor as SNIPLinear holds them) as a tuple of 16 values, each 1 or -1; a
    clear error naming ``field`` otherwise."""
    values = tuple(signs.tolist()) if isinstance(signs, torch.Tensor) else tuple(signs)
    if len(values) != HADAMARD_SIZE or any(v not in (1, -1) or isinstance(v, bool) for v in values):
        raise ValueError(f"{field}: expected {HADAMARD_SIZE} values, each 1 or -1, got {values!r}")
    return tuple(int(v) for v in values)


def rht_matrix(signs, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """R = diag(signs) H / 4, torchao's get_rht_matrix for the same signs (16x16, orthonormal), cached per device;
    ``signs``: a sequence, or a tensor as SNIPLinear holds them (never read on the host: the training path makes no
    host read on a plain step; the same values, diag(s) H = s * H row by row, exactly)."""
    if isinstance(signs, torch.Tensor):
        hadamard = _rht_matrix((1,) * HADAMARD_SIZE, str(torch.device(device)), dtype)
        return signs.to(device=hadamard.device, dtype=dtype).unsqueeze(1) * hadamard
    return _rht_matrix(check_signs(signs), str(torch.device(device)), dtype)


@functools.lru_cache(maxsize=256)
def _rht_matrix(signs: tuple[int, ...], device: str, dtype: torch.dtype) -> torch.Tensor:
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix

    return get_rht_matrix(signs, device, dtype, HADAMARD_SIZE)


def hadamard_rows(t: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``t`` (..., rows, n) with its last axis (a GEMM's contraction axis) in blocks of 16, each block times
    ``matrix``: one (16, 16), or one per leading index (..., 16, 16: a stack of layers, each its own). The last axis
    is zero-padded to whole blocks first (zero terms keep the product exact), so the result has n rounded up to a
    multiple of 16. Computed in float32, returned in t's dtype (a transposed view: the quantizer makes its rows
    contiguous anyway).

    Computed along the transposed layout, R^T times each 16-row block of the (n, rows) matrix, one formulation for
    every caller (the same numbers everywhere): the wgrad operands arrive as transposes of token-major tensors
    (G^T, X^T), whose 16-token blocks are contiguous there; blocks along a strided last axis were 11x slower
    (measured on a CPU, 2048 tokens x 704 features)."""
    n, rows = t.shape[-1], t.shape[-2]
    pad = (-n) % HADAMARD_SIZE
    tokens_major = t.float().transpose(-1, -2)
    if pad:
        tokens_major = torch.nn.functional.pad(tokens_major, (0, 0, 0, pad))
    blocks = tokens_major.reshape(*t.shape[:-2], (n + pad) // HADAMARD_SIZE, HADAMARD_SIZE, rows)
    transposed = matrix.to(device=t.device, dtype=torch.float32).transpose(-1, -2)
    if matrix.dim() > 2:  # one matrix per leading index: broadcast over its blocks
        transposed = transposed.reshape(*matrix.shape[:-2], 1, HADAMARD_SIZE, HADAMARD_SIZE)
    return (transposed @ blocks).reshape(*t.shape[:-2], n + pad, rows).transpose(-1, -2).to(t.dtype)
