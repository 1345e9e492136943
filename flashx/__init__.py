"""flashx: exact FlashAttention, one contract, many kernels.

Importing flashx imports no GPU library and discovers no plugin: both happen on first use.
"""

from flashx.errors import DeviceError, DTypeError, FlashXError, ShapeError, UnsupportedError
from flashx.problem import BlockMask, Problem
from flashx.backend import Backend

__version__ = "0.1.0"
