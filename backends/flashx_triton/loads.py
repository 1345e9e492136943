"""Copies of rows into tiles: through TMA descriptors (built on the host, or in the kernel) or
plain loads, and what the host checks of a tensor's layout for them.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from flashx_triton.arguments import tile_widths


@triton.jit
def load_rows(desc, base, seq, seq_start, head, start, stride, used, WIDTH: tl.constexpr, ROWS: tl.constexpr,
              COLS: tl.constexpr, USE_TMA: tl.constexpr, MASKED: tl.constexpr, ZERO_UNUSED: tl.constexpr = True,
              HOST_DESCRIPTORS: tl.constexpr = True, col_stride=1):
    """Rows [start, start + ROWS) of one head's (length, WIDTH) matrix, zero past WIDTH and, in
    masked tiles, in rows not ``used``.

    ``base`` points at the head's first row of the sequence. Through TMA, ``desc`` reads the
    same rows, zero past WIDTH: a host descriptor (``row_descriptor``) at (seq, seq_start +
    start, head), zero past the tensor's rows; one built in the kernel (``head_descriptors``) at
    row ``start``, zero past the sequence. With ZERO_UNUSED False unused rows stay as they are
    (the backward, whose masked_dot sees any non-finite value in them through the score
    products). Through pointers the columns lie ``col_stride`` apart: 1, or the length of a tensor
    whose rows are contiguous (FP8's V, ``flashx_triton.fp8.keys_contiguous``)."""
    if USE_TMA:
        if HOST_DESCRIPTORS:
            tile = desc.load([seq, seq_start + start, head, 0]).reshape(ROWS, COLS)
        else:
            tile = desc.load([start, 0])
        if MASKED and ZERO_UNUSED:
            tile = tl.where(used[:, None], tile, 0.0)
    else:
        rows = tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        ptrs = base + tl.cast(start, tl.int64) * stride + rows[:, None] * stride + cols[None, :] * col_stride
        if MASKED:
            tile = tl.load(ptrs, mask=used[:, None] & (cols[None, :] < WIDTH), other=0.0)
        else:
            tile = tl.load(ptrs, mask=cols[None, :] < WIDTH, other=0.0)
    return tile


@triton.jit
def head_descriptors(host_a, host_b, base_a, base_b, length, stride_a, stride_b, WIDTH_A: tl.constexpr,
                     WIDTH_B: tl.constexpr, ROWS: tl.constexpr, COLS_A: tl.constexpr, COLS_B: tl.constexpr,
                     USE_TMA: tl.constexpr, HOST_DESCRIPTORS: tl.constexpr):
    """The descriptors of two streamed operands: the host's (``row_descriptor``), or built here
    over one head's ``length`` rows from ``base_a`` and ``base_b``."""
    if USE_TMA and not HOST_DESCRIPTORS:
        return (tl.make_tensor_descriptor(base_a, [length, WIDTH_A], [stride_a, 1], [ROWS, COLS_A]),
                tl.make_tensor_descriptor(base_b, [length, WIDTH_B], [stride_b, 1], [ROWS, COLS_B]))
    else:
        return host_a, host_b


def row_descriptors(x: torch.Tensor, varlen: bool, rows: int, cols: int, use_tma: bool):
    """The host-side TMA descriptor, one head's (rows, cols) tile at a time, of a (B, N, H, D) or
    varlen (T, H, D) tensor laid out as ``x``, as a function of the tensor; without TMA, the
    tensor itself (the kernels then read through pointers and never touch this argument).

    Built on the host, a descriptor reaches every program as a kernel parameter, where one
    built in the kernel costs each program a global write and a fence. Its per-head axes make
    TMA zero-fill past D and past the padded length; rows past a shorter sequence inside the
    tensor (seqlens, varlen) are read and then masked, as ``load_rows`` says.

    The descriptor is checked once, on ``x``; each call's copy only takes the new tensor as its
    base, which Triton reads for its address and dtype (a check costs microseconds of host time,
    and a forward and backward pass six descriptors). A tensor of the same layout (``layout``)
    passes the same checks.
    """
    if not use_tma:
        return _same
    from triton.tools.tensor_descriptor import TensorDescriptor

    view = x.unsqueeze(0) if varlen else x
    checked = TensorDescriptor(view, list(view.shape), [*view.stride()[:-1], 1], [1, rows, 1, cols])
    fields = {**vars(checked), "base": None}  # no tensor kept alive by the cache

    def descriptor(y: torch.Tensor):
        make_context_current(y)
        copy = TensorDescriptor.__new__(TensorDescriptor)
        copy.__dict__.update(fields)  # then the base alone: no keyword dict made per call
        copy.base = y
        return copy

    return descriptor


def _same(x):
    return x


def tma_ready(problem, *tensors: torch.Tensor) -> bool:
    """Whether the streamed operands load through TMA descriptors.

    TMA needs 16-byte aligned bases and leading strides. The K and V (Q and dO) tiles must be
    equally wide as well, a precaution: unequal tiles through TMA passed where checked (64/128,
    128/64), but not every unequal class (D = 192, Dv = 128 among them) has run so on a GPU.
    """
    widths = tile_widths(problem.head_dim, problem.head_dim_v)
    return widths["BLOCK_D"] == widths["BLOCK_DV"] and all(
        x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1]) for x in tensors
    )


def allow_kernel_descriptors(x: torch.Tensor) -> None:
    """Give Triton the scratch memory that descriptors built in a kernel (``head_descriptors``)
    are written to. Per call, not once: Triton keeps the allocator per thread, and autograd runs
    the backward on a thread of its own. The interpreter needs none."""
    if x.is_cuda:
        triton.set_allocator(_descriptor_scratch)


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


_thread = threading.local()


def make_context_current(x: torch.Tensor) -> None:
    """Bind x's device's CUDA context to this thread before a host TMA descriptor of x is launched.

    Triton encodes a host descriptor (``row_descriptors``) before its launcher makes a context
    current, and the encoding fails ("invalid device context") on a thread that has made
    no CUDA runtime call yet: a fresh worker thread whose tensors all come from torch's cache, or
    autograd's backward thread. Any runtime call binds the primary context; a stream query is a
    cheap one, and once per thread is enough.
    """
    if x.is_cuda and not getattr(_thread, "has_context", False):
        torch.cuda.current_stream(x.device).query()
        _thread.has_context = True


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def row_strides(x: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """The (batch, row, head) strides of a (B, N, H, D) or varlen (T, H, D) tensor."""
    return (0, *x.stride()[:2]) if varlen else tuple(x.stride()[:3])


def lse_strides(x: torch.Tensor, varlen: bool) -> dict:
    """stride_lb and stride_lh, the batch and head strides of an lse-shaped (B, H, N) or (H, T)
    tensor, rows contiguous: scalars of their own, as they follow the query length (``LENGTHS``)."""
    batch, head = (0, x.stride(0)) if varlen else (x.stride(0), x.stride(1))
    return {"stride_lb": batch, "stride_lh": head}
