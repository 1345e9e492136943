"""What one thread does with tiles, shared by the kernels: loads, the two tile products, row
reductions across lanes, and bfloat16 conversions.

The thread layout: a block owns ``rows`` rows (queries; keys in the dK/dV kernel) and streams
tiles of ``cols`` rows of the other axis. Its threads form ``row_groups`` groups of ``lanes``
adjacent lanes. Thread (g, t) holds rows g + i * row_groups of every score tile, tile columns
t + j * lanes, and feature columns t + k * lanes of its accumulators. The lanes that share a
row are adjacent lanes of one warp, so a row reduces by xor shuffles among them.

Shared tiles are float32, row-major, one float longer than the widest head dim: a warp reading
down a column (rows g + i * row_groups, fixed d) meets a distinct bank in every row.

Each primitive has its CUDA form and, where the CUDA simulator could not run it or would take
minutes (it runs every CUDA thread as a Python thread), a NumPy form that computes the same
values for the same thread: the kernels around them, with all their indexing, masking and
online softmax, run unchanged in both.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda.core import config

#: Whether kernels run in the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) rather than on a GPU.
SIMULATOR = bool(config.ENABLE_CUDASIM)
FULL_MASK = 0xFFFFFFFF  # every lane of the warp takes part in a shuffle
_MICRO = 256  # the most tile or accumulator columns one thread holds (a whole head dim); unused ones vanish


def device_function(function):
    """A numba device function, inlined into its callers on the GPU (so that the thread-layout
    constants it receives fold, and its small arrays stay in registers). In the simulator, the
    Python function itself: the simulator's wrapper swaps module globals on every call, which
    made these small functions the larger part of its time (those it runs use no ``cuda.*``)."""
    if SIMULATOR:
        return function
    return cuda.jit(device=True, forceinline=True)(function)


# -- numbers -------------------------------------------------------------------------------

#: The P or dS written for a pair that adds nothing (disallowed, or dropped): -0.0. Its term is
#: skipped, not multiplied: 0 * NaN is NaN, and NaN or inf in data that only such pairs read
#: must not reach any output. An allowed pair's P is never -0.0 (exp() >= +0); its dS is where
#: P = 0, a term that adds 0 anyway unless the row's own data hold an infinity.
SKIP = np.float32(-0.0)
NEG_INF = np.float32(-np.inf)  # float32, so that no computation widens to float64


@device_function
def skipped(w):
    """Whether weight ``w`` is SKIP."""
    return w == 0 and math.copysign(1.0, w) < 0


@device_function
def max_nan(a, b):
    """max(a, b), NaN if either is NaN (the same on every lane, whichever holds the NaN)."""
    return a if (a > b or a != a) else b


if SIMULATOR:

    def float_from_bits(bits):
        """The float32 whose bit pattern is the int32 ``bits``."""
        return np.int32(bits).view(np.float32)

    def bits_of_float(x):
        """The bit pattern of float32 ``x``, as uint32."""
        return np.float32(x).view(np.uint32)

    def exp2(x):
        """2^x."""
        return math.exp2(x)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import libdevice
    from numba.cuda.extending import intrinsic

    @intrinsic
    def exp2(typingctx, x):
        """2^x of float32 x by the hardware's approximation, results below 2^-126 flushed to 0
        (``math.exp2`` adds a rescaling of those: three instructions more a call)."""

        def codegen(context, builder, signature, arguments):
            f32 = ir.FloatType()
            value = context.cast(builder, arguments[0], signature.args[0], types.float32)
            asm = ir.InlineAsm(ir.FunctionType(f32, [f32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f")
            return builder.call(asm, [value])

        return types.float32(x), codegen

    @device_function
    def float_from_bits(bits):
        """The float32 whose bit pattern is the int32 ``bits``."""
        return libdevice.int_as_float(bits)

    @device_function
    def bits_of_float(x):
        """The bit pattern of float32 ``x``, as uint32."""
        return np.uint32(libdevice.float_as_int(x))


@device_function
def bits_to_float(bits):
    """A bfloat16, held as its int16 bit pattern, as float32 (exact)."""
    return float_from_bits(np.int32((np.int32(bits) & np.int32(0xFFFF)) << np.int32(16)))


@device_function
def float_to_bits(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), as its int16 bit pattern;
    NaN stays NaN, and values past the largest bfloat16 round to infinity."""
    if x != x:
        return np.int16(0x7FC0)
    bits = np.uint64(bits_of_float(x))
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return np.int16(np.int64(rounded) - np.int64(0x10000) if rounded >= np.uint64(0x8000) else np.int64(rounded))


@device_function
def load(x, b, row, h, d, bf16):
    """Element x[b, row, h, d] as float32 (``bf16``: x holds bfloat16 bit patterns)."""
    if bf16:
        return bits_to_float(x[b, row, h, d])
    return np.float32(x[b, row, h, d])


@device_function
def store(x, b, row, h, d, value, bf16):
    """x[b, row, h, d] = value, rounded to x's dtype (``bf16``: bfloat16 bit patterns)."""
    if bf16:
        x[b, row, h, d] = float_to_bits(value)
    else:
        x[b, row, h, d] = value


# -- tiles ---------------------------------------------------------------------------------

