"""What one thread does with tiles, shared by the kernels: loads, the two tile products, row
reductions across lanes, and bfloat16 conversions.

The thread layout: a block owns ``rows`` rows (queries; keys in the dK/dV kernel) and streams
tiles of ``cols`` rows of the other axis. Its threads form ``row_groups`` groups of ``lanes``
adjacent lanes. Thread (g, t) holds rows g + i * row_groups of every score tile, tile columns
t + j * lanes, and of its accumulators the features ``feature(t, k, lanes)``: runs of four
adjacent features, run t + m * lanes for its k = 4 m to 4 m + 3. The lanes that share a row
are adjacent lanes of one warp, so a row reduces by xor shuffles among them.

The products hold a thread's operands in registers (register blocking): per four features
(scores) or four streamed rows (P V), one 16-byte load of each held row of either operand, and
an FMA for every pair of them. Shared tiles are float32, row-major, their rows padded to a
multiple of 16 bytes that is 16 more than a multiple of 128: the eight lanes of a quarter warp
read eight adjacent rows at one offset (scores), or 128 contiguous bytes of one row (P V), from
distinct banks, and the lanes of a row group read the same words of its rows (a broadcast).
P's rows are 16 bytes longer than a tile's columns: the row groups of a warp read it at one
offset from distinct banks.
Addresses are 32-bit shared-window addresses, one a tile and thread, and every load lies a
compile-time offset from it.

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
#: Features a step of the score products reads (two 16-byte loads a held row): tiles hold zeros
#: from the head dim on to their width, a multiple of it.
STEP = 8


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
#: must not reach any output. An allowed pair's P is never -0.0 (exp() >= +0), nor its dS, which
#: would be where P = 0 and dP < delta: the kernels add +0 to it, so that an infinity in the
#: row's own data still gives NaN (``kernels.gradient_pair``, ``score_mods.through_softcap``).
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
def load_element(line, d, bf16):
    """Element d of the row ``line`` of a tensor as float32 (``bf16``: bfloat16 bit patterns)."""
    if bf16:
        return bits_to_float(line[d])
    return np.float32(line[d])


@device_function
def store(x, b, row, h, d, value, bf16):
    """x[b, row, h, d] = value, rounded to x's dtype (``bf16``: bfloat16 bit patterns)."""
    if bf16:
        x[b, row, h, d] = float_to_bits(value)
    else:
        x[b, row, h, d] = value


# -- tiles ---------------------------------------------------------------------------------


