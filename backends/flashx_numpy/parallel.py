"""Run a call's independent tiles on every core, each with a single-threaded BLAS.

NumPy's elementwise ufuncs (exp, max, where) run on one core and release the GIL;
BLAS spreads one matmul over all cores. Attention alternates the two, so the fastest
arrangement is the one CPU attention kernels use (torch's included): one worker per
core, each running whole tiles with a one-thread BLAS.

The forward is bitwise reproducible whatever the thread count and whatever else the process
runs. So every tile runs under a one-thread BLAS (a matmul's bits can depend on how many
threads split it), also when a call has a single tile; and calls run one at a time, each on
every core: a call made beside another got other bits from BLAS. The BLAS limit is
process-wide (threadpoolctl sets it) and lasts as long as a call's tiles; other threads of the
process see a one-thread BLAS meanwhile.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Iterable


class _Workers:
    """A lazily started pool of one worker per BLAS thread (one worker: the caller's thread)."""

    def __init__(self):
        self._start = threading.Lock()
        self._one_call = threading.Lock()
        self._controller = None
        self._pool = None
        self._count = 0  # 0 until started

    @property
    def count(self) -> int:
        """How many tiles run at once: as many as BLAS had threads when first asked."""
        with self._start:
            if not self._count:
                from threadpoolctl import ThreadpoolController

                self._controller = ThreadpoolController().select(user_api="blas")
                self._count = max([info["num_threads"] for info in self._controller.info()], default=1)
                if self._count > 1:
                    self._pool = ThreadPoolExecutor(self._count, thread_name_prefix="flashx-numpy")
        return self._count

    def run(self, tasks: Iterable[Callable[[], None]]) -> None:
        """Run every task (they must touch disjoint outputs); re-raise the first failure."""
        tasks = list(tasks)
        parallel = self.count > 1 and len(tasks) > 1
        with self._one_call, self._controller.limit(limits=1):
            if not parallel:
                for task in tasks:
                    task()
                return
            futures = [self._pool.submit(task) for task in tasks]
            wait(futures)
            for future in futures:
                future.result()


workers = _Workers()
