"""The kernels' two ways of holding a tile of scores: warp fragments on tensor cores (float16 and
bfloat16 on a GPU), and a register micro-tile per thread (float32, and every dtype in the
simulator). Each kernel is written once against either ``Form``; the names below are the
forward's (own rows Q, streamed K and V), and the backward kernels use the same products with
other operands (``kernels``).

A form says which score elements a thread holds: ``held_rows`` x ``held_cols`` registers, element
(i, c) being tile row ``row_of(tid, i)`` and column ``col_of(tid, c)``; its output accumulators
are ``held_rows`` x ``held_features`` registers, feature columns ``col_of(tid, a)``. The
``row_lanes`` adjacent lanes that share a row reduce it by xor shuffles. And it says how tiles
are staged and multiplied:

- ``stage_queries(q_frag, q_tile, staging, q, b, row0, rows, h, dim, tid)``: Q, in registers
  (``q_frag``) or in shared memory (``q_tile``), staged through the key tile ``staging``;
- ``load_keys(k_tile, k, ...)`` and ``load_values(v_tile, v, ...)``: a key/value tile into shared
  memory, zero past ``rows`` and the head dim; ``load_values`` returns whether this thread saw a
  NaN or an infinity (the fragment form's products cannot skip a term, see below);
- ``qk(s, q_frag, q_tile, k_tile, dim, tid)``: s = Q K^T of the thread's elements; and
  ``qk_shared(s, a_tile, k_tile, dim, tid)``: the same product with the own rows' operand in a
  shared tile of the key layout (the backward keeps one of its two own operands there: the
  registers hold its accumulators);
- ``share_weights(p_tile, s, tid)``, then a barrier, then ``pv(acc, s, k_tile, v_tile, p_tile,
  dim_v, tid, exact)``: acc += P V, the terms whose weight is SKIP left out where ``exact`` (a
  block-wide flag). (The forms' CUDA-only code may call ``cuda`` functions; what the simulator
  runs may not: it swaps ``cuda`` in the kernels' module only.)

Fragments (``tensor_core_form``): 16 query rows a warp, the m16n8k16 layout of ``mma``. Q K^T
takes its A operand from Q's fragments, held in registers for the whole kernel, and its B
operand from K rows in shared memory as packed pairs; P V takes P's fragments as its A operand
(see ``mma``) and V from shared memory transposed, pairs of keys packed along each feature
row. Shared rows are four words longer than the widest row: the eight rows a B fragment reads
start in distinct banks. A product cannot skip a term, and 0 * NaN is NaN, so a tile with a
skipped pair whose V holds a NaN or an infinity (rare: ``exact``) is multiplied term by term
instead, P passing through the key tile. The kernels receive q, k, v as int32 words, each a pair of adjacent features.

Micro-tiles (``micro_tile_form``): thread (g, t) of ``row_groups`` x ``lanes`` holds rows
g + i * row_groups and columns t + j * lanes (``primitives``); P goes through shared memory
(``p_tile``) to the product with V.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np
from numba import cuda

from flashx_numba.primitives import (SIMULATOR, accumulate, bits_of_float, device_function, float_from_bits,
                                     load_tile, scores, skipped, to_shared)

#: Words a shared row is padded by in the fragment form (bank spread of B fragment reads).
_PAD_WORDS = 4
#: Global loads a thread has in flight at once while filling a tile in the fragment form, whose
#: tile widths are compile-time constants (batched so, the micro-tile form's loads, with a
#: run-time width, would spend more on index division than they hide in latency).
_BATCH = 8


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
    stage_queries: Callable
    load_keys: Callable
    load_values: Callable
    qk: Callable
    qk_shared: Callable
    share_weights: Callable
    pv: Callable


@functools.cache
def micro_tile_form(rows: int, cols: int, row_groups: int, lanes: int, width: int, bf16: bool) -> Form:
    """Each thread a (rows / row_groups) x (cols / lanes) micro-tile; float32 shared tiles."""
    threads, padded = row_groups * lanes, width + 1  # shared rows one float longer (see primitives)

    @device_function
    def row_of(tid, i):
        return tid // lanes + i * row_groups

    @device_function
    def col_of(tid, c):
        return tid % lanes + c * lanes

    @device_function
    def stage_queries(q_frag, q_tile, staging, q, b, row0, rows, h, dim, tid):
        load_tile(q_tile, q, b, row0, rows, h, dim, tid, threads, bf16)

    @device_function
    def load_keys(k_tile, k, b, row0, rows, h, dim, tid):
        load_tile(k_tile, k, b, row0, rows, h, dim, tid, threads, bf16)

    @device_function
    def load_values(v_tile, v, b, row0, rows, h, dim_v, tid):
        load_tile(v_tile, v, b, row0, rows, h, dim_v, tid, threads, bf16)
        return False

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
    def pv(acc, s, k_tile, v_tile, p_tile, dim_v, tid, exact):
        accumulate(acc, p_tile, v_tile, dim_v, tid // lanes, tid % lanes, row_groups, lanes)

    return Form(threads, rows // row_groups, cols // lanes, width // lanes, lanes, np.float32, (rows, padded),
                (cols, padded), (cols, padded), (rows, cols + 1), 1, row_of, col_of, stage_queries, load_keys,
                load_values, qk, qk_shared, share_weights, pv)


@functools.cache
def tensor_core_form(rows: int, cols: int, width: int, dtype: str) -> Form:
    """Warps of 16 query rows on m16n8k16 tensor cores (float16 or bfloat16, a GPU only)."""
    assert not SIMULATOR and rows % 16 == 0 and cols % 16 == 0 and width % 16 == 0 and rows <= cols
    threads, words, steps = 2 * rows, width // 2, width // 16
    # whole batches of loads a thread: K words, V row pairs
    assert cols * words % (threads * _BATCH) == 0 and steps * cols // 8 % (threads // 32 * _BATCH // 2) == 0
    from flashx_numba.mma import intrinsics

    mma, pack, widen = intrinsics(dtype)
    k_stride, v_stride = max(words, cols) + _PAD_WORDS, cols // 2 + _PAD_WORDS  # K's rows also hold P's
    PAIRS = _BATCH // 2  # row pairs a batch of V loads holds
    low_exponent = np.uint32(0x7F80 if dtype == "bfloat16" else 0x7C00)
    high_exponent = np.uint32(int(low_exponent) << 16)

    @device_function
    def row_of(tid, i):
        return tid // 32 * 16 + tid % 32 // 4 + 8 * i

    @device_function
    def col_of(tid, c):
        return c // 2 * 8 + 2 * (tid % 4) + c % 2

    @device_function
    def load_keys(k_tile, k, b, row0, rows_in, h, dim, tid):
        """k_tile[r, w] = word w of row row0 + r (features 2w, 2w + 1); a warp reads along rows.
        Loads go in batches (a loop of fixed count unrolls), so that a batch is in flight at once."""
        used = (dim + 1) // 2
        batch = cuda.local.array(_BATCH, np.uint32)
        for first in range(0, cols * words // threads, _BATCH):
            for u in range(_BATCH):
                index = tid + (first + u) * threads
                r, w = index // words, index % words
                batch[u] = np.uint32(k[b, row0 + r, h, w]) if w < used and r < rows_in else np.uint32(0)
            for u in range(_BATCH):
                index = tid + (first + u) * threads
                k_tile[index // words, index % words] = batch[u]

    @device_function
    def stage_queries(q_frag, q_tile, staging, q, b, row0, rows_in, h, dim, tid):
        """Q's A fragments of this warp's 16 rows, for every 16 features, into registers."""
        load_keys(staging, q, b, row0, rows_in, h, dim, tid)
        cuda.syncthreads()
        for step in range(steps):
            for i in range(4):
                q_frag[step * 4 + i] = a_word(staging, step, i, tid)

    @device_function
    def a_word(tile, step, i, tid):
        """Word i of this lane's A fragment of features step * 16 on, from a key-layout tile
        (the rows of the eight lane groups start in distinct banks)."""
        return tile[tid // 32 * 16 + tid % 32 // 4 + 8 * (i % 2), step * 8 + tid % 4 + 4 * (i // 2)]

    @device_function
    def load_values(v_tile, v, b, row0, rows_in, h, dim_v, tid):
        """v_tile[d, p] = features d of keys 2p (low half) and 2p + 1, packed. A warp reads 8
        words of 4 row pairs (full 32-byte sectors), and writes to 16 distinct banks; loads go
        in batches, as in ``load_keys``."""
        used = (dim_v + 1) // 2
        seen = np.uint32(0)
        column, pair, warps = tid % 8, tid // 8 % 4, threads // 32
        firsts = cuda.local.array(PAIRS, np.uint32)
        seconds = cuda.local.array(PAIRS, np.uint32)
        for first_block in range(0, steps * (cols // 8) // warps, PAIRS):
            for u in range(PAIRS):
                block = tid // 32 + (first_block + u) * warps
                w, p = column + 8 * (block % steps), pair + 4 * (block // steps)
                firsts[u] = np.uint32(v[b, row0 + 2 * p, h, w]) if w < used and 2 * p < rows_in else np.uint32(0)
                seconds[u] = (np.uint32(v[b, row0 + 2 * p + 1, h, w]) if w < used and 2 * p + 1 < rows_in
                              else np.uint32(0))
            for u in range(PAIRS):
                block = tid // 32 + (first_block + u) * warps
                w, p = column + 8 * (block % steps), pair + 4 * (block // steps)
                v_tile[2 * w, p] = (firsts[u] & np.uint32(0xFFFF)) | (seconds[u] << np.uint32(16))
                v_tile[2 * w + 1, p] = (firsts[u] >> np.uint32(16)) | (seconds[u] & np.uint32(0xFFFF0000))
                seen |= nonfinite(firsts[u]) | nonfinite(seconds[u])
        return seen != 0

    @device_function
    def nonfinite(word):
        """Whether either half of ``word`` is a NaN or an infinity (its exponent all ones)."""
        return np.uint32((word & low_exponent) == low_exponent) | np.uint32((word & high_exponent) == high_exponent)

    @device_function
    def qk(s, q_frag, q_tile, k_tile, dim, tid):
        """Features outermost: the products of one step are independent (no chained latency)."""
        key, pair = tid % 32 // 4, tid % 4
        for c in range(cols // 4):
            s[0, c] = 0
            s[1, c] = 0
        for step in range(steps):
            f = step * 4
            for n in range(cols // 8):
                s[0, 2 * n], s[0, 2 * n + 1], s[1, 2 * n], s[1, 2 * n + 1] = mma(
                    q_frag[f], q_frag[f + 1], q_frag[f + 2], q_frag[f + 3], k_tile[n * 8 + key, step * 8 + pair],
                    k_tile[n * 8 + key, step * 8 + pair + 4], s[0, 2 * n], s[0, 2 * n + 1], s[1, 2 * n],
                    s[1, 2 * n + 1])

    @device_function
    def qk_shared(s, a_tile, k_tile, dim, tid):
        """As ``qk``, each step's A fragment read from ``a_tile`` when it is used."""
        key, pair = tid % 32 // 4, tid % 4
        for c in range(cols // 4):
            s[0, c] = 0
            s[1, c] = 0
        for step in range(steps):
            a0, a1, a2, a3 = a_word(a_tile, step, 0, tid), a_word(a_tile, step, 1, tid), a_word(
                a_tile, step, 2, tid), a_word(a_tile, step, 3, tid)
            for n in range(cols // 8):
                s[0, 2 * n], s[0, 2 * n + 1], s[1, 2 * n], s[1, 2 * n + 1] = mma(
                    a0, a1, a2, a3, k_tile[n * 8 + key, step * 8 + pair], k_tile[n * 8 + key, step * 8 + pair + 4],
                    s[0, 2 * n], s[0, 2 * n + 1], s[1, 2 * n], s[1, 2 * n + 1])

    @device_function
    def share_weights(p_tile, s, tid):
        """Nothing: P stays in registers."""

    @device_function
    def pv(acc, s, k_tile, v_tile, p_tile, dim_v, tid, exact):
        if exact:
            pv_by_terms(acc, s, k_tile, v_tile, tid)
            return
        feature, pair = tid % 32 // 4, tid % 4
        for step in range(cols // 16):
            c = 4 * step
            a0, a1 = pack(s[0, c], s[0, c + 1]), pack(s[1, c], s[1, c + 1])
            a2, a3 = pack(s[0, c + 2], s[0, c + 3]), pack(s[1, c + 2], s[1, c + 3])
            for n in range(width // 8):
                row = n * 8 + feature
                acc[0, 2 * n], acc[0, 2 * n + 1], acc[1, 2 * n], acc[1, 2 * n + 1] = mma(
                    a0, a1, a2, a3, v_tile[row, step * 8 + pair], v_tile[row, step * 8 + pair + 4],
                    acc[0, 2 * n], acc[0, 2 * n + 1], acc[1, 2 * n], acc[1, 2 * n + 1])

    @device_function
    def pv_by_terms(acc, s, k_tile, v_tile, tid):
        """acc += P V one term at a time, SKIP terms left out; P goes through the key tile (every
        warp is done with K: the kernel's barrier before ``pv``)."""
        for i in range(2):
            for c in range(cols // 4):
                k_tile[row_of(tid, i), col_of(tid, c)] = bits_of_float(s[i, c])
        cuda.syncthreads()
        top, bottom = row_of(tid, 0), row_of(tid, 1)
        for key in range(cols):  # both rows at once: acc is indexed by constants only, and stays in registers
            w_top = float_from_bits(np.int32(k_tile[top, key]))
            w_bottom = float_from_bits(np.int32(k_tile[bottom, key]))
            shift = np.uint32(16 * (key % 2))
            for a in range(width // 4):
                value = widen(v_tile[col_of(tid, a), key // 2] >> shift)
                if not skipped(w_top):
                    acc[0, a] += w_top * value
                if not skipped(w_bottom):
                    acc[1, a] += w_bottom * value

    return Form(threads, 2, cols // 4, width // 4, 4, np.uint32, (1, 1), (cols, k_stride), (width, v_stride), (1, 1),
                4 * steps, row_of, col_of, stage_queries, load_keys, load_values, qk, qk_shared, share_weights, pv)
