"""The package's logging, set up on import (stdlib only: ``lightning_snip`` stays importable without torch).

- Its own lines (setup, "SNIP plan applied", warnings) are shown as Lightning shows its own: the
  ``lightning_snip`` logger at INFO, printed to stderr where nothing else is configured to show them.
- Two third-party notices that say nothing to a user are dropped at their source loggers, each by its
  exact wording, so that every other line of those loggers still shows. Hand-written: neither torchao
  nor torch offers a switch for them.
"""

from __future__ import annotations

import logging


class _ShownWithoutConfig(logging.StreamHandler):
    """Lightning's rule for its own logger (lightning/pytorch/__init__.py: INFO lines to stderr while the
    root logger has no handler), applied per record instead of once at import, and without turning
    propagation off: where a user, an app (Hydra) or pytest configured a root handler, the records go
    there only, never twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


class _OptionalExtensionNotices(logging.Filter):
    """torchao's import tries to load its compiled extensions (``torchao/_C*.so``: CUDA / CUTLASS kernels,
    some built for another Python) and logs a warning for each it cannot load, and one where Triton is
    absent (torchao.kernel.intmm). Without a CUDA device nothing here uses them, so those notices are
    dropped there; with one they stay (a real problem)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        extension = message.startswith("Failed to load ") and "torchao" in message and "/_C" in message
        if not (extension or message.startswith("Warning: Detected no triton")):
            return True
        import torch

        return torch.cuda.is_available()


class _TorchaoEnumRegistrations(logging.Filter):
    """torch's pytree warns that registering an Enum as a pytree constant is deprecated; torchao does so
    for its own enums on import (KernelPreference, ScaleCalculationMode, ...). Dropped for torchao's
    enums only: the same notice about any other class still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("%s is an Enum subclass and is now natively supported"):
            return True
        cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not getattr(cls, "__module__", "").startswith("torchao")


def setup() -> None:
    """Idempotent: installs the handler and the filters once per process."""
    package = logging.getLogger("lightning_snip")
    if not any(isinstance(h, _ShownWithoutConfig) for h in package.handlers):
        package.addHandler(_ShownWithoutConfig())
        if package.level == logging.NOTSET:
            package.setLevel(logging.INFO)
    for name, cls in (("torchao", _OptionalExtensionNotices), ("torchao.kernel.intmm", _OptionalExtensionNotices),
                      ("torch.utils._pytree", _TorchaoEnumRegistrations)):
        source = logging.getLogger(name)
        if not any(isinstance(f, cls) for f in source.filters):
            source.addFilter(cls())