@device_function
def feature(t, k, lanes):
    """The feature of accumulator column k of a thread of lane t in its row group."""
    return 4 * (t + k // 4 * lanes) + k % 4


if SIMULATOR:

    def load_tile(tile, x, b, row0, rows, h, width, filled, tid, threads, bf16):
        """tile[r, :filled] = x[b, row0 + r, h, :width] for r < rows, zeros past ``width``, and 0
        in the tile's other rows.

        One thread copies with NumPy; the kernel's next syncthreads publishes the tile."""
        if tid != 0:
            return
        rows = max(0, min(rows, tile.shape[0]))
        tile[:rows, :width] = _floats(x[b, row0 : row0 + rows, h, :width], bf16)
        tile[rows:, :width] = 0
        tile[:, width:filled] = 0

    def gather_tile(tile, x, where, width, filled, tid, threads, bf16):
        """tile[r, :filled] = x[where[r, 0], where[r, 1], where[r, 2], :width], zeros past
        ``width``, for the rows r with where[r, 0] >= 0; 0 in the tile's other rows.

        One thread copies with NumPy, as ``load_tile``."""
        if tid != 0:
            return
        used = np.flatnonzero(where[: tile.shape[0], 0] >= 0)
        tile[:, :filled] = 0
        rows = where[used]
        tile[used, :width] = _floats(x[rows[:, 0], rows[:, 1], rows[:, 2], :width], bf16)

    def _floats(block, bf16):
        """A block of x as float32 (``bf16``: x holds bfloat16 bit patterns)."""
        block = np.asarray(block)
        return (block.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if bf16 else block

    def has_nonfinite_floats(tile, width, tid, threads):
        """Whether this thread's share of ``tile`` holds a NaN or an infinity: never asked here,
        ``accumulate`` skips terms itself."""
        return False

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

    def accumulate(acc, w, values, width, g, t, row_groups, lanes, exact):
        """acc[i, k] += sum over c of w[g + i * row_groups, c] * values[c, feature(t, k, lanes)],
        for features below width; terms whose weight is SKIP add nothing (whatever ``exact``)."""
        weights = w[g :: row_groups][: acc.shape[0], : values.shape[0]]
        held = np.array([feature(t, k, lanes) for k in range(acc.shape[1])])
        inside = held < width
        columns = values[:, held[inside]]
        kept = ~(np.signbit(weights) & (weights == 0))
        with np.errstate(invalid="ignore", over="ignore"):  # SKIP x (NaN or inf), discarded by the where
            terms = np.where(kept[:, :, None], weights[:, :, None] * columns[None, :, :], np.float32(0))
        acc[:, inside] += terms.sum(axis=1)

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

    from flashx_numba.mma import micro_tile_intrinsics

    shared_address, shared_quad = micro_tile_intrinsics()

    @device_function
    def load_tile(tile, x, b, row0, rows, h, width, filled, tid, threads, bf16):
        """tile[r, :filled] = x[b, row0 + r, h, :width] for r < rows, zeros past ``width``, and 0
        in the tile's other rows.

        A warp copies a row at a time, its lanes along the row: global reads coalesce and
        shared writes meet distinct banks. The trip counts are compile-time constants, and a
        lane's loads in a row lie at constant multiples of the feature stride from its first."""
        row_lanes = min(32, threads)
        passes = threads // row_lanes  # rows copied at once
        first, lane = tid // row_lanes, tid % row_lanes
        for k in range(tile.shape[0] // passes):
            r = first + k * passes
            copy_row(tile, r, x[b, row0 + r, h, lane:], r < rows, lane, row_lanes, width, filled, bf16)

    @device_function
    def gather_tile(tile, x, where, width, filled, tid, threads, bf16):
        """tile[r, :filled] = x[where[r, 0], where[r, 1], where[r, 2], :width], zeros past
        ``width``, for the rows r with where[r, 0] >= 0; 0 in the tile's other rows.

        ``load_tile``'s copy, each row found through ``where`` (a shared array the block wrote
        before its last barrier): rows of a paged cache, or query rows of several heads."""
        row_lanes = min(32, threads)
        passes = threads // row_lanes
        first, lane = tid // row_lanes, tid % row_lanes
        for k in range(tile.shape[0] // passes):
            r = first + k * passes
            inside = where[r, 0] >= 0
            line = x[max(where[r, 0], 0), where[r, 1], where[r, 2], lane:]
            copy_row(tile, r, line, inside, lane, row_lanes, width, filled, bf16)

    @device_function
    def copy_row(tile, r, line, inside, lane, row_lanes, width, filled, bf16):
        """This lane's features of tile row r from ``line`` (the source row from this lane's
        first feature on, read only where ``inside``), zeros past ``width`` and where not inside."""
        for m in range(filled // row_lanes):
            d = lane + m * row_lanes
            inside_row = inside and d < width
            tile[r, d] = load_element(line, np.uint64(m * row_lanes), bf16) if inside_row else np.float32(0)

    @device_function
    def has_nonfinite_floats(tile, width, tid, threads):
        """Whether this thread's share of the first ``width`` columns of ``tile`` holds a NaN or an infinity."""
        seen = np.uint32(0)
        for index in range(tid, tile.shape[0] * width, threads):
            x = tile[index // width, index % width]
            seen |= np.uint32(x - x != 0)
        return seen != 0

    @device_function
    def scores(registers, a, b, width, g, t, row_groups, lanes):
        """registers[i, j] = sum over d < width of a[g + i * row_groups, d] * b[t + j * lanes, d],
        for this thread's i < registers.shape[0], j < registers.shape[1]: a float32 FMA chain in
        the order of d, ``STEP`` features a step from registers."""
        held_a = cuda.local.array((_MICRO, STEP), np.float32)
        held_b = cuda.local.array((_MICRO, STEP), np.float32)
        for i in range(registers.shape[0]):
            for j in range(registers.shape[1]):
                registers[i, j] = 0
        a_address, b_address = shared_address(a, g, 0), shared_address(b, t, 0)
        a_rows, b_rows = 4 * row_groups * a.shape[1], 4 * lanes * b.shape[1]  # bytes between held rows
        for d0 in range(0, width, STEP):
            a_step, b_step = a_address + np.uint32(4 * d0), b_address + np.uint32(4 * d0)
            for i in range(registers.shape[0]):
                for q in range(0, STEP, 4):
                    held_a[i, q], held_a[i, q + 1], held_a[i, q + 2], held_a[i, q + 3] = shared_quad(
                        a_step, i * a_rows + 4 * q)
            for j in range(registers.shape[1]):
                for q in range(0, STEP, 4):
                    held_b[j, q], held_b[j, q + 1], held_b[j, q + 2], held_b[j, q + 3] = shared_quad(
                        b_step, j * b_rows + 4 * q)
            for d in range(STEP):
                for i in range(registers.shape[0]):
                    for j in range(registers.shape[1]):
                        registers[i, j] += held_a[i, d] * held_b[j, d]

    @device_function
    def to_shared(out, registers, g, t, row_groups, lanes):
        """out[g + i * row_groups, t + j * lanes] = registers[i, j] (where the kernels' elementwise
        passes index them freely; indexed so, a local array would leave the registers)."""
        for i in range(registers.shape[0]):
            for j in range(registers.shape[1]):
                out[g + i * row_groups, t + j * lanes] = registers[i, j]

    @device_function
    def accumulate(acc, w, values, width, g, t, row_groups, lanes, exact):
        """acc[i, k] += sum over c of w[g + i * row_groups, c] * values[c, feature(t, k, lanes)];
        where ``exact``, terms whose weight is SKIP add nothing (a tile without SKIP weights, or
        whose values are all finite, multiplies without the tests: SKIP x finite adds -0 or +0).
        Columns of features >= width accumulate values of no meaning, which are never stored."""
        if exact:
            weighted_rows(acc, w, values, g, t, row_groups, lanes, True)
        else:
            weighted_rows(acc, w, values, g, t, row_groups, lanes, False)

    @device_function
    def weighted_rows(acc, w, values, g, t, row_groups, lanes, skipping):
        """``accumulate``, four streamed rows a step: one 16-byte load of the four weights of each
        held row, and of each run of four features of each streamed row."""
        weights = cuda.local.array((_MICRO, 4), np.float32)
        row = cuda.local.array(_MICRO, np.float32)
        w_address, v_address = shared_address(w, g, 0), shared_address(values, 0, 4 * t)
        w_rows, v_row = 4 * row_groups * w.shape[1], 4 * values.shape[1]  # bytes between held, streamed rows
        for c0 in range(0, values.shape[0], 4):
            w_step, v_step = w_address + np.uint32(4 * c0), v_address + np.uint32(c0 * v_row)
            for i in range(acc.shape[0]):
                weights[i, 0], weights[i, 1], weights[i, 2], weights[i, 3] = shared_quad(w_step, i * w_rows)
            for c in range(4):
                for k in range(0, acc.shape[1], 4):
                    row[k], row[k + 1], row[k + 2], row[k + 3] = shared_quad(v_step, c * v_row + 4 * k * lanes)
                for i in range(acc.shape[0]):
                    weight = weights[i, c]
                    if not (skipping and skipped(weight)):
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
