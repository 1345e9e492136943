"""Where flashx keeps what it learns about a machine across processes (the Triton backend's
tuning records, the Numba backend's compiled kernels): one directory, each backend a folder in it.

``$FLASHX_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashx``, else ``~/.cache/flashx``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_directory() -> Path:
    """$FLASHX_CACHE_DIR, else $XDG_CACHE_HOME/flashx, else ~/.cache/flashx."""
    if os.environ.get("FLASHX_CACHE_DIR"):
        return Path(os.environ["FLASHX_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "flashx"
    return Path.home() / ".cache" / "flashx"
