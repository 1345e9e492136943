"""The wgmma forward's TMA copies of K and V: which problems take them, and their tensor maps.

flashx_forward_sm90 built with ``Variant.tma`` loads each key tile's K and V by TMA
(``kernels/tma.cuh``) from one producer thread, instead of cp.async from the producer's 128. A
tensor map describes each of K and V, (B, Nk, Hk, D) with any strides, as a rank-4 tensor
(head_dim, heads_k, seqlen_k, batch), innermost first; a box is 64 columns (128 bytes) of
BLOCK_N rows of one head, written in the 128-byte swizzle: one 64-column panel of the kernel's
Swizzle128 tile. Elements past the map land as zeros: the columns past the head dim, and rows
past seqlen_k (a sequence's last tile where seqlens shortens it is copied by cp.async instead).

The maps reach the kernel as its second parameter, ``KvMaps`` (``MAPS``): 128 bytes each, 64-byte
aligned in the kernel's parameter memory. They come from the driver (cuTensorMapEncodeTiled),
which CuPy does not expose: cuda-bindings calls it.
"""

from __future__ import annotations

import functools

import numpy as np

#: The layout of ``struct KvMaps`` (kernels/forward_sm90.cuh): two CUtensorMap, K's and V's.
MAPS = np.dtype([("k", np.uint64, (16,)), ("v", np.uint64, (16,))])
#: How a ``MAPS`` record travels to CuPy: as one opaque element (launch.OPAQUE says why).
OPAQUE = np.dtype((np.void, MAPS.itemsize))
#: A box's columns: 128 bytes of 16-bit elements, the 128-byte swizzle's span and a Swizzle128 panel.
BOX_COLUMNS = 64
#: What a global stride in bytes must divide by, and stay below.
STRIDE_ALIGNMENT, STRIDE_LIMIT = 16, 2**40


@functools.cache
def driver_present() -> bool:
    """Whether cuda-bindings, which encodes the maps, imports: the ``cupy`` extra installs it, but
    CuPy alone does not need it, and without it every problem keeps cp.async."""
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def usable(problem, *tensors) -> bool:
    """Whether TMA can copy the 16-bit (B, Nk, Hk, D) ``tensors`` (K and V) of ``problem``: not
    varlen (a packed tensor's sequences end inside the map, so each one's last tile would take
    cp.async, and nothing would be gained where sequences are short); base 16-byte aligned, unit
    feature stride, and each other dim of more than one element a positive multiple of 16 bytes
    apart, below 2**40 (a dim of one element is given a stride of its own, ``byte_strides``); no
    dim empty, which a map cannot describe; and cuda-bindings present (``driver_present``)."""
    if problem.varlen or problem.fp8 or problem.dtype == "float32" or not driver_present():
        return False
    for x in tensors:
        size = x.element_size()
        if x.numel() == 0 or x.data_ptr() % STRIDE_ALIGNMENT or (x.shape[-1] > 1 and x.stride(-1) != 1):
            return False
        for n, stride in zip(x.shape[:-1], x.stride()[:-1]):
            if n > 1 and not (stride > 0 and stride * size % STRIDE_ALIGNMENT == 0 and stride * size < STRIDE_LIMIT):
                return False
    return True


def byte_strides(x) -> tuple[int, ...]:
    """The strides in bytes of (B, Nk, Hk, D) ``x``'s heads, rows and sequences, the map's dims 1
    to 3. A dim of one element is never stepped along, whatever its stride: it takes the stride
    of a dense tensor there, a valid one."""
    size = x.element_size()
    dense = x.shape[-1] * size
    strides = []
    for n, stride in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):  # heads, rows, sequences
        strides.append(stride * size if n > 1 else -(-dense // STRIDE_ALIGNMENT) * STRIDE_ALIGNMENT)
        dense = strides[-1] * n
    return tuple(strides)


def arguments(x, rows: int) -> tuple:
    """What the tensor map of the 16-bit (B, Nk, Hk, D) tensor ``x`` describes, for ``encode``:
    its element type (the driver's name), address, dims and byte strides of the map's dims 1 to
    3, and the box, BOX_COLUMNS columns and ``rows`` rows of one head of one sequence."""
    batch, seqlen, heads, width = x.shape
    element = "BFLOAT16" if str(x.dtype).endswith("bfloat16") else "FLOAT16"
    return element, x.data_ptr(), (width, heads, seqlen, batch), byte_strides(x), (BOX_COLUMNS, 1, rows, 1)


@functools.lru_cache(maxsize=256)
def encode(arguments: tuple) -> tuple[int, ...]:
    """The tensor map of ``arguments`` as its 16 words: the one call of the driver, in the 128-byte
    swizzle with zeros past the map. Cached, as a call costs microseconds and a model's calls
    repeat their tensors."""
    from cuda.bindings import driver

    element, address, dims, strides, box = arguments
    result, tensor_map = driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{element}"),
        len(dims),
        address,
        [driver.cuuint64_t(n) for n in dims],
        [driver.cuuint64_t(s) for s in strides],
        [driver.cuuint32_t(n) for n in box],
        [driver.cuuint32_t(1)] * len(dims),  # every element of the box
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,  # zeros
    )
    if result != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cupy: cuTensorMapEncodeTiled failed ({result}) for {arguments}")
    return tuple(tensor_map.opaque)


def kv_maps(k, v, rows: int) -> np.ndarray:
    """A one-element ``MAPS`` array with K's and V's maps, boxes of ``rows`` rows."""
    maps = np.zeros(1, dtype=MAPS)
    maps["k"], maps["v"] = encode(arguments(k, rows)), encode(arguments(v, rows))
    return maps


def kernel_argument(variant, k, v) -> np.ndarray:
    """The wgmma forwards' ``KvMaps`` parameter for ``variant``: K's and V's maps where it loads
    them by TMA, else zeros, which it never reads."""
    maps = kv_maps(k, v, variant.block_n) if variant.tma else np.zeros(1, dtype=MAPS)
    return maps.view(OPAQUE)
