"""flashx's Triton backend: FlashAttention-2 forward and a deterministic (atomic-free) backward.

Importing this module imports neither torch nor Triton: the kernels load on first use, so
plugin discovery stays fast and a missing library shows up as a reason, not a crash.
"""

from __future__ import annotations

import os

import flashx
from flashx.hookspecs import hookimpl

__version__ = "0.1.0"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend(flashx.Backend):
    name = "triton"
    version = __version__
    array_kind = "torch"
    dtypes = frozenset({"float16", "bfloat16", "float32"}) | flashx.problem.FP8_DTYPES  # FP8: flashx_triton.fp8
    max_head_dim = 256
    features = frozenset(flashx.problem.FEATURES)
    deterministic_backward = True
    strided_arrays = frozenset({"mask", "block_mask"})  # read through their strides: a broadcast costs nothing

    @property
    def devices(self) -> frozenset[str]:
        return frozenset({"cuda", "cpu"}) if _interpreting() else frozenset({"cuda"})

    def available(self) -> str | None:
        try:
            import torch
            import triton  # noqa: F401
        except ImportError as error:
            return f"cannot import {error.name}: pip install 'flashx-attention[triton]'"
        if not (_interpreting() or torch.cuda.is_available()):
            return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
        return None

    def priority(self, problem) -> int:
        return 100 if problem.device == "cuda" else 0

    def forward(self, problem, q, k, v):
        from flashx_triton.forward import forward

        return forward(problem, q, k, v)

    def prepare_forward(self, problem, q, k, v):
        from flashx_triton.forward import prepare_forward

        return prepare_forward(problem, q, k, v)

    def backward(self, problem, q, k, v, o, lse, do):
        from flashx_triton.backward import backward

        return backward(problem, q, k, v, o, lse, do)

    def forward_into(self, problem, q, k, v, o_sums, lse_sums):
        from flashx_triton.forward import forward_into

        forward_into(problem, q, k, v, o_sums, lse_sums)

    def backward_into(self, problem, q, k, v, o, lse, do, dq_sums, dk_sums, dv_sums):
        from flashx_triton.backward import backward_into

        return backward_into(problem, q, k, v, o, lse, do, dq_sums, dk_sums, dv_sums)

    def settle(self) -> None:
        """Wait for the exact kernels sent to the worker process (``flashx_triton.background``)."""
        from flashx_triton.background import wait_for_all

        wait_for_all()

    def decode(self, problem, q, k_cache, v_cache, k_new, v_new):
        from flashx_triton.decode import decode

        return decode(problem, q, k_cache, v_cache, k_new, v_new)

    def decode_splits(self, problem) -> int:
        """How many parts of each sequence's keys ``decode`` computes in parallel for ``problem``
        (as ``flashx.kvcache.explain(...).problem`` gives it): its ``num_splits``, or this
        backend's own choice for ``num_splits=0``. The decode benchmark reports it beside each time."""
        import torch

        from flashx_triton.decode import splits

        return splits(problem, torch.device(problem.device, problem.device_index))


@hookimpl
def flashx_backends():
    return [TritonBackend()]


@hookimpl
def flashx_commands():
    from flashx_triton.cli import TUNE  # the command line loads for the flashx command alone, not for a call

    return [TUNE]
