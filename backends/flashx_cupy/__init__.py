"""flashx's CuPy backend: FlashAttention-2 in hand-written CUDA C++, compiled at run time by
NVRTC through ``cupy.RawModule``.

The kernels (``kernels/*.cu``, ``*.cuh``) use tensor cores for float16 and bfloat16
(mma.sync.m16n8k16 fed by ldmatrix, float32 accumulation, K/V tiles double-buffered with
cp.async) and IEEE fma for float32 (no TF32). On compute capability 9.0 the 16-bit forward runs
on Hopper's warpgroup products instead (wgmma, sm_90a code, ``kernels/forward_sm90.cu``; at head
dim 256 without dropout or masks), and so does the 16-bit backward up to head dim 128
(``kernels/dq_sm90.cu``, ``kernels/dkdv_sm90.cu``). The 16-bit backward adds dQ in its dK/dV
kernel by unordered float32 reductions without a band (causal, window), and on wgmma under a band
too where dQ's float32 sums fit one launch (``variants.fused_dq``); with ``deterministic=True``, or
elsewhere, it computes dQ in a kernel of its own. Without atomics the backward is bitwise
reproducible.
The score modifications (softcap, ALiBi, sinks: ``kernels/score_mods.cuh``) are compile-time
options of every kernel, so a call without them runs the code it ran before they existed.
Decoding with a KV cache (``attention_with_kvcache``) is split-KV attention over contiguous or
paged caches (``kernels/decode.cu``, host side in ``decode.py``), in the queries' dtype or in
float8_e4m3fn (``kernels/fp8.cuh``; compute capability 8.9 and newer). Attention on float8_e4m3fn
q, k and v (forward only) runs on compute capability 9.0, on wgmma's e4m3 products
(``kernels/forward_fp8_sm90.cu``); ``supports()`` says where it does not.

The backend takes torch tensors (``array_kind = "torch"``): CuPy has no bfloat16 dtype, so a
bfloat16 tensor cannot become a CuPy array, while a CuPy array becomes a torch tensor through
DLPack without a copy. The kernels read the tensors through their addresses and strides, and
run on the caller's stream: CuPy's current stream when the caller passed CuPy arrays.

Importing this module imports neither CuPy nor torch.
"""

from __future__ import annotations

import functools

import flashx
from flashx.hookspecs import hookimpl
from flashx.problem import FP8_CACHE_DTYPE

__version__ = "0.1.0"


class CupyBackend(flashx.Backend):
    name = "cupy"
    version = __version__
    array_kind = "torch"
    devices = frozenset({"cuda"})
    # FP8: float8_e4m3fn, for attention (forward only, wgmma: compute capability 9.0) and decoding's cache
    dtypes = frozenset({"float16", "bfloat16", "float32", FP8_CACHE_DTYPE})
    max_head_dim = 256
    features = frozenset({"causal", "window", "mask", "block_mask", "seqlens", "varlen", "dropout", "dropout_offsets",
                          "gqa", "dv_ne_d", "softcap", "alibi", "sinks"})
    deterministic_backward = True
    strided_arrays = frozenset({"mask", "block_mask"})  # read through their strides: a broadcast costs nothing

    def available(self) -> str | None:
        return unavailable_reason()

    def priority(self, problem) -> int:
        return 50  # below triton

    def extra_reasons(self, problem) -> list[str]:
        if problem.fp8_dtype == FP8_CACHE_DTYPE:  # the wgmma forward's terms (other FP8 dtypes: the base says why)
            from flashx_cupy import variants

            return variants.fp8_forward_reasons(problem, compute_capability(problem.device_index or 0))
        return []

    def decode_reasons(self, problem) -> list[str]:
        capability = compute_capability(problem.device_index or 0) if problem.fp8 else None
        if capability is not None and capability < 89:
            return [(f"reads a {problem.cache_dtype} cache with the e4m3 conversions of compute capability 8.9 and "
                     f"newer, not {capability // 10}.{capability % 10}")]
        return []

    def forward(self, problem, q, k, v):
        from flashx_cupy.launch import forward

        return forward(problem, q, k, v)

    def backward(self, problem, q, k, v, o, lse, do):
        from flashx_cupy.launch import backward

        return backward(problem, q, k, v, o, lse, do)

    def decode(self, problem, q, k_cache, v_cache, k_new, v_new):
        from flashx_cupy.decode import decode

        return decode(problem, q, k_cache, v_cache, k_new, v_new)

    def decode_splits(self, problem) -> int:
        """How many parts of each sequence's keys ``decode`` computes in parallel for ``problem``:
        its ``num_splits``, or this backend's own choice for ``num_splits=0`` on the problem's GPU."""
        from flashx_cupy import variants
        from flashx_cupy.decode import count_splits
        from flashx_cupy.launch import device_size

        variant = variants.choose_decode("decode", problem, aligned=True)  # alignment picks no tile
        return count_splits(problem, variant, *device_size(problem.device_index or 0))


@functools.cache
def compute_capability(device_index: int) -> int | None:
    """The compute capability of a GPU as one number (90 for 9.0), or None where CuPy cannot
    tell: then the backend is unavailable, and dispatch asks no more of it."""
    try:
        import cupy

        return int(cupy.cuda.Device(device_index).compute_capability)
    except (ImportError, RuntimeError):
        return None


def unavailable_reason() -> str | None:
    """None when the kernels can run here, else why not."""
    try:
        import cupy
        import torch
    except ImportError as error:
        return f"cannot import {error.name}: pip install 'flashx-attention[cupy]'"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as error:
        return f"CuPy sees no CUDA device ({error})"
    if count == 0:
        return "CuPy sees no CUDA device"
    if min(int(cupy.cuda.Device(i).compute_capability) for i in range(count)) < 80:
        return "needs compute capability 8.0 or newer (mma.sync bf16, cp.async)"
    return None


@hookimpl
def flashx_backends():
    return [CupyBackend()]
