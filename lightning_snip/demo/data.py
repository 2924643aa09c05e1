"""Byte-level text data. The default corpus is the source of Python's own standard library (it
ships with every Python, so nothing is downloaded); ``path`` takes any text file instead."""

from __future__ import annotations

import logging
import math
import sysconfig
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Plain-prose-heavy stdlib modules first; a fixed list keeps the corpus the same on every machine
# with the same Python version.
_STDLIB_FILES = (
    "argparse.py", "asyncio/base_events.py", "calendar.py", "collections/__init__.py", "contextlib.py",
    "dataclasses.py", "difflib.py", "email/message.py", "enum.py", "fractions.py", "functools.py",
    "inspect.py", "json/decoder.py", "logging/__init__.py", "pathlib.py", "pickle.py", "pydoc.py",
    "random.py", "shutil.py", "statistics.py", "string.py", "subprocess.py", "tarfile.py", "textwrap.py",
    "threading.py", "typing.py", "unittest/case.py", "zipfile.py" if Path(sysconfig.get_paths()["stdlib"], "zipfile.py").exists() else "zipfile/__init__.py",
)


def default_corpus_bytes() -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / name).read_bytes() for name in _STDLIB_FILES if (stdlib / name).exists()]
    if not parts:
        raise FileNotFoundError(f"data.path: no default corpus found under the Python standard library at {stdlib}")
    return b"\n".join(parts)


def load_corpus(path: str | None, *, min_bytes: int = 1, why: str = "") -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor of bytes; ValueError naming data.path and the file's size
    when it is missing or holds fewer than ``min_bytes`` bytes (``why`` says what needs them)."""
    if path:
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"data.path: {str(file)!r} is not a readable file")
        data = file.read_bytes()
        name = repr(str(file))
    else:
        data = default_corpus_bytes()
        name = "the default corpus"
    if len(data) < max(1, min_bytes):
        raise ValueError(f"data.path: {name} holds {len(data)} bytes; at least {max(1, min_bytes)} are needed{why}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def min_corpus_bytes(seq_len: int, val_fraction: float) -> int:
    """Bytes a corpus needs so that both its training and validation splits hold one window."""
    return math.ceil((seq_len + 1) / min(val_fraction, 1 - val_fraction)) + 1


class ByteWindows(torch.utils.data.Dataset):
    """Random-access windows of seq_len+1 bytes: (inputs, targets shifted by one)."""

    def __init__(self, data: torch.Tensor, seq_len: int, stride: int | None = None):
        if len(data) < seq_len + 1:
            raise ValueError(f"data: corpus of {len(data)} bytes is shorter than data.seq_len + 1 = {seq_len + 1}")
        self.data, self.seq_len = data, seq_len
        self.stride = stride or seq_len
        self.num = (len(data) - seq_len - 1) // self.stride + 1

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int):
        chunk = self.data[i * self.stride : i * self.stride + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def split_corpus(data: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]