if SIMULATOR:

    def load_tile(tile, x, b, row0, rows, h, width, tid, threads, bf16):
        """tile[r, :width] = x[b, row0 + r, h, :width] for r < rows, and 0 in the tile's other rows.

        One thread copies with NumPy; the kernel's next syncthreads publishes the tile."""
        if tid != 0:
            return
        rows = max(0, min(rows, tile.shape[0]))
        block = np.asarray(x[b, row0 : row0 + rows, h, :width])
        tile[:rows, :width] = (block.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if bf16 else block
        tile[rows:, :width] = 0

    def scores(registers, a, b, width, g, t, row_groups, lanes):
        """registers[i, j] = sum over d < width of a[g + i * row_groups, d] * b[t + j * lanes, d].

        Summed in float64 and rounded once: the same value whichever operand comes first, as
        the float32 FMA chain of the CUDA form is, so the backward's scores equal the forward's."""
        tm, tn = registers.shape
        rows_a = a[g :: row_groups][:tm, :width].astype(np.float64)
        rows_b = b[t :: lanes][:tn, :width].astype(np.float64)
        registers[:, :] = rows_a @ rows_b.T

    def to_shared(out, registers, g, t, row_groups, lanes):
        """out[g + i * row_groups, t + j * lanes] = registers[i, j]."""
        tm, tn = registers.shape
        out[g :: row_groups, t :: lanes][:tm, :tn] = registers

    def accumulate(acc, w, values, width, g, t, row_groups, lanes):
        """acc[i, k] += sum over c of w[g + i * row_groups, c] * values[c, t + k * lanes], for
        feature columns t + k * lanes < width; terms whose weight is SKIP add nothing."""
        weights = w[g :: row_groups][: acc.shape[0], : values.shape[0]]
        columns = values[:, t:width:lanes]
        kept = ~(np.signbit(weights) & (weights == 0))
        with np.errstate(invalid="ignore", over="ignore"):  # SKIP x (NaN or inf), discarded by the where
            terms = np.where(kept[:, :, None], weights[:, :, None] * columns[None, :, :], np.float32(0))
        acc[:, : columns.shape[1]] += terms.sum(axis=1)

    def lanes_max(x, lanes):
        """The NaN-propagating maximum of x over the ``lanes`` lanes of a row (1 here: see
        ``simulator_tiles``: the simulator has no warp shuffles)."""
        assert lanes == 1, "the CUDA simulator has no warp shuffles: simulator tiles keep a row in one thread"
        return x

    def lanes_sum(x, lanes):
        """The sum of x over the ``lanes`` lanes of a row (1 here, as in ``lanes_max``)."""
        assert lanes == 1, "the CUDA simulator has no warp shuffles: simulator tiles keep a row in one thread"
        return x

else:

    @device_function
    def load_tile(tile, x, b, row0, rows, h, width, tid, threads, bf16):
        """tile[r, :width] = x[b, row0 + r, h, :width] for r < rows, and 0 in the tile's other rows.

        A warp copies a row at a time, its lanes along the row: global reads coalesce and
        shared writes meet distinct banks."""
        row_lanes = min(32, threads)
        for r in range(tid // row_lanes, tile.shape[0], threads // row_lanes):
            inside = r < rows
            for d in range(tid % row_lanes, width, row_lanes):
                tile[r, d] = load(x, b, row0 + r, h, d, bf16) if inside else np.float32(0)

    @device_function
    def scores(registers, a, b, width, g, t, row_groups, lanes):
        """registers[i, j] = sum over d < width of a[g + i * row_groups, d] * b[t + j * lanes, d],
        for this thread's i < registers.shape[0], j < registers.shape[1]: a float32 FMA chain in
        the order of d."""
        column = cuda.local.array(_MICRO, np.float32)
        for i in range(registers.shape[0]):
            for j in range(registers.shape[1]):
                registers[i, j] = 0
        for d in range(width):
            for j in range(registers.shape[1]):
                column[j] = b[t + j * lanes, d]
            for i in range(registers.shape[0]):
                x = a[g + i * row_groups, d]
                for j in range(registers.shape[1]):
                    registers[i, j] += x * column[j]

    @device_function
    def to_shared(out, registers, g, t, row_groups, lanes):
        """out[g + i * row_groups, t + j * lanes] = registers[i, j] (where the kernels' elementwise
        passes index them freely; indexed so, a local array would leave the registers)."""
        for i in range(registers.shape[0]):
            for j in range(registers.shape[1]):
                out[g + i * row_groups, t + j * lanes] = registers[i, j]

    @device_function
    def accumulate(acc, w, values, width, g, t, row_groups, lanes):
        """acc[i, k] += sum over c of w[g + i * row_groups, c] * values[c, t + k * lanes]; terms
        whose weight is SKIP add nothing. Columns t + k * lanes >= width accumulate values of
        no meaning, which are never stored."""
        row = cuda.local.array(_MICRO, np.float32)
        for c in range(values.shape[0]):
            for k in range(acc.shape[1]):
                row[k] = values[c, t + k * lanes]
            for i in range(acc.shape[0]):
                weight = w[g + i * row_groups, c]
                if not skipped(weight):
                    for k in range(acc.shape[1]):
                        acc[i, k] += weight * row[k]

    @device_function
    def lanes_max(x, lanes):
        """The NaN-propagating maximum of x over the ``lanes`` adjacent lanes of a row."""
        offset = 1
        while offset < lanes:
            x = max_nan(x, cuda.shfl_xor_sync(FULL_MASK, x, offset))
            offset *= 2
        return x

    @device_function
    def lanes_sum(x, lanes):
        """The sum of x over the ``lanes`` adjacent lanes of a row (every lane gets the same bits)."""
        offset = 1
        while offset < lanes:
            x += cuda.shfl_xor_sync(FULL_MASK, x, offset)
            offset *= 2
        return x
