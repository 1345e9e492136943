"""flashx's Numba backend: FlashAttention-2 written in Python with numba-cuda, readable kernel by kernel,
and split-KV decoding over contiguous and paged KV caches (``decode``).

It takes torch tensors on a CUDA device (CuPy arrays reach it through DLPack, without copies)
and runs on the caller's current stream. Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)
the same kernels run on the CPU, thread by thread, which is how CI grades them.

Importing this module imports neither numba nor torch: the kernels load on first use, so plugin
discovery stays fast and a missing library shows up as a reason, not a crash.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import flashx
from flashx.hookspecs import hookimpl

__version__ = "0.1.0"


def _simulating() -> bool:
    """Whether numba runs CUDA kernels in its simulator: as it decided on import, or as it will."""
    config = sys.modules.get("numba.cuda.core.config")
    if config is not None:
        return bool(config.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


class NumbaBackend(flashx.Backend):
    name = "numba"
    version = __version__
    array_kind = "torch"
    dtypes = frozenset({"float16", "bfloat16", "float32"})
    max_head_dim = 256
    features = frozenset({"causal", "window", "mask", "block_mask", "seqlens", "varlen", "dropout", "dropout_offsets",
                          "gqa", "dv_ne_d", "softcap", "alibi", "sinks"})
    deterministic_backward = True
    strided_arrays = frozenset({"mask", "block_mask"})  # read through their strides: a broadcast costs nothing

    @property
    def devices(self) -> frozenset[str]:
        return frozenset({"cuda", "cpu"}) if _simulating() else frozenset({"cuda"})

    def available(self) -> str | None:
        return _unavailable(_simulating())

    def priority(self, problem) -> int:
        return 30 if problem.device == "cuda" else 0  # below Triton on a GPU, below NumPy on a CPU

    def forward(self, problem, q, k, v):
        from flashx_numba.attention import forward

        return forward(problem, q, k, v)

    def backward(self, problem, q, k, v, o, lse, do):
        from flashx_numba.attention import backward

        return backward(problem, q, k, v, o, lse, do)

    def decode(self, problem, q, k_cache, v_cache, k_new, v_new):
        from flashx_numba.decode import decode

        return decode(problem, q, k_cache, v_cache, k_new, v_new)


@functools.cache
def _unavailable(simulating: bool) -> str | None:
    """Why the backend cannot run here, or None; the libraries are looked up, not imported."""
    for module, distribution in (("numba_cuda", "numba-cuda"), ("torch", "torch")):
        if importlib.util.find_spec(module) is None:
            return f"cannot import {module}: pip install 'flashx-attention[numba]' (it needs {distribution})"
    if simulating:
        return None
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (set NUMBA_ENABLE_CUDASIM=1 to run the kernels on the CPU, slowly)"
    return None


@hookimpl
def flashx_backends():
    return [NumbaBackend()]
