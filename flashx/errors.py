"""The error classes of the contract's Errors section (docs/contract.md).

Each subclasses the builtin a Python user would catch for the same mistake, so
``except ValueError`` keeps working for code that does not know flashx.
"""

from __future__ import annotations


class FlashXError(Exception):
    """Base class of every error flashx raises for bad input or an impossible request."""


class ShapeError(FlashXError, ValueError):
    """An argument has the wrong shape, length or layout."""


class OptionError(FlashXError, ValueError):
    """An option's value is outside its domain: ``dropout_p=1.5``, a NaN ``softmax_scale``, ``window=(-3, 0)``."""


class DTypeError(FlashXError, TypeError):
    """An argument has the wrong dtype or is not an array flashx understands."""


class DeviceError(FlashXError, ValueError):
    """Arguments live on different devices, or on a device the call cannot use."""


class UnsupportedError(FlashXError, NotImplementedError):
    """No backend (or not the requested one) can run this problem; the message lists why."""


class UnknownBackendError(FlashXError, ValueError):
    """No backend has the name asked for; the message lists the registered ones and the closest."""
