"""lightning_snip: SNIP adaptive FP4/FP8 precision as a PyTorch Lightning callback.

``SNIPCallback`` and ``SNIPConfig`` are imported lazily, so ``lightning_snip.planner`` and
``lightning_snip.plan`` stay importable without torch or Lightning.
"""

from lightning_snip import _logging

_logging.setup()  # the package's lines shown as Lightning's are; two third-party notices dropped (see there)

__version__ = "0.1.0"
__all__ = ["SNIPCallback", "SNIPConfig", "Format", "Plan"]


def __getattr__(name):
    if name == "SNIPCallback":
        from lightning_snip.callback import SNIPCallback

        return SNIPCallback
    if name == "SNIPConfig":
        from lightning_snip.config import SNIPConfig

        return SNIPConfig
    if name == "Format":
        from lightning_snip.formats import Format

        return Format
    if name == "Plan":
        from lightning_snip.plan import Plan

        return Plan
    raise AttributeError(f"module 'lightning_snip' has no attribute {name!r}")
