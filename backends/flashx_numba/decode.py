"""Decoding with a KV cache in numba-cuda: split-KV attention (FlashDecoding) over contiguous or paged caches.

Up to three launches on the caller's stream, none of which reads a device value on the host (so a
call with ``validate=False`` makes no host synchronization):

1. ``append_kernel``, with new tokens only: a thread per (new token, kv head) copies its key and
   value rows into their cache slot, found through the block table when the cache is paged.
2. ``split_kernel``: a block per (sequence, kv head, row tile, split). A row tile holds query rows
   of every query head that reads the kv head (Nq x group rows, query-major, padded to
   ``ROW_CHOICES``), so each split's keys and values are read once for the whole GQA group. The
   block's threads form groups of ``key_lanes`` adjacent lanes, a group holding ``keys_held``
   keys at a step, each lane ``FEATURES`` adjacent features of them in registers (``Shape``): on
   a GPU a lane reads a 16-byte run of each key and value row (``load_held``), a warp's groups
   adjacent keys, and a thread issues all its loads of a step before it uses any. Q K^T sums each
   lane's features and then the group's lanes by shuffles; each group keeps its own online
   softmax (``fold_keys``, in log2 units with ``ex2.approx``) and output features, and the groups
   join once, at the end, through shared memory, in a fixed order. Nothing passes through
   shared memory per key and no barrier runs in the key loop. (The kernel this replaced gathered
   each key tile into shared memory element by element, 2-byte loads whose every shared store
   waited for its load before the next load could issue: about 64 loads' latency in series a
   tile, ~55 us.) A thread's keys' table entries and slots are divided out once and stepped a
   tile at a time, the next tile's pages looked up while a tile computes. Only keys that some
   row of the tile may see are loaded, so neither stale slots, unused pages nor table entries
   past a sequence are ever read; a key tile every real row sees in full takes no test, the
   others test every pair (band at the sequence's own length, the tree mask over its last Nq
   keys) and multiply V term by term where a lane's values hold a NaN or an infinity
   (``exact``, as in the forward). The tested (edge) tiles run first, in a loop of their own, so
   that the loop over the plain tiles holds nothing for the tests; a thread holds a 16-bit
   cache's keys, values and its queries as the cache's words, two features a word, widened where
   they are used, and the kernel is compiled with launch bounds of ``RESIDENT_BLOCKS`` blocks
   an SM. Each split writes its normalised output and lse, in float32, without the sink.
3. ``merge_kernel``: a warp per (sequence, query row, head) joins the splits as "Merging partial
   results" says, a split of lse -inf weighing exactly 0, joins the sink once (``with_sink``),
   and rounds o to the caller's dtype. It runs with one split too: the sink and the rounding live
   in one kernel.

The score modifications are the forward's (``score_mods.modify``): softcap and ALiBi on every
split's scores, ALiBi's distance measured from each row's position Lk - Nq + i whatever split
holds the key; the slope is per row, the rows of a tile mixing heads.

A split covers a fixed share of the key tiles its rows may see, computed on the device from the
sequence's length, so a fixed ``num_splits`` gives the same bits on every call. ``num_splits=0``
takes the core's rule (``flashx.splits``, FA3's heuristic in units of blocks), with this kernel's
tiles and ``RESIDENT_BLOCKS`` blocks an SM (the number its registers let one hold), chosen from the
cache's capacity (which the host knows) rather than the lengths (which only the device holds).
Not yet tuned on a GPU.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch
from numba import cuda, types

from flashx.splits import decode_splits
from flashx_numba.attention import _broadcast, _device_array, _launch, _launching, _placeholders
from flashx_numba.disk_cache import cached_kernel
from flashx_numba.kernels import LOG2E, _tensor
from flashx_numba.primitives import (NEG_INF, SIMULATOR, SKIP, bits_of_float, device_function, exp2, float_from_bits,
                                     lanes_sum, load, max_nan, skipped, store)
from flashx_numba.score_mods import modify, with_sink

#: Split blocks an SM holds at once, by the caches' dtype: a 16-bit cache's kernel is compiled with
#: launch bounds of three blocks of 128 threads (ptxas, sm_90: 168 registers and 56-72 bytes of
#: spills, d64 to d256, with and without score mods; unbounded it takes 213-226). On an H200 three
#: blocks ran 6% faster than two at B=16, L=8k and 20% slower at B=1, where the split count,
#: which follows the resident blocks, is larger (benchmarks/results/decode-h200.md). A float32 cache's
#: kernel, holding twice the words, takes 230 registers unbounded (bounded to 168 it spilled ~300
#: bytes in the key loop).
RESIDENT_BLOCKS = {"float16": 3, "bfloat16": 3, "float32": 2}
SIMULATED_SMS = 4  # the stand-in SM count in the simulator, so that small problems split too
THREADS = 1 if SIMULATOR else 64  # of the append and merge kernels (the simulator runs each as a Python thread)
#: The merge's threads a row: a warp, whose lanes read consecutive features of each split's o, where
#: one thread a row would read them one by one, each load far from its neighbours' and waiting out
#: its latency; one in the simulator, where each is a Python thread.
MERGE_LANES = 1 if SIMULATOR else 32
#: The split kernel's rows a block: a GQA group's rows of its queries (Nq x group) padded to the
#: next of these; more rows take several row tiles, each reading the keys again.
ROW_CHOICES = (4,)
#: A lane's features of a key on a GPU: one 16-byte load of a 16-bit cache (two of a float32 one).
FEATURES = 8
KEYS_HELD = 4  # keys a lane group holds at a step: its loads in flight at once
SPLIT_THREADS = 128
#: The simulator's (key_lanes, keys_held, threads): one thread a block, holding whole rows of 32 keys
#: (each tile operation one NumPy call); it has no warp shuffles, so a key's features stay in one thread.
SIMULATOR_LANES = (1, 32, 1)
LN2 = np.float32(math.log(2))

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


class Shape(NamedTuple):
    """The split kernel's compile-time shape: ``rows`` query rows a block, ``threads`` threads in
    groups of ``key_lanes`` adjacent lanes, each group holding ``keys_held`` keys at a step and each
    lane of it ``features`` adjacent features of them, up to ``width`` (the head-dim class)."""

    rows: int
    key_lanes: int
    keys_held: int
    threads: int
    width: int

    @property
    def features(self) -> int:
        return self.width // self.key_lanes

    @property
    def groups(self) -> int:
        return self.threads // self.key_lanes

    @property
    def cols(self) -> int:
        """The keys of a key tile: every group's keys of one step."""
        return self.groups * self.keys_held


