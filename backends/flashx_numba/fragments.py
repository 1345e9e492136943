"""The kernels' two ways of holding a tile of scores: warp fragments on tensor cores (float16 and
bfloat16 on a GPU), and a register micro-tile per thread (float32, and every dtype in the
simulator). Each kernel is written once against either ``Form``; the names below are the
forward's (own rows Q, streamed K and V), and the backward kernels use the same products with
other operands (``kernels``).

A form says which score elements a thread holds: ``held_rows`` x ``held_cols`` registers, element
(i, c) being tile row ``row_of(tid, i)`` and column ``col_of(tid, c)``; its output accumulators
are ``held_rows`` x ``held_features`` registers, feature columns ``feature_of(tid, a)``. The
``row_lanes`` adjacent lanes that share a row reduce it by xor shuffles. And it says how tiles
are staged and multiplied:

- ``stage_queries(q_frag, q_tile, staging, q, b, row0, rows, h, dim, tid)``: Q, in registers
  (``q_frag``) or in shared memory (``q_tile``), staged through the key tile ``staging``;
- ``start_tile(tile, x, b, row0, rows, h, dim, tid)``: start loading rows of x (keys, values,
  or the backward's streamed rows) into a shared tile, zero past ``rows`` and the head dim;
  ``wait_tiles()`` waits for this thread's loads, and a barrier after it publishes the tile
  (the fragment form copies asynchronously, so a load may run beside a product; the micro-tile
  form loads at once). ``has_nonfinite(tile, tid)``: whether this thread's share of a loaded
  tile holds a NaN or an infinity (the forms' products skip no term unless ``exact``, see below);
- ``qk(s, q_frag, q_tile, k_tile, dim, tid)``: s = Q K^T of the thread's elements; and
  ``qk_shared(s, a_tile, k_tile, dim, tid)``: the same product with the own rows' operand in a
  shared tile of the key layout (the backward keeps its own operands there: the registers
  hold its accumulators);
- ``share_weights(p_tile, s, tid)``, then a barrier, then ``pv(acc, s, scratch, v_tile, p_tile,
  dim_v, tid, exact)``: acc += P V, the terms whose weight is SKIP left out where ``exact`` (a
  block-wide flag); ``scratch`` is a key-layout tile whose rows of this warp are free for the
  product's use. (The forms'
  CUDA-only code may call ``cuda`` functions; what the simulator runs may not: it swaps
  ``cuda`` in the kernels' module only.)

Fragments (``tensor_core_form``): 16 query rows a warp, the m16n8k16 layout of ``mma``. Every
shared tile holds rows of packed feature pairs, as they lie in global memory, copied 16 bytes
at a time by ``cp.async``; ``ldmatrix`` reads the fragments out of them (``mma``). Q K^T takes
its A operand from Q's fragments, held in registers for the whole kernel, and its B operand
from K's rows; P V takes P's fragments as its A operand (see ``mma``) and V's rows read
transposed. Shared rows are four words longer than the widest row: the eight 16-byte rows an
``ldmatrix`` reads start in distinct banks. A product cannot skip a term, and 0 * NaN is NaN,
so a tile with a skipped pair whose V holds a NaN or an infinity (rare: ``exact``) is
multiplied term by term instead, P passing through the scratch tile. The kernels receive q, k,
v as int32 words, each a pair of adjacent features.

Shared memory is addressed by 32-bit window addresses and immediate byte offsets (``mma``): a
lane takes one address per tile (its ``ldmatrix`` row, its column of 16-byte copies) and every
fragment, copy and word it touches lies a compile-time offset from it. Held across the loops as
separate registers, those addresses would leave the accumulators too few.

Micro-tiles (``micro_tile_form``): thread (g, t) of ``row_groups`` x ``lanes`` holds rows
g + i * row_groups, columns t + j * lanes and runs of four features (``primitives``); P goes
through shared memory (``p_tile``) to the product with V. The products read shared memory 16
bytes at a time: every tile's rows, P's too, start on 16 bytes. A skipped term is multiplied
unless the streamed operand of the product with P holds a NaN or an infinity (``exact``, as
with fragments).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np
from numba import cuda

from flashx_numba.primitives import (SIMULATOR, STEP, accumulate, bits_of_float, device_function, feature,
                                     float_from_bits, has_nonfinite_floats, load_tile, scores, skipped, to_shared)

#: Words a shared row is padded by in the fragment form (bank spread of B fragment reads).
_PAD_WORDS = 4
#: Words of one asynchronous copy (16 bytes) in the fragment form.
_CHUNK_WORDS = 4


class Form(NamedTuple):
    threads: int
    held_rows: int
    held_cols: int
    held_features: int
    row_lanes: int
    tile_dtype: type  # shared Q, K, V tiles
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    p_shape: tuple  # P in shared memory (micro-tiles)
    frag_words: int  # Q in registers (fragments)
    row_of: Callable
    col_of: Callable
    feature_of: Callable
    stage_queries: Callable
    start_tile: Callable
    wait_tiles: Callable
    has_nonfinite: Callable
    qk: Callable
    qk_shared: Callable
    share_weights: Callable
    pv: Callable


@functools.cache
def micro_tile_form(rows: int, cols: int, row_groups: int, lanes: int, width: int, bf16: bool) -> Form:
    """Each thread a (rows / row_groups) x (cols / lanes) micro-tile; float32 shared tiles."""
    threads = row_groups * lanes
    passes = threads // min(32, threads)  # rows a load copies at once
    assert width % (4 * lanes) == 0 and width % STEP == 0 and cols % 4 == 0  # whole runs and steps
    assert rows % passes == 0 and cols % passes == 0 and width % min(32, threads) == 0  # whole passes of a load
    padded, p_padded = width + 4, cols + 4  # rows 16 bytes longer: bank spread (see primitives)

    @device_function
    def row_of(tid, i):
        return tid // lanes + i * row_groups

    @device_function
    def col_of(tid, c):
        return tid % lanes + c * lanes

    @device_function
    def feature_of(tid, a):
        return feature(tid % lanes, a, lanes)

    @device_function
    def stage_queries(q_frag, q_tile, staging, q, b, row0, rows, h, dim, tid):
        load_tile(q_tile, q, b, row0, rows, h, dim, width, tid, threads, bf16)

    @device_function
    def start_tile(tile, x, b, row0, rows, h, dim, tid):
        load_tile(tile, x, b, row0, rows, h, dim, width, tid, threads, bf16)

    @device_function
    def wait_tiles():
        """Nothing: ``start_tile`` copied already."""

    @device_function
    def has_nonfinite(tile, tid):
        return has_nonfinite_floats(tile, width, tid, threads)

    @device_function
    def qk(s, q_frag, q_tile, k_tile, dim, tid):
        scores(s, q_tile, k_tile, dim, tid // lanes, tid % lanes, row_groups, lanes)

    @device_function
    def qk_shared(s, a_tile, k_tile, dim, tid):
        scores(s, a_tile, k_tile, dim, tid // lanes, tid % lanes, row_groups, lanes)

    @device_function
    def share_weights(p_tile, s, tid):
        to_shared(p_tile, s, tid // lanes, tid % lanes, row_groups, lanes)

    @device_function
    def pv(acc, s, scratch, v_tile, p_tile, dim_v, tid, exact):
        accumulate(acc, p_tile, v_tile, dim_v, tid // lanes, tid % lanes, row_groups, lanes, exact)

    return Form(threads, rows // row_groups, cols // lanes, width // lanes, lanes, np.float32, (rows, padded),
                (cols, padded), (cols, padded), (rows, p_padded), 1, row_of, col_of, feature_of, stage_queries,
                start_tile, wait_tiles, has_nonfinite, qk, qk_shared, share_weights, pv)


@functools.cache
def tensor_core_form(rows: int, cols: int, width: int, dtype: str) -> Form:
    """Warps of 16 query rows on m16n8k16 tensor cores (float16 or bfloat16, a GPU only)."""
    assert not SIMULATOR and rows % 16 == 0 and cols % 16 == 0 and width % 16 == 0 and rows <= cols
    threads, words, steps = 2 * rows, width // 2, width // 16
    chunks = words // _CHUNK_WORDS  # a row's 16-byte copies
    rows_apart = threads // chunks  # rows between one thread's copies
    assert threads % chunks == 0 and cols % rows_apart == 0  # whole copies a thread
    from flashx_numba.mma import a_rows, b_rows, b_rows_transposed, intrinsics, shared_memory_intrinsics

    mma, pack, widen = intrinsics(dtype)
    (shared_address, global_address, shared_word, store_shared_pair, ldmatrix, ldmatrix_transposed, copy_async,
     wait_copies) = shared_memory_intrinsics()
    a_rows, b_rows, b_rows_transposed = (device_function(f) for f in (a_rows, b_rows, b_rows_transposed))
    row_words = max(words, cols) + _PAD_WORDS  # every tile's rows (the forward's K rows also hold P's)
    row_bytes = 4 * row_words
    low_exponent = np.uint32(0x7F80 if dtype == "bfloat16" else 0x7C00)
    high_exponent = np.uint32(int(low_exponent) << 16)

    @device_function
    def row_of(tid, i):
        return tid // 32 * 16 + tid % 32 // 4 + 8 * i

    @device_function
    def col_of(tid, c):
        return c // 2 * 8 + 2 * (tid % 4) + c % 2

    @device_function
    def start_tile(tile, x, b, row0, rows_in, h, dim, tid):
        """Start copying tile[r, w] = word w of row row0 + r (features 2w, 2w + 1), zero past
        ``rows_in`` and the head dim, in 16-byte copies (the host pads the words of a row to whole
        copies, see ``attention``). A thread copies one 16-byte column, every ``rows_apart`` rows
        (a warp's copies along rows): its addresses step by constants in shared memory and by a
        row stride in global memory."""
        row, word = tid // chunks, tid % chunks * _CHUNK_WORDS
        target = shared_address(tile, row, word)
        origin = global_address(x, b, row0, h, 0)  # the address of a zero-filled copy
        source = origin + row * x.strides[1] + word * x.strides[3]
        in_row = word < (dim + 1) // 2
        if in_row and row + cols - rows_apart < rows_in:  # every copy inside: the tests fold away
            copy_rows(target, source, origin, x.strides[1], cols, True)
        else:
            copy_rows(target, source, origin, x.strides[1], rows_in - row, in_row)

    @device_function
    def copy_rows(target, source, origin, stride, rows_left, in_row):
        """``start_tile``'s copies of one thread, ``rows_left`` rows from its first on in the tile."""
        for k in range(cols // rows_apart):
            inside = in_row and k * rows_apart < rows_left
            copy_async(target, k * rows_apart * row_bytes, source + k * rows_apart * stride if inside else origin,
                       inside)

    @device_function
    def wait_tiles():
        wait_copies()

    @device_function
    def stage_queries(q_frag, q_tile, staging, q, b, row0, rows_in, h, dim, tid):
        """Q's A fragments of this warp's 16 rows, for every 16 features, into registers; the
        staging tile is free again on return."""
        start_tile(staging, q, b, row0, rows_in, h, dim, tid)
        wait_copies()
        cuda.syncthreads()
        address = a_lane_address(staging, tid)
        for step in range(steps):
            q_frag[4 * step], q_frag[4 * step + 1], q_frag[4 * step + 2], q_frag[4 * step + 3] = ldmatrix(
                address, 32 * step)
        cuda.syncthreads()

    @device_function
    def a_lane_address(tile, tid):
        """The address this lane names to ``ldmatrix`` for its warp's A fragment of features 0:16
        of a key-layout tile (16 bytes further a step of 16 features)."""
        row, word = a_rows(tid % 32)
        return shared_address(tile, tid // 32 * 16 + row, word)

    @device_function
    def nonfinite(word):
        """Whether either half of ``word`` is a NaN or an infinity (its exponent all ones)."""
        return np.uint32((word & low_exponent) == low_exponent) | np.uint32((word & high_exponent) == high_exponent)

    @device_function
    def has_nonfinite(tile, tid):
        """Whether this thread's share of ``tile`` holds a NaN or an infinity."""
        seen = np.uint32(0)
        for index in range(tid, cols * words, threads):
            seen |= nonfinite(tile[index // words, index % words])
        return seen != 0

    @device_function
    def mma_two(c, n, a0, a1, a2, a3, b0, b1, b2, b3):
        """c += A B for the 8-column tiles n (B fragment b0, b1) and n + 1 (b2, b3) of c."""
        c[0, 2 * n], c[0, 2 * n + 1], c[1, 2 * n], c[1, 2 * n + 1] = mma(
            a0, a1, a2, a3, b0, b1, c[0, 2 * n], c[0, 2 * n + 1], c[1, 2 * n], c[1, 2 * n + 1])
        m = n + 1
        c[0, 2 * m], c[0, 2 * m + 1], c[1, 2 * m], c[1, 2 * m + 1] = mma(
            a0, a1, a2, a3, b2, b3, c[0, 2 * m], c[0, 2 * m + 1], c[1, 2 * m], c[1, 2 * m + 1])

    @device_function
    def products(s, a0, a1, a2, a3, k_address, step):
        """s += the products of one A fragment with the keys' B fragments, two key tiles an
        ldmatrix (``k_address``: this lane's row of the first two, see ``b_lane_address``)."""
        for n in range(0, cols // 8, 2):
            b0, b1, b2, b3 = ldmatrix(k_address, (n * 8 * row_words + step * 8) * 4)
            mma_two(s, n, a0, a1, a2, a3, b0, b1, b2, b3)

    @device_function
    def b_lane_address(k_tile, tid):
        row, word = b_rows(tid % 32)
        return shared_address(k_tile, row, word)

    @device_function
    def qk(s, q_frag, q_tile, k_tile, dim, tid):
        """Features outermost: the products of one step are independent (no chained latency)."""
        for c in range(cols // 4):
            s[0, c] = 0
            s[1, c] = 0
        k_address = b_lane_address(k_tile, tid)
        for step in range(steps):
            f = step * 4
            products(s, q_frag[f], q_frag[f + 1], q_frag[f + 2], q_frag[f + 3], k_address, step)

    @device_function
    def qk_shared(s, a_tile, k_tile, dim, tid):
        """As ``qk``, each step's A fragment read from ``a_tile`` when it is used."""
        for c in range(cols // 4):
            s[0, c] = 0
            s[1, c] = 0
        a_address, k_address = a_lane_address(a_tile, tid), b_lane_address(k_tile, tid)
        for step in range(steps):
            a0, a1, a2, a3 = ldmatrix(a_address, 32 * step)
            products(s, a0, a1, a2, a3, k_address, step)

    @device_function
    def share_weights(p_tile, s, tid):
        """Nothing: P stays in registers."""

    @device_function
    def pv(acc, s, scratch, v_tile, p_tile, dim_v, tid, exact):
        """acc += P V, V's B fragments read transposed from its rows, two feature tiles an ldmatrix."""
        if exact:
            pv_by_terms(acc, s, scratch, v_tile, tid)
            return
        row, word = b_rows_transposed(tid % 32)
        v_address = shared_address(v_tile, row, word)
        for step in range(cols // 16):
            c = 4 * step
            a0, a1 = pack(s[0, c], s[0, c + 1]), pack(s[1, c], s[1, c + 1])
            a2, a3 = pack(s[0, c + 2], s[0, c + 3]), pack(s[1, c + 2], s[1, c + 3])
            for n in range(0, width // 8, 2):
                b0, b1, b2, b3 = ldmatrix_transposed(v_address, (step * 16 * row_words + n * 4) * 4)
                mma_two(acc, n, a0, a1, a2, a3, b0, b1, b2, b3)

    @device_function
    def pv_by_terms(acc, s, scratch, v_tile, tid):
        """acc += P V one term at a time, SKIP terms left out; P's rows pass through this warp's
        rows of ``scratch`` (a row's weights are its quad's: the warp's own barriers order them)."""
        top = shared_address(scratch, row_of(tid, 0), 0)  # the bottom row 8 rows further
        cuda.syncwarp()  # the warp's last product through these rows is read
        for c in range(0, cols // 4, 2):  # col_of(tid, c + 1) == col_of(tid, c) + 1 == c // 2 * 8 + 2 * (tid % 4) + 1
            own = top + 8 * (tid % 4)
            for i in range(2):
                store_shared_pair(own, (i * 8 * row_words + c // 2 * 8) * 4, bits_of_float(s[i, c]),
                                  bits_of_float(s[i, c + 1]))
        cuda.syncwarp()  # a row's weights are its quad's
        for key in range(cols):  # both rows at once: acc is indexed by constants only, and stays in registers
            w_top = float_from_bits(np.int32(shared_word(top + 4 * key, 0)))
            w_bottom = float_from_bits(np.int32(shared_word(top + 4 * key, 8 * row_bytes)))
            v_address = shared_address(v_tile, key, col_of(tid, 0) // 2)
            for a in range(width // 4):  # col_of(tid, a) // 2 == col_of(tid, 0) // 2 + a // 2 * 4
                value = widen(shared_word(v_address + a // 2 * 16, 0) >> np.uint32(16 * (a % 2)))
                if not skipped(w_top):
                    acc[0, a] += w_top * value
                if not skipped(w_bottom):
                    acc[1, a] += w_bottom * value

    return Form(threads, 2, cols // 4, width // 4, 4, np.uint32, (1, 1), (cols, row_words), (cols, row_words), (1, 1),
                4 * steps, row_of, col_of, col_of, stage_queries, start_tile, wait_tiles, has_nonfinite, qk, qk_shared,
                share_weights, pv)
