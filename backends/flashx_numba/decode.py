"""Decoding with a KV cache in numba-cuda: split-KV attention (FlashDecoding) over contiguous or paged caches.

Up to three launches on the caller's stream, none of which reads a device value on the host (so a
call with ``validate=False`` makes no host synchronization):

1. ``append_kernel``, with new tokens only: a thread per (new token, kv head) copies its key and
   value rows into their cache slot, found through the block table when the cache is paged.
2. ``split_kernel``: a block per (sequence, kv head, row tile, split). A row tile holds query rows
   of every query head that reads the kv head (Nq x group rows, query-major), so each split's keys
   and values are read once for the whole GQA group. A key tile's rows are gathered into shared
   memory through the block table (``gather_tile``: any page size, a page per row), and folded
   into the forward's online softmax in float32 (``kernels.fold_row``) with the forward's
   micro-tile products (``fragments.micro_tile_form``, float32 FMA in every dtype: decoding reads
   far more than it computes, and its tiles have no tensor-core or ``cp.async`` form yet). Only keys that some row of the tile may
   see are loaded, so neither stale slots, unused pages nor table entries past a sequence are
   ever read; every pair is tested (band at the sequence's own length, the tree mask over its last
   Nq keys), and a tile whose rows do not all see all its keys multiplies V term by term where V
   holds a NaN or an infinity (``exact``, as in the forward). Each split writes its normalised
   output and lse, in float32, without the sink.
3. ``merge_kernel``: a warp per (sequence, query row, head) joins the splits as "Merging partial
   results" says, a split of lse -inf weighing exactly 0, joins the sink once (``with_sink``),
   and rounds o to the caller's dtype. It runs with one split too: the sink and the rounding live
   in one kernel.

The score modifications are the forward's (``score_mods.modify``): softcap and ALiBi on every
split's scores, ALiBi's distance measured from each row's position Lk - Nq + i whatever split
holds the key; the slope is per row, the rows of a tile mixing heads.

A split covers a fixed share of the key tiles its rows may see, computed on the device from the
sequence's length, so a fixed ``num_splits`` gives the same bits on every call. ``num_splits=0``
takes ``choose_splits``, the rule of the Triton backend (``flashx_triton.decode``) with this
backend's own constants: enough splits to give every SM ``RESIDENT_BLOCKS`` blocks (the number
the tiles' shared memory lets one hold), none when the (sequence, kv head, row tile) blocks alone
do, and each split at least ``MIN_TILES_PER_SPLIT`` key tiles of the cache's capacity, chosen from
the capacity (which the host knows) rather than the lengths (which only the device holds). Not yet
tuned on a GPU.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from numba import cuda, types

from flashx_numba.attention import (_broadcast, _device_array, _launch, _launching, _placeholders, tiles)
from flashx_numba.disk_cache import cached_kernel
from flashx_numba.fragments import micro_tile_form
from flashx_numba.kernels import ALIGNED, Tiles, _tensor, fold_row
from flashx_numba.primitives import (NEG_INF, SIMULATOR, device_function, gather_tile, lanes_sum, max_nan, store)
from flashx_numba.score_mods import modify, with_sink

MIN_TILES_PER_SPLIT = 4  # a split of fewer key tiles would cost more in the merge than it gains
MAX_SPLITS = 128
RESIDENT_BLOCKS = 4  # split blocks an SM holds at once: about 45 KiB of shared memory and 128 threads each
SIMULATED_SMS = 4  # the stand-in SM count in the simulator, so that small problems split too
THREADS = 1 if SIMULATOR else 64  # of the append and merge kernels (the simulator runs each as a Python thread)
#: The merge's threads a row: a warp, whose lanes read consecutive features of each split's o, where
#: one thread a row would read them one by one, each load far from its neighbours' and waiting out
#: its latency; one in the simulator, where each is a Python thread.
MERGE_LANES = 1 if SIMULATOR else 32

_INDEX = types.Array(types.int32, 1, "A")  # cache_seqlens
_TABLE = types.Array(types.int32, 2, "A")
_FLAGS = types.Array(types.boolean, 4, "A")  # the tree mask, (B, Hq, Nq, Nq)
_SLOPES = types.Array(types.float32, 2, "A")
_SINKS = types.Array(types.float32, 1, "A")
_PARTS = types.Array(types.float32, 4, "C")  # the splits' o: (splits x B, Nq, Hq, Dv)
_PART_LSE = types.Array(types.float32, 3, "C")  # the splits' lse: (splits x B, Hq, Nq)
_LSE = types.Array(types.float32, 3, "A")
_i, _b, _f = types.int64, types.boolean, types.float32


@device_function
def slot(position, b, block_table, page_size):
    """(page, slot) of sequence b's token at ``position``: a contiguous cache (page_size 0) is
    one page a sequence."""
    if page_size == 0:
        return np.int64(b), np.int64(position)
    return np.int64(block_table[b, position // page_size]), np.int64(position % page_size)


@functools.cache
def split_kernel(shape: Tiles, dtype: str, score_mods: bool):
    """One split of one row tile: partial o and lse for a grid of B * Hk * row_tiles * splits blocks
    of ``shape.threads``. ``score_mods``: the scores take a softcap or ALiBi."""
    bf16 = dtype == "bfloat16"
    ROWS, COLS, WIDTH, THREADS_A_BLOCK = shape.rows, shape.cols, shape.width, shape.threads
    form = micro_tile_form(shape.rows, shape.cols, shape.row_groups, shape.lanes, shape.width, bf16)
    R, C, A, ROW_LANES = form.held_rows, form.held_cols, form.held_features, form.row_lanes
    Q_SHAPE, K_SHAPE, V_SHAPE, P_SHAPE = form.q_shape, form.k_shape, form.v_shape, form.p_shape
    row_of, col_of, feature_of, qk_shared, share_weights, pv, has_nonfinite = (
        form.row_of, form.col_of, form.feature_of, form.qk_shared, form.share_weights, form.pv, form.has_nonfinite)
    x = _tensor(dtype)

    @cached_kernel(types.void(x, x, x, _PARTS, _PART_LSE, _INDEX, _TABLE, _FLAGS, _SLOPES, _i, _i, _i, _i, _i, _i, _i,
                              _i, _i, _b, _i, _i, _f, _f, _b), shape, dtype, score_mods)
    def kernel(q, k_cache, v_cache, o_part, lse_part, cache_seqlens, block_table, mask, slopes, nq, new_tokens,
               heads_q, group, dim, dim_v, row_tiles, num_splits, page_size, has_mask, left, right, scale, softcap,
               has_alibi):
        tid = cuda.threadIdx.x
        pid = cuda.blockIdx.x
        heads_k = heads_q // group
        split = pid % num_splits
        row_tile = pid // num_splits % row_tiles
        kv_head = pid // num_splits // row_tiles % heads_k
        b = pid // num_splits // row_tiles // heads_k
        batch = o_part.shape[0] // num_splits
        length = np.int64(cache_seqlens[b]) + new_tokens
        diagonal = length - nq  # query i sits at key position diagonal + i
        rows_total = nq * group
        r0 = row_tile * ROWS
        r1 = min(r0 + ROWS, rows_total)
        first_query, last_query = r0 // group, (r1 - 1) // group
        # Keys [lo, hi) are seen by some row of the tile, [full_lo, full_hi) by every one, in full.
        lo = max(np.int64(0), diagonal + first_query - left)
        hi = max(lo, min(length, diagonal + last_query + right + 1))
        full_lo = diagonal + last_query - left
        full_hi = min(hi, diagonal + first_query + right + 1)
        if has_mask:
            full_hi = min(full_hi, diagonal)  # the tree mask's keys are tested pair by pair
        t_lo = lo // COLS
        t_hi = (hi + COLS - 1) // COLS if hi > lo else t_lo
        per_split = (t_hi - t_lo + num_splits - 1) // num_splits
        s_lo = min(t_lo + split * per_split, t_hi)
        s_hi = min(s_lo + per_split, t_hi)

        q_tile = cuda.shared.array(Q_SHAPE, np.float32, alignment=ALIGNED)
        k_tile = cuda.shared.array(K_SHAPE, np.float32, alignment=ALIGNED)
        v_tile = cuda.shared.array(V_SHAPE, np.float32, alignment=ALIGNED)
        p_tile = cuda.shared.array(P_SHAPE, np.float32, alignment=ALIGNED)
        query_rows = cuda.shared.array((ROWS, 3), np.int64)  # (sequence, query, head) of each tile row
        key_rows = cuda.shared.array((COLS, 3), np.int64)  # (page, slot, kv head), page -1 where not loaded
        s = cuda.local.array((R, C), np.float32)
        acc = cuda.local.array((R, A), np.float32)
        row_max = cuda.local.array(R, np.float32)
        row_sum = cuda.local.array(R, np.float32)
        for i in range(R):
            row_max[i] = NEG_INF
            row_sum[i] = 0
            for a in range(A):
                acc[i, a] = 0

        for r in range(tid, ROWS, THREADS_A_BLOCK):
            row = r0 + r
            query_rows[r, 0] = b if row < rows_total else -1
            query_rows[r, 1] = row // group
            query_rows[r, 2] = kv_head * group + row % group
        cuda.syncthreads()
        gather_tile(q_tile, q, query_rows, dim, WIDTH, tid, THREADS_A_BLOCK, bf16)
        for t in range(s_lo, s_hi):
            j0 = t * COLS
            cuda.syncthreads()  # the last tile's readers are done with the key rows and tiles
            for c in range(tid, COLS, THREADS_A_BLOCK):
                key = j0 + c
                page, place = slot(key, b, block_table, page_size) if lo <= key < hi else (np.int64(-1), np.int64(0))
                key_rows[c, 0], key_rows[c, 1], key_rows[c, 2] = page, place, kv_head
            cuda.syncthreads()
            gather_tile(k_tile, k_cache, key_rows, dim, WIDTH, tid, THREADS_A_BLOCK, bf16)
            gather_tile(v_tile, v_cache, key_rows, dim_v, WIDTH, tid, THREADS_A_BLOCK, bf16)
            cuda.syncthreads()
            qk_shared(s, q_tile, k_tile, dim, tid)
            for i in range(R):
                row = r0 + row_of(tid, i)
                query, head = row // group, kv_head * group + row % group
                position = diagonal + query
                slope = slopes[b, head] if has_alibi and row < rows_total else np.float32(0)
                tile_max = NEG_INF
                for c in range(C):
                    key = j0 + col_of(tid, c)
                    score = s[i, c] * scale
                    if score_mods:
                        score, _ = modify(score, softcap, slope, position - key)
                    seen = row < rows_total and key < length and position - left <= key <= position + right
                    if seen and has_mask and key >= diagonal:
                        seen = mask[b, head, query, key - diagonal]
                    s[i, c] = score if seen else NEG_INF
                    tile_max = max_nan(tile_max, s[i, c])
                fold_row(s, i, tile_max, row_max, row_sum, acc, 0, ROW_LANES)
            share_weights(p_tile, s, tid)
            plain = full_lo <= j0 and j0 + COLS <= full_hi
            exact = cuda.syncthreads_or(np.int32(not plain and has_nonfinite(v_tile, tid))) != 0
            pv(acc, s, k_tile, v_tile, p_tile, dim_v, tid, exact)

        part = split * batch + b
        for i in range(R):
            row = r0 + row_of(tid, i)
            total = lanes_sum(row_sum[i], ROW_LANES)
            if row < rows_total:
                query, head = row // group, kv_head * group + row % group
                row_lse, factor = NEG_INF, np.float32(0)  # a split without an allowed key adds nothing
                if total != 0:  # the sink joins in the merge: -inf is exactly no sink
                    row_lse, factor = with_sink(row_max[i], total, NEG_INF, np.float32(1))
                for a in range(A):
                    d = feature_of(tid, a)
                    if d < dim_v:
                        o_part[part, query, head, d] = acc[i, a] * factor if total != 0 else np.float32(0)
                if feature_of(tid, 0) == 0:
                    lse_part[part, head, query] = row_lse

    return kernel


@functools.cache
def merge_kernel(dtype: str):
    """o and lse of each (sequence, query row, head), MERGE_LANES threads each: lane l joins the
    splits' partials of features l, l + MERGE_LANES, ..., so that a warp reads each split's o of
    its row in one coalesced pass, and the first lane writes the lse. The sink joins once."""
    bf16 = dtype == "bfloat16"

    @cached_kernel(types.void(_PARTS, _PART_LSE, _tensor(dtype), _LSE, _SINKS, _b, _i), dtype)
    def kernel(o_part, lse_part, o, lse, sinks, has_sinks, num_splits):
        index = cuda.grid(1)
        batch, nq, heads_q, dim_v = o.shape[0], o.shape[1], o.shape[2], o.shape[3]
        row, lane = index // MERGE_LANES, index % MERGE_LANES
        if row >= batch * nq * heads_q:
            return
        b, i, h = row // (nq * heads_q), row // heads_q % nq, row % heads_q
        top = NEG_INF
        for split in range(num_splits):
            top = max_nan(top, lse_part[split * batch + b, h, i])
        reference = np.float32(0) if top == NEG_INF else top  # no split has a key: every weight exp(-inf) = 0
        total = np.float32(0)
        for split in range(num_splits):
            total += math.exp(lse_part[split * batch + b, h, i] - reference)
        sink = sinks[h] if has_sinks else NEG_INF
        row_lse, factor = sink, np.float32(0)  # a row without an allowed key: o = 0, lse = the sink's
        if total != 0:
            row_lse, factor = with_sink(top, total, sink, np.float32(1))
        for d in range(lane, dim_v, MERGE_LANES):
            value = np.float32(0)
            for split in range(num_splits):
                weight = math.exp(lse_part[split * batch + b, h, i] - reference)
                if weight != 0:  # an empty split weighs exactly 0
                    value += weight * o_part[split * batch + b, i, h, d]
            store(o, b, i, h, d, value * factor if total != 0 else np.float32(0), bf16)
        if lane == 0:
            lse[b, h, i] = row_lse

    return kernel


@functools.cache
def append_kernel(dtype: str):
    """New token t of sequence b, kv head h, into its slot at position cache_seqlens[b] + t, a
    thread each; bits copied as they are."""

    x = _tensor(dtype)

    @cached_kernel(types.void(x, x, x, x, _INDEX, _TABLE, _i), dtype)
    def kernel(k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, page_size):
        index = cuda.grid(1)
        batch, new_tokens, heads_k = k_new.shape[0], k_new.shape[1], k_new.shape[2]
        if index >= batch * new_tokens * heads_k:
            return
        b, t, h = index // (new_tokens * heads_k), index // heads_k % new_tokens, index % heads_k
        page, place = slot(np.int64(cache_seqlens[b]) + t, b, block_table, page_size)
        for d in range(k_new.shape[3]):
            k_cache[page, place, h, d] = k_new[b, t, h, d]
        for d in range(v_new.shape[3]):
            v_cache[page, place, h, d] = v_new[b, t, h, d]

    return kernel


def choose_splits(blocks: int, key_tiles: int, sm_count: int) -> int:
    """The split count of ``num_splits=0`` for ``blocks`` (sequence, kv head, row tile) blocks over
    a capacity of ``key_tiles`` tiles (see the module docstring)."""
    return max(1, min(sm_count * RESIDENT_BLOCKS // blocks, -(-key_tiles // MIN_TILES_PER_SPLIT), MAX_SPLITS))


def splits(problem) -> int:
    """How many splits a call runs: ``num_splits``, or ``choose_splits``'s count, never more than the
    cache's key tiles (more would only add empty splits, and leave each split's share as it was)."""
    shape = tiles("decode", problem)
    key_tiles = max(1, -(-problem.capacity // shape.cols))
    chosen = problem.num_splits or choose_splits(problem.batch * problem.heads_k * _row_tiles(problem, shape),
                                                 key_tiles, _sm_count(problem.device_index))
    return min(chosen, key_tiles)


def decode(problem, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new, v_new):
    """(o, lse) after the new tokens are written into the caches; o in q's dtype, lse float32."""
    device = q.device
    index, flag, reals = _placeholders(device)
    seqlens = _device_array(problem.cache_seqlens)
    table = _device_array(index.view(1, 1) if problem.block_table is None else problem.block_table)
    page_size = problem.page_size or 0
    o = torch.empty(problem.o_shape, dtype=q.dtype, device=device)
    lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=device)
    rows = problem.batch * problem.seqlen_q * problem.heads_q
    with _launching(q) as stream:
        if problem.new_tokens:
            with _written(k_cache) as k_target, _written(v_cache) as v_target:
                _launch(append_kernel(problem.dtype), -(-problem.batch * problem.new_tokens * problem.heads_k // THREADS),
                        THREADS, stream, _device_array(k_new), _device_array(v_new), k_target, v_target, seqlens, table,
                        page_size)
        if not rows:
            return o, lse
        shape, count = tiles("decode", problem), splits(problem)
        o_part = torch.empty((count * problem.batch, *problem.o_shape[1:]), dtype=torch.float32, device=device)
        lse_part = torch.empty((count * problem.batch, *problem.lse_shape[1:]), dtype=torch.float32, device=device)
        lse_rows = (problem.batch, problem.heads_q)
        mask = flag if problem.mask is None else _broadcast(problem.mask, (*lse_rows, problem.seqlen_q, problem.seqlen_q))
        slopes = reals if problem.alibi_slopes is None else _broadcast(problem.alibi_slopes, lse_rows)
        reach = problem.capacity + problem.seqlen_q + 1  # an unbounded side of the band: beyond any key
        left, right = (reach if side == -1 else side for side in (problem.band or (-1, -1)))
        row_tiles = _row_tiles(problem, shape)
        parts = _device_array(o_part), _device_array(lse_part)
        _launch(split_kernel(shape, problem.dtype, problem.softcap is not None or problem.alibi_slopes is not None),
                problem.batch * problem.heads_k * row_tiles * count, shape.threads, stream, _device_array(q),
                _device_array(k_cache), _device_array(v_cache), *parts, seqlens, table, _device_array(mask),
                _device_array(slopes), problem.seqlen_q, problem.new_tokens, problem.heads_q, problem.group,
                problem.head_dim, problem.head_dim_v, row_tiles, count, page_size, problem.mask is not None, left,
                right, np.float32(problem.softmax_scale), np.float32(problem.softcap or 0),
                problem.alibi_slopes is not None)
        sinks = reals[0] if problem.sinks is None else problem.sinks
        _launch(merge_kernel(problem.dtype), -(-rows * MERGE_LANES // THREADS), THREADS, stream, *parts,
                _device_array(o), _device_array(lse), _device_array(sinks), problem.sinks is not None, count)
    return o, lse


class _written:
    """A cache as a kernel that writes into it receives it: the cache's own memory on a GPU; in the
    simulator, which takes contiguous arrays only, a contiguous copy of a strided cache, copied back."""

    def __init__(self, cache: torch.Tensor):
        self.cache = cache
        self.copy = cache.contiguous() if SIMULATOR else cache

    def __enter__(self):
        return _device_array(self.copy)

    def __exit__(self, *failure):
        if self.copy is not self.cache:
            self.cache.copy_(self.copy)


def _row_tiles(problem, shape: Tiles) -> int:
    return -(-problem.seqlen_q * problem.group // shape.rows)


@functools.cache
def _sm_count(device_index) -> int:
    if SIMULATOR:
        return SIMULATED_SMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count