def split_shape(problem) -> Shape:
    """The split kernel's shape for ``problem``: the fewest of ``ROW_CHOICES`` rows that hold a GQA
    group's rows of its queries (several row tiles past the last), and the GPU's or the simulator's
    lanes (``KEY_LANES_OF``)."""
    rows = problem.seqlen_q * problem.group
    rows = next((choice for choice in ROW_CHOICES if choice >= rows), ROW_CHOICES[-1])
    width = problem.head_dim_class
    key_lanes, keys_held, threads = SIMULATOR_LANES if SIMULATOR else (width // FEATURES, KEYS_HELD, SPLIT_THREADS)
    return Shape(rows, key_lanes, keys_held, threads, width)


# -- what one thread does with the keys it holds ---------------------------------------------------
#
# A thread holds, in registers, ``features`` adjacent features (from f0 on) of: its rows' queries,
# q_held (rows x words); the keys it holds at a step, k_held and v_held (keys_held x words); its
# rows' output, acc (rows x features, float32). On a GPU a row's words are the tensor's own bits,
# two 16-bit features a word (``feature`` widens one where it is used): half the registers of
# float32 values, which took the kernel to 243 registers a thread. In the simulator they are the
# float32 values. Every loop below runs over those compile-time shapes and unrolls, so the arrays
# index by constants only and stay in registers.

if SIMULATOR:

    def load_held(held, x, pages, places, head, f0, width, wide, run, bf16):
        """held[u, a] = x[pages[u], places[u], head, f0 + a] as float32 (the simulator holds values,
        not words), 0 where f0 + a >= width or pages[u] < 0 (the key is not loaded). One NumPy gather."""
        held[:, :] = 0
        used = np.flatnonzero(pages >= 0)
        count = max(0, min(held.shape[1], width - f0))
        rows = x[pages[used], places[used], head, f0 : f0 + count]
        held[used, :count] = (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if bf16 else rows

    def load_row(held, r, x, b, n, head, f0, width, run, bf16):
        """held[r, a] = x[b, n, head, f0 + a] as float32, 0 where f0 + a >= width."""
        for a in range(held.shape[1]):
            held[r, a] = load(x, b, n, head, f0 + a, bf16) if f0 + a < width else np.float32(0)

    def partial_scores(s, q_held, k_held, run, bf16):
        """s[r, u] = sum over this thread's features of q_held[r] * k_held[u] (summed in float64 and
        rounded once, as ``primitives.scores``)."""
        s[:, :] = q_held.astype(np.float64) @ k_held.astype(np.float64).T

    def add_values(acc, p, v_held, exact, run, bf16):
        """acc[r, a] += sum over u of p[r, u] * v_held[u, a]; terms whose weight is SKIP add nothing
        (whatever ``exact``: ``primitives.accumulate``'s NumPy form)."""
        kept = ~(np.signbit(p) & (p == 0))
        with np.errstate(invalid="ignore", over="ignore"):  # SKIP x (NaN or inf), discarded by the where
            terms = np.where(kept[:, :, None], p[:, :, None] * v_held[None, :, :], np.float32(0))
        acc += terms.sum(axis=1)

    def has_nonfinite_held(held, run, bf16):
        """Never asked here: ``add_values`` skips terms itself."""
        return False

else:
    from flashx_numba.mma import global_load_intrinsics, intrinsics

    global_address, global_quad = global_load_intrinsics()
    pack_half, widen_half = intrinsics("float16")[1:]
    pack_bfloat = intrinsics("bfloat16")[1]

    @device_function
    def load_held(held, x, pages, places, head, f0, width, wide, run, bf16):
        """held[u] = the words of x[pages[u], places[u], head, f0:f0 + features] (16-bit features
        two a word, the lower first), 0 where f0 + a >= width or pages[u] < 0 (the key is not
        loaded; nothing is read for it).

        ``wide`` (a layout whose rows and features start on 16 bytes and hold whole 16-byte
        runs, see ``_wide``): one predicated 16-byte load a run of ``run`` features, every load of
        the thread issued before any of its words is used. Otherwise element by element, two
        16-bit features packed into a word (exact: each is the 16-bit value it was). A
        compile-time choice: with both forms in one kernel, the element loads' loops, too long
        to unroll, would index ``held`` by a loop counter and put it in local memory for both."""
        if wide:
            for u in range(held.shape[0]):
                for c in range(held.shape[1] // 4):
                    d = f0 + c * run
                    words = global_quad(global_address(x, pages[u], places[u], head, d), pages[u] >= 0 and d < width)
                    for w in range(4):
                        held[u, c * 4 + w] = words[w]
        else:
            for u in range(held.shape[0]):
                if pages[u] >= 0:
                    load_row(held, u, x, pages[u], places[u], head, f0, width, run, bf16)
                else:
                    for w in range(held.shape[1]):
                        held[u, w] = 0

    @device_function
    def load_row(held, r, x, b, n, head, f0, width, run, bf16):
        """held[r] = the words of x[b, n, head, f0:f0 + features], element by element, two 16-bit
        features packed into a word (exact: each is the 16-bit value it was); 0 past ``width``."""
        for w in range(held.shape[1]):
            if run == 4:
                held[r, w] = bits_of_float(element(x, b, n, head, f0 + w, width, bf16))
            else:
                low = element(x, b, n, head, f0 + 2 * w, width, bf16)
                high = element(x, b, n, head, f0 + 2 * w + 1, width, bf16)
                held[r, w] = pack_bfloat(low, high) if bf16 else pack_half(low, high)

    @device_function
    def element(x, b, n, head, d, width, bf16):
        """x[b, n, head, d] as float32, 0 where d >= width (not read)."""
        return load(x, b, n, head, d, bf16) if d < width else np.float32(0)

    @device_function
    def feature(held, u, a, run, bf16):
        """Feature a of key u of ``held``, as float32: a bfloat16 is float32's upper half, so its
        widening is one shift or mask."""
        if run == 4:
            return float_from_bits(np.int32(held[u, a]))
        word = held[u, a // 2]
        if bf16:
            return float_from_bits(np.int32(word & np.uint32(0xFFFF0000) if a % 2 else word << np.uint32(16)))
        return widen_half(word >> np.uint32(16) if a % 2 else word)

    @device_function
    def partial_scores(s, q_held, k_held, run, bf16):
        """s[r, u] = sum over this thread's features of q_held[r] * k_held[u]: a float32 FMA chain."""
        for r in range(s.shape[0]):
            for u in range(s.shape[1]):
                total = np.float32(0)
                for a in range(k_held.shape[1] * run // 4):
                    total += feature(q_held, r, a, run, bf16) * feature(k_held, u, a, run, bf16)
                s[r, u] = total

    @device_function
    def add_values(acc, p, v_held, exact, run, bf16):
        """acc[r, a] += sum over u of p[r, u] * v_held[u, a]; where ``exact``, terms whose weight is
        SKIP add nothing (without it, SKIP x finite adds -0 or +0: see ``primitives.accumulate``)."""
        if exact:
            weighted_values(acc, p, v_held, True, run, bf16)
        else:
            weighted_values(acc, p, v_held, False, run, bf16)

    @device_function
    def weighted_values(acc, p, v_held, skipping, run, bf16):
        for u in range(v_held.shape[0]):
            for r in range(acc.shape[0]):
                weight = p[r, u]
                if not (skipping and skipped(weight)):
                    for a in range(acc.shape[1]):
                        acc[r, a] += weight * feature(v_held, u, a, run, bf16)

    @device_function
    def has_nonfinite_held(held, run, bf16):
        """Whether ``held`` holds a NaN or an infinity."""
        seen = np.uint32(0)
        for u in range(held.shape[0]):
            for a in range(held.shape[1] * run // 4):
                x = feature(held, u, a, run, bf16)
                seen |= np.uint32(x - x != 0)
        return seen != 0


@device_function
def locate(index, places, first, groups, size):
    """index[u], places[u]: the table entry and slot of this thread's key first + u * groups, in pages
    of ``size`` keys (32-bit division: a key's position is below 2^31)."""
    for u in range(index.shape[0]):
        key = np.uint32(first + u * groups)
        index[u], places[u] = key // np.uint32(size), key % np.uint32(size)


@device_function
def advance(index, places, step_index, step_place, size):
    """index and places one key tile (``step_index`` pages and ``step_place`` slots) on: no division."""
    for u in range(index.shape[0]):
        places[u] += step_place
        index[u] += step_index
        if places[u] >= size:
            places[u] -= size
            index[u] += 1


@device_function
def find_pages(pages, index, b, block_table, paged):
    """pages[u]: the page of table entry ``index[u]`` of sequence b (a contiguous cache: b)."""
    for u in range(pages.shape[0]):
        pages[u] = block_table[b, index[u]] if paged else b


@device_function
def fold_keys(s, r, tile_max, row_max, row_sum, acc):
    """Row r of a step's scores ``s``, in log2 units (-inf where disallowed; ``tile_max`` their
    maximum), into this thread's online softmax: ``kernels.fold_row`` with 2^x for e^x, one
    ``ex2.approx`` a weight where ``math.exp`` takes about eight instructions (decoding computes
    a weight per key and row for few products). s[r] becomes the row's P, SKIP where disallowed."""
    new_max = max_nan(row_max[r], tile_max)
    reference = np.float32(0) if new_max == NEG_INF else new_max  # no key yet: 2^(-inf - 0) = 0
    rescale = exp2(row_max[r] - reference)
    tile_sum = np.float32(0)
    for u in range(s.shape[1]):
        score = s[r, u]
        p = exp2(score - reference)
        tile_sum += p
        s[r, u] = SKIP if score == NEG_INF else p
    row_sum[r] = row_sum[r] * rescale + tile_sum
    row_max[r] = new_max
    for a in range(acc.shape[1]):
        acc[r, a] *= rescale


@functools.cache
def split_kernel(shape: Shape, dtype: str, score_mods: bool, wide: bool):
    """One split of one row tile: partial o and lse for a grid of B * Hk * row_tiles * splits blocks
    of ``shape.threads``. ``score_mods``: the scores take a softcap or ALiBi; ``wide``: the caches
    take 16-byte loads (``load_held``).

    A split's key tiles are of two kinds. Plain tiles, seen in full by every real row of the
    tile, take no test: their loop holds only what it computes with (queries, output, the held
    keys, the online softmax and the keys' places), none of the tests' bounds, rows or flags,
    so that more blocks fit an SM. The edge tiles (a partial tile at either end of the rows'
    band, the tree mask's last Nq keys) run first, in a loop of their own that tests every pair
    and finds each tile's places afresh (a division a key: a few tiles a split)."""
    bf16 = dtype == "bfloat16"
    ROWS, LANES, KEYS, THREADS_A_BLOCK, WIDTH = shape
    FEATURES_HELD, GROUPS, COLS = shape.features, shape.groups, shape.cols
    x = _tensor(dtype)
    RUN = 128 // x.dtype.bitwidth  # features of a 16-byte load (a compile-time constant, unlike x.itemsize)
    # a key's features a lane holds: values in the simulator, the cache's words (two 16-bit features each) on a GPU
    WORDS, HELD = (FEATURES_HELD, np.float32) if SIMULATOR else (FEATURES_HELD * 4 // RUN, np.uint32)

    @device_function
    def tile_scores(s, first, masked, queries, row_slopes, diagonal, scale_log2, scale, softcap, r0, rows_total,
                    group, kv_head, nq, left, right, has_mask, mask, b):
        """s[r, u]: the score, in log2 units, of row r and key first + u * GROUPS from this thread's
        partial sums, -inf where ``masked`` and the pair is not allowed."""
        for r in range(ROWS):
            for u in range(KEYS):
                offset = first + u * GROUPS - diagonal  # the key's position from query 0's
                score = lanes_sum(s[r, u], LANES)
                if score_mods:
                    score, _ = modify(score * scale, softcap, row_slopes[r], queries[r] - offset)
                    score *= LOG2E
                else:
                    score *= scale_log2
                if masked:
                    row = r0 + r
                    query = queries[r]
                    seen = row < rows_total and offset < nq and query - left <= offset <= query + right
                    if seen and has_mask and offset >= 0:
                        seen = mask[b, kv_head * group + row % group, query, offset]
                    score = score if seen else NEG_INF
                s[r, u] = score

    @device_function
    def fold_tile(s, masked, row_max, row_sum, acc, v_held):
        """A key tile's scores ``s`` and values into the online softmax and output; where ``masked``,
        a lane's values that hold a NaN or an infinity take their terms one by one (``exact``)."""
        for r in range(ROWS):
            tile_max = NEG_INF
            for u in range(KEYS):
                tile_max = max_nan(tile_max, s[r, u])
            fold_keys(s, r, tile_max, row_max, row_sum, acc)
        add_values(acc, s, v_held, masked and has_nonfinite_held(v_held, RUN, bf16), RUN, bf16)

    bounds = (THREADS_A_BLOCK, RESIDENT_BLOCKS[dtype]) if x.dtype.bitwidth == 16 else None

    @cached_kernel(types.void(x, x, x, _PARTS, _PART_LSE, _INDEX, _TABLE, _FLAGS, _SLOPES, _i, _i, _i, _i, _i, _i, _i,
                              _i, _i, _b, _i, _i, _f, _f, _b), shape, dtype, score_mods, wide, launch_bounds=bounds)
    def kernel(q, k_cache, v_cache, o_part, lse_part, cache_seqlens, block_table, mask, slopes, nq, new_tokens,
               heads_q, group, dim, dim_v, row_tiles, num_splits, page_size, has_mask, left, right, scale, softcap,
               has_alibi):
        tid = cuda.threadIdx.x
        key_group, f0 = tid // LANES, tid % LANES * FEATURES_HELD
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
        # The split's plain tiles [plain_lo, plain_hi), inside [full_lo, full_hi) (so inside [lo, hi)).
        plain_lo = min(max(-(-full_lo // COLS), s_lo), s_hi)
        plain_hi = min(max(full_hi // COLS, plain_lo), s_hi)

        # The tile's rows (query-major: row = query * group + head in the group), 0 past the real ones.
        q_held = cuda.local.array((ROWS, WORDS), HELD)
        queries = cuda.local.array(ROWS, np.int32)
        row_slopes = cuda.local.array(ROWS, np.float32)
        for r in range(ROWS):
            row = r0 + r
            query, head = row // group, kv_head * group + row % group
            queries[r] = query
            row_slopes[r] = slopes[b, head] if has_alibi and row < rows_total else np.float32(0)
            load_row(q_held, r, q, b, query, head, f0, dim if row < rows_total else 0, RUN, bf16)
        row_max = cuda.local.array(ROWS, np.float32)  # in log2 units, as the scores
        row_sum = cuda.local.array(ROWS, np.float32)
        acc = cuda.local.array((ROWS, FEATURES_HELD), np.float32)
        for r in range(ROWS):
            row_max[r] = NEG_INF
            row_sum[r] = 0
            for a in range(FEATURES_HELD):
                acc[r, a] = 0

        # This thread's keys of key tile t are t * COLS + u * GROUPS + key_group, u < KEYS: a step's
        # loads of a warp's groups lie side by side. Their table entries and slots are 32-bit (fewer
        # registers), divided out for an edge tile and for the first plain one, then stepped a
        # plain tile at a time, each tile's pages looked up while the tile before it computes.
        paged = page_size != 0
        size = np.int32(page_size if paged else 2**31 - 1)  # a contiguous cache: a page a sequence
        index = cuda.local.array(KEYS, np.int32)
        places = cuda.local.array(KEYS, np.int32)
        pages = cuda.local.array(KEYS, np.int32)
        k_held = cuda.local.array((KEYS, WORDS), HELD)
        v_held = cuda.local.array((KEYS, WORDS), HELD)
        s = cuda.local.array((ROWS, KEYS), np.float32)
        scale_log2 = scale * LOG2E

        # The edge tiles, those before the plain ones and those after, each on its own: only keys in
        # [lo, hi) are loaded (no stale slot, unused page or table entry past a sequence is read).
        head_edges = plain_lo - s_lo
        for e in range(head_edges + s_hi - plain_hi):
            t = s_lo + e if e < head_edges else plain_hi + e - head_edges
            first = t * COLS + key_group
            locate(index, places, first, GROUPS, size)
            for u in range(KEYS):
                key = first + u * GROUPS
                pages[u] = (block_table[b, index[u]] if paged else b) if lo <= key < hi else -1
            load_held(k_held, k_cache, pages, places, kv_head, f0, dim, wide, RUN, bf16)
            load_held(v_held, v_cache, pages, places, kv_head, f0, dim_v, wide, RUN, bf16)
            partial_scores(s, q_held, k_held, RUN, bf16)
            tile_scores(s, first, True, queries, row_slopes, diagonal, scale_log2, scale, softcap, r0, rows_total,
                        group, kv_head, nq, left, right, has_mask, mask, b)
            fold_tile(s, True, row_max, row_sum, acc, v_held)

        # The plain tiles: every key loaded, no pair tested.
        step_index, step_place = np.int32(COLS // size), np.int32(COLS % size)
        locate(index, places, plain_lo * COLS + key_group, GROUPS, size)
        if plain_lo < plain_hi:
            find_pages(pages, index, b, block_table, paged)
        for t in range(plain_lo, plain_hi):
            load_held(k_held, k_cache, pages, places, kv_head, f0, dim, wide, RUN, bf16)
            load_held(v_held, v_cache, pages, places, kv_head, f0, dim_v, wide, RUN, bf16)
            advance(index, places, step_index, step_place, size)
            if t + 1 < plain_hi:
                find_pages(pages, index, b, block_table, paged)
            partial_scores(s, q_held, k_held, RUN, bf16)
            tile_scores(s, t * COLS + key_group, False, queries, row_slopes, diagonal, scale_log2, scale, softcap, r0,
                        rows_total, group, kv_head, nq, left, right, has_mask, mask, b)
            fold_tile(s, False, row_max, row_sum, acc, v_held)

        # The groups' states joined in a fixed order (the same bits on every call), as the merge
        # joins splits: a group without an allowed key weighs exactly 0.
        group_max = cuda.shared.array((GROUPS, ROWS), np.float32)
        group_sum = cuda.shared.array((GROUPS, ROWS), np.float32)
        group_acc = cuda.shared.array((GROUPS, ROWS, WIDTH), np.float32)
        for r in range(ROWS):
            if f0 == 0:
                group_max[key_group, r], group_sum[key_group, r] = row_max[r], row_sum[r]
            for a in range(FEATURES_HELD):
                group_acc[key_group, r, f0 + a] = acc[r, a]
        cuda.syncthreads()
        part = split * batch + b
        for place in range(tid, ROWS * WIDTH, THREADS_A_BLOCK):
            r, d = place // WIDTH, place % WIDTH
            row = r0 + r
            if row < rows_total and d < dim_v:
                top = NEG_INF
                for g in range(GROUPS):
                    top = max_nan(top, group_max[g, r])
                reference = np.float32(0) if top == NEG_INF else top
                total, value = np.float32(0), np.float32(0)
                for g in range(GROUPS):
                    weight = exp2(group_max[g, r] - reference)
                    if weight != 0:
                        total += group_sum[g, r] * weight
                        value += group_acc[g, r, d] * weight
                query, head = row // group, kv_head * group + row % group
                row_lse, factor = NEG_INF, np.float32(0)  # a split without an allowed key adds nothing
                if total != 0:  # the sink joins in the merge: -inf is exactly no sink
                    row_lse, factor = with_sink(top * LN2, total, NEG_INF, np.float32(1))
                o_part[part, query, head, d] = value * factor if total != 0 else np.float32(0)
                if d == 0:
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


def splits(problem) -> int:
    """How many splits a call runs: ``flashx.splits.decode_splits`` with this kernel's tiles
    (``split_shape``) on the problem's GPU, or the simulator's stand-in of ``SIMULATED_SMS`` SMs."""
    shape = split_shape(problem)
    return decode_splits(problem, sm_count=_sm_count(problem.device_index), block_n=shape.cols, block_m=shape.rows,
                         per_sm=RESIDENT_BLOCKS[problem.dtype]).count


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
        shape, count = split_shape(problem), splits(problem)
        o_part = torch.empty((count * problem.batch, *problem.o_shape[1:]), dtype=torch.float32, device=device)
        lse_part = torch.empty((count * problem.batch, *problem.lse_shape[1:]), dtype=torch.float32, device=device)
        lse_rows = (problem.batch, problem.heads_q)
        mask = flag if problem.mask is None else _broadcast(problem.mask, (*lse_rows, problem.seqlen_q, problem.seqlen_q))
        slopes = reals if problem.alibi_slopes is None else _broadcast(problem.alibi_slopes, lse_rows)
        reach = problem.capacity + problem.seqlen_q + 1  # an unbounded side of the band: beyond any key
        left, right = (reach if side == -1 else side for side in (problem.band or (-1, -1)))
        row_tiles = _row_tiles(problem, shape)
        parts = _device_array(o_part), _device_array(lse_part)
        mods = problem.softcap is not None or problem.alibi_slopes is not None
        _launch(split_kernel(shape, problem.dtype, mods, _wide(k_cache, v_cache)),
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


def _wide(*caches: torch.Tensor) -> bool:
    """Whether the caches take the split kernel's 16-byte loads: every row of a key or value (and
    each 16-byte run of features in it) starts on 16 bytes, and holds whole runs."""
    for cache in caches:
        run = 16 // cache.element_size()
        strides = cache.stride()
        if strides[-1] != 1 or cache.shape[-1] % run or cache.data_ptr() % 16 or any(st % run for st in strides[:-1]):
            return False
    return True


def _row_tiles(problem, shape: Shape) -> int:
    return -(-problem.seqlen_q * problem.group // shape.rows)


@functools.cache
def _sm_count(device_index) -> int:
    if SIMULATOR:
        return SIMULATED_SMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count
