"""The host side: tile shapes, arrays handed to the kernels without copies, launches on the caller's stream.

torch tensors reach numba through ``__cuda_array_interface__`` (``cuda.as_cuda_array``, which
shares memory); bfloat16, which numba's arrays lack, travels as an int16 view of the same
memory. Kernels launch on torch's current stream of the tensors' device
(``cuda.external_stream``), and nothing here synchronizes.

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the tensors are CPU tensors and their NumPy
views go in; the simulator copies its arguments in and out, and takes only contiguous or
broadcast ones.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys

import numpy as np
import torch
from numba import cuda

from flashx.backend import weightless_rows_as_plus_inf
from flashx_numba.kernels import Tiles, delta_kernel, dkdv_kernel, dq_kernel, forward_kernel
from flashx_numba.primitives import SIMULATOR

# Tile shapes on a GPU, by kernel and head-dim class (the widest of D and Dv, rounded up to 64,
# 128 or 256): (rows, cols, row_groups, lanes), micro-tiles with float32 shared tiles, and
# (rows, cols) of the kernels on tensor cores (a warp per 16 rows; packed half tiles). All fit
# the 48 KiB a block may hold statically.
GPU_TILES = {
    "forward": {64: (64, 32, 16, 8), 128: (32, 16, 8, 8), 256: (16, 8, 8, 8)},
    "backward": {64: (32, 32, 8, 8), 128: (16, 16, 8, 8), 256: (8, 8, 4, 8)},
}  # decoding's split kernel has a shape of its own (``decode.split_shape``)
TENSOR_CORE_TILES = {
    "forward": {64: (64, 64), 128: (64, 64), 256: (32, 32)},
    # Two warps: a backward block holds one operand of its own rows in registers, the other
    # and four streamed tiles (two tensors in both layouts) in shared memory. At d256 the dK
    # and dV accumulators alone would take every register of a thread: micro-tiles there.
    "backward": {64: (32, 32), 128: (32, 32)},
}
# In the simulator every CUDA thread is a Python thread and every syncthreads a round of
# thread switches: one thread a block, large tiles, each tile operation one NumPy call. With
# two threads a block the simulator once returned garbage in one dK element of 243 cases
# (not reproduced since, cause unknown); one thread leaves it nothing to interleave. The
# cooperative loads and barriers of the CUDA forms are checked on the GPU.
SIMULATOR_TILES = (32, 32, 1, 1)
# The simulator's block manager polls its threads: with Python's default 5 ms switch interval
# a syncthreads costs ~10-20 ms, with 0.1 ms under 1 ms.
SIMULATOR_SWITCH_INTERVAL = 1e-4
DELTA_THREADS = 128


def tensor_cores(kernel: str, problem) -> bool:
    """Whether ``kernel`` (forward or backward) runs on tensor cores: float16 and bfloat16 on a GPU,
    at the head dims it has tensor-core tiles for."""
    return (not SIMULATOR and problem.dtype in ("float16", "bfloat16")
            and problem.head_dim_class in TENSOR_CORE_TILES.get(kernel, ()))


def tiles(kernel: str, problem) -> Tiles:
    width = problem.head_dim_class
    if tensor_cores(kernel, problem):
        rows, cols = TENSOR_CORE_TILES[kernel][width]
        return Tiles(rows, cols, rows // 16, 32, width)
    rows, cols, row_groups, lanes = SIMULATOR_TILES if SIMULATOR else GPU_TILES[kernel][width]
    return Tiles(rows, cols, row_groups, lanes, width)


def score_mods(problem) -> bool:
    """Whether the scores take a softcap or ALiBi: kernels compiled with their code (``kernels``)."""
    return problem.softcap is not None or problem.alibi_slopes is not None


def forward(problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    dtype = q.dtype
    o = torch.empty(problem.o_shape, dtype=dtype, device=q.device)
    lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=q.device)
    if problem.varlen:  # rows after the last sequence belong to none: empty rows (lse: the sink's, or -inf)
        o.zero_()
        lse[...] = -math.inf if problem.sinks is None else problem.sinks[:, None]
    shape, fragments = tiles("forward", problem), tensor_cores("forward", problem)
    kernel = forward_kernel(shape, problem.dtype, fragments, score_mods(problem))
    blocks = -(-problem.seqlen_q // shape.rows) * problem.batch * problem.heads_q
    inputs = [_pairs(x) for x in (q, k, v)] if fragments else (q, k, v)
    with _launching(q) as stream:
        _launch(kernel, blocks, shape.threads, stream, *_rows(problem, *inputs, o), _lse(problem, lse),
                *_arguments(problem))
    return o, lse


def backward(problem, q, k, v, o, lse, do):
    """(dq, dk, dv), and dsinks with sinks: the dQ kernel's term of each row (0 for a row without
    an allowed key), summed over sequences and rows by torch (a reduction without atomics: the
    same bits every run)."""
    make = torch.zeros if problem.varlen else torch.empty  # varlen: rows after the last sequence get 0
    dq, dk, dv = (make(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    delta = torch.empty(problem.lse_shape, dtype=torch.float32, device=q.device)
    sinks = problem.sinks is not None
    terms_shape = problem.lse_shape if sinks else (1,) * len(problem.lse_shape)  # a placeholder without sinks
    sink_terms = torch.zeros(terms_shape, dtype=torch.float32, device=q.device)
    arguments = _arguments(problem)
    shape, fragments, mods = tiles("backward", problem), tensor_cores("backward", problem), score_mods(problem)
    inputs = [_pairs(x) for x in (q, k, v, do)] if fragments else (q, k, v, do)
    q_, k_, v_, do_ = _rows(problem, *inputs)
    o_, do_stored, dq_, dk_, dv_ = _rows(problem, o, do, dq, dk, dv)
    lse_, delta_, sink_terms_ = (_lse(problem, x) for x in (weightless_rows_as_plus_inf(lse), delta, sink_terms))
    with _launching(q) as stream:
        rows = o.shape[0] * o.shape[1] * o.shape[2]
        _launch(delta_kernel(problem.dtype), -(-rows // DELTA_THREADS), DELTA_THREADS, stream, o_, do_stored, delta_,
                problem.head_dim_v)
        _launch(dkdv_kernel(shape, problem.dtype, fragments, mods),
                -(-problem.seqlen_k // shape.rows) * problem.batch * problem.heads_k, shape.threads, stream, q_, k_, v_,
                do_, lse_, delta_, dk_, dv_, *arguments)
        _launch(dq_kernel(shape, problem.dtype, fragments, mods, sinks),
                -(-problem.seqlen_q // shape.rows) * problem.batch * problem.heads_q, shape.threads, stream, q_, k_, v_,
                do_, lse_, delta_, dq_, sink_terms_, *arguments)
    if not sinks:
        return dq, dk, dv
    by_head = sink_terms.unsqueeze(0) if problem.varlen else sink_terms  # (B, Hq, N)
    return dq, dk, dv, by_head.sum(dim=(0, 2))


def _launch(kernel, blocks: int, threads: int, stream, *arguments):
    if blocks:  # a varlen batch of empty sequences has no tile
        kernel[blocks, threads, stream](*arguments)


@contextlib.contextmanager
def _launching(x: torch.Tensor):
    """The stream to launch on: torch's current stream of x's device, that device current."""
    if SIMULATOR:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL)
        try:
            yield 0
        finally:
            sys.setswitchinterval(interval)
        return
    with cuda.gpus[x.device.index]:
        yield cuda.external_stream(torch.cuda.current_stream(x.device).cuda_stream)


#: Features of one 16-byte copy into shared memory (the tensor-core kernels' loads).
COPY_FEATURES = 8


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """A float16 or bfloat16 tensor as int32 words, each two adjacent features (the tensor-core
    kernels' operands), whose rows start on 16 bytes and hold whole 16-byte copies: a view where
    the last axis is contiguous and the head dim, every other stride and the address allow it,
    else a copy, the head dim padded with zero features."""
    dim = x.shape[-1]
    viewable = x.stride(-1) == 1 and all(st % COPY_FEATURES == 0 for st in (dim, *x.stride()[:-1]))
    if not (viewable and x.data_ptr() % 16 == 0):
        padded = torch.zeros((*x.shape[:-1], -(-dim // COPY_FEATURES) * COPY_FEATURES), dtype=x.dtype,
                             device=x.device)
        padded[..., :dim] = x
        x = padded
    return x.view(torch.int32)


def _device_array(x: torch.Tensor):
    """x as an array the kernels take, sharing its memory (bfloat16 as int16 bit patterns, int32
    words of pairs as they are).

    Autograd's tensors arrive as they are (the core resolved torch's lazy negation already)."""
    x = x.detach()
    if x.dtype == torch.bfloat16:
        x = x.view(torch.int16)
    if SIMULATOR:
        broadcast = 0 in x.stride()
        return (x if broadcast or x.is_contiguous() else x.contiguous()).numpy()
    return cuda.as_cuda_array(x, sync=False)


def _rows(problem, *xs):
    """(B, N, H, D) arrays of q, k, v, o and their gradients: varlen (T, H, D) as (1, T, H, D)."""
    return [_device_array(x.unsqueeze(0) if problem.varlen else x) for x in xs]


def _lse(problem, x):
    """lse, delta or the dsinks terms as a contiguous (B, H, N) array: varlen (H, T) as (1, H, T)."""
    return _device_array((x.unsqueeze(0) if problem.varlen else x).contiguous())


def _arguments(problem) -> tuple:
    """The kernels' arguments after their arrays (see ``kernels``), placeholders for absent arrays."""
    device = torch.device(problem.device, problem.device_index)
    index, flag, reals = _placeholders(device)
    shape = (problem.batch, problem.heads_q)
    mask = blocks = flag
    slopes, sinks = reals, reals[0]
    block_q = block_k = 1
    if problem.mask is not None:
        mask = _broadcast(problem.mask, (*shape, problem.seqlen_q, problem.seqlen_k))
    if problem.block_mask is not None:
        block_q, block_k = problem.block_mask.block_size
        blocks = _broadcast(problem.block_mask.blocks,
                            (*shape, -(-problem.seqlen_q // block_q), -(-problem.seqlen_k // block_k)))
    if problem.alibi_slopes is not None:
        slopes = _broadcast(problem.alibi_slopes, shape)
    if problem.sinks is not None:
        sinks = problem.sinks
    reach = problem.seqlen_q + problem.seqlen_k + 1  # an unbounded side of the band: beyond any length
    left, right = (reach if side == -1 else side for side in (problem.band or (-1, -1)))
    lengths = (problem.cu_seqlens_q, problem.cu_seqlens_k, problem.seqlens_q, problem.seqlens_k)
    return (
        *(_device_array(index if x is None else x.to(torch.int32)) for x in lengths),
        _device_array(mask), _device_array(blocks),
        problem.seqlen_q, problem.seqlen_k, problem.heads_q, problem.group, problem.head_dim, problem.head_dim_v,
        problem.varlen, problem.seqlens_q is not None, problem.seqlens_k is not None, problem.mask is not None,
        problem.block_mask is not None, block_q, block_k, left, right, np.float32(problem.softmax_scale),
        problem.dropout_p > 0, problem.dropout_threshold, *problem.seed_words, problem.rng_offset_words[0],
        np.float32(problem.dropout_scale), *problem.dropout_offsets,
        np.float32(problem.softcap or 0), _device_array(slopes), problem.alibi_slopes is not None, _device_array(sinks),
        problem.sinks is not None,
    )


def _broadcast(x: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A view of x broadcast to ``shape`` (zero strides: no copy)."""
    return (x.contiguous() if SIMULATOR else x).expand(shape)


@functools.cache
def _placeholders(device: torch.device):
    """Arrays passed for absent options (never read): an int32 index, a bool (1, 1, 1, 1) flag
    and float32 (1, 1) reals (slopes; a row of them for sinks)."""
    return (torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=device),
            torch.zeros((1, 1), dtype=torch.float32, device=device))
