"""flashx's NumPy CPU reference backend: the FlashAttention algorithm itself, tile by tile.

Registered through the ``flashx.backends`` entry point like any third-party plugin.
"""

from __future__ import annotations

import flashx
from flashx.hookspecs import hookimpl
from flashx_numpy.attention import BLOCK_K, BLOCK_Q, backward, forward


class NumpyBackend(flashx.Backend):
    name = "numpy"
    version = flashx.__version__
    array_kind = "numpy"
    devices = frozenset({"cpu"})
    dtypes = flashx.backend.ALL_DTYPES | flashx.problem.FP8_DTYPES  # FP8 forward: flashx_numpy.fp8
    max_head_dim = 1024
    features = frozenset(flashx.problem.FEATURES)
    deterministic_backward = True
    strided_arrays = frozenset({"mask", "block_mask"})  # read through their strides: a broadcast costs nothing

    def __init__(self, *, block_q: int = BLOCK_Q, block_k: int = BLOCK_K, name: str = "numpy"):
        """Tiles of ``block_q`` query rows (all heads of a group together) x ``block_k`` keys."""
        self.block_q, self.block_k, self.name = block_q, block_k, name

    @property
    def threads(self) -> int:
        """How many tiles a call runs at once: one worker per BLAS thread, each with a one-thread
        BLAS (``flashx_numpy.parallel``); a comparison gives its peer as many threads."""
        from flashx_numpy.parallel import workers

        return workers.count

    def priority(self, problem):
        return 10

    def forward(self, problem, q, k, v):
        return forward(problem, q, k, v, block_q=self.block_q, block_k=self.block_k)

    def backward(self, problem, q, k, v, o, lse, do):
        return backward(problem, q, k, v, o, lse, do, block_q=self.block_q, block_k=self.block_k)

    def decode_reasons(self, problem):
        if problem.new_tokens and problem.array_kind == "torch" and problem.cache_dtype == "bfloat16":
            return ["cannot write new tokens into a torch bfloat16 cache in place (NumPy sees it as a float32 copy)"]
        return []

    def decode(self, problem, q, k_cache, v_cache, k_new, v_new):
        from flashx_numpy.decode import decode

        return decode(problem, q, k_cache, v_cache, k_new, v_new, block_q=self.block_q, block_k=self.block_k)


@hookimpl
def flashx_backends():
    return [NumpyBackend()]
