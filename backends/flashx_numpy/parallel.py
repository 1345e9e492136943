"""Run independent tiles of work on every core, each with a single-threaded BLAS.

NumPy's elementwise ufuncs (exp, max, where) run on one core and release the GIL;
BLAS spreads one matmul over all cores. Attention alternates the two, so the fastest
arrangement is the one CPU attention kernels use (torch's included): one worker per
core, each running whole tiles with a one-thread BLAS. OpenBLAS's thread count is
process-wide, so it is lowered while tiles run and restored when the last caller leaves;
other threads of the process see a one-thread BLAS meanwhile. Where NumPy's BLAS is not
an OpenBLAS we can reach (no wheel-bundled library), tiles run one after the other in the
caller's thread and BLAS keeps its own threads.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Iterable

import numpy as np

# (get, set) symbol names of the OpenBLAS builds NumPy wheels bundle: scipy-openblas
# with 64-bit or 32-bit integers, and plain OpenBLAS.
_SYMBOLS = (
    ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
    ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
    ("openblas_get_num_threads", "openblas_set_num_threads"),
)


def _openblas_controls():
    """(get_num_threads, set_num_threads) of the OpenBLAS NumPy loaded, or None."""
    package = os.path.dirname(np.__file__)
    candidates = glob.glob(os.path.join(package + ".libs", "*openblas*")) + glob.glob(
        os.path.join(package, ".dylibs", "*openblas*")
    )
    for path in candidates:
        try:
            library = ctypes.CDLL(path)  # already loaded by NumPy: the same instance
        except OSError:
            continue
        for get_name, set_name in _SYMBOLS:
            if hasattr(library, get_name) and hasattr(library, set_name):
                get, set_ = getattr(library, get_name), getattr(library, set_name)
                get.restype, get.argtypes = ctypes.c_int, []
                set_.restype, set_.argtypes = None, [ctypes.c_int]
                return get, set_
    return None


class _Workers:
    """A lazily started pool of one worker per BLAS thread (one worker: the caller's thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._controls = None
        self._pool = None
        self._count = 0  # 0 until started
        self._active = 0
        self._saved_threads = 1

    @property
    def count(self) -> int:
        """How many tiles run at once."""
        with self._lock:
            if not self._count:
                self._controls = _openblas_controls()
                self._count = max(1, self._controls[0]()) if self._controls else 1
                if self._count > 1:
                    self._pool = ThreadPoolExecutor(self._count, thread_name_prefix="flashx-numpy")
        return self._count

    def run(self, tasks: Iterable[Callable[[], None]]) -> None:
        """Run every task (they must touch disjoint outputs); re-raise the first failure."""
        tasks = list(tasks)
        if self.count == 1 or len(tasks) == 1:
            for task in tasks:
                task()
            return
        get_threads, set_threads = self._controls
        with self._lock:
            if self._active == 0:
                self._saved_threads = get_threads()
                set_threads(1)
            self._active += 1
        try:
            futures = [self._pool.submit(task) for task in tasks]
            wait(futures)
            for future in futures:
                future.result()
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    set_threads(self._saved_threads)


workers = _Workers()
