"""flashx: exact FlashAttention, one contract, many kernels.

Importing flashx imports no GPU library and discovers no plugin: both happen on first use.
"""

from flashx import registry
from flashx.api import (
    Residuals,
    attention,
    attention_backward,
    attention_forward,
    backends,
    explain,
    merge_states,
)
from flashx.backend import Backend
from flashx.dispatch import use_backend
from flashx.errors import (
    DeviceError,
    DTypeError,
    FlashXError,
    OptionError,
    ShapeError,
    UnknownBackendError,
    UnsupportedError,
)
from flashx.kvcache import attention_with_kvcache
from flashx.problem import BlockMask, DecodeProblem, Problem

__version__ = "0.1.0"


def __getattr__(name):
    # flashx.distributed imports torch: it loads when first named, not with flashx.
    if name == "distributed":
        import importlib

        return importlib.import_module("flashx.distributed")
    raise AttributeError(f"module 'flashx' has no attribute {name!r}")

__all__ = [
    "Backend",
    "BlockMask",
    "DTypeError",
    "DecodeProblem",
    "DeviceError",
    "FlashXError",
    "OptionError",
    "Problem",
    "Residuals",
    "ShapeError",
    "UnknownBackendError",
    "UnsupportedError",
    "attention",
    "attention_backward",
    "attention_forward",
    "attention_with_kvcache",
    "backends",
    "explain",
    "merge_states",
    "registry",
    "use_backend",
]
