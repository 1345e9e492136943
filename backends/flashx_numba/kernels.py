"""The kernels, in FlashAttention-2 order: the forward, and the backward's delta, dK/dV and dQ kernels.

Every kernel sees q, k, v, o and their gradients as (B, N, H, D) arrays with any strides (a
varlen (T, H, D) tensor arrives as (1, T, H, D), its sequences found through cu_seqlens), lse
and delta as (B, H, N). Indexing goes through the arrays' strides in 64-bit arithmetic, so no
offset can overflow.

- forward: one block per (query tile, query head, sequence), on one grid axis (no 65535 limit
  on B * H). K and V stream through shared memory a tile at a time, skipping tiles the band
  (causal, window) or the block mask leaves empty; on tensor cores the copies run beside the
  products (a tile's V lands while its scores are computed, the next tile's K during P V). The scores of a tile stay in registers,
  where the online softmax works on them in float32, the row maximum reduced across lanes by
  shuffles: on tensor cores for float16 and bfloat16, in float32 micro-tiles otherwise (the
  two ``fragments`` forms, behind one kernel).
- delta: D = rowsum(dO * O), one thread per (row, head).
- dK/dV: one block per (key tile, kv head, sequence), looping over the query tiles and every
  query head of the GQA group: each key's gradients are summed in one block, in a fixed
  order, with no atomics (a deterministic backward).
- dQ: one block per (query tile, query head, sequence), looping over the key tiles.

The dK/dV and dQ kernels run their products on the forward's two forms too: tensor cores for
float16 and bfloat16 (the scores and dP in registers, P and dS reused as A operands), float32
micro-tiles otherwise.

The backward recomputes P = exp(S - lse) from scores computed exactly as in the forward.
A pair that adds nothing (disallowed, or dropped) gets the weight SKIP, whose terms the tile
products leave out: NaN or inf that only such pairs read never reaches an output, while NaN
in data an allowed pair reads propagates.

The score modifications (``score_mods``): softcap and ALiBi where the scores are scaled, in the
forward and in both backward kernels' recomputed scores, whose dS then goes through the
softcap's derivative; a sink joins each row once, after its last key tile, and the dQ kernel,
which visits every key tile of its rows, writes each row's term of dsinks (0 for a row with no
allowed key), summed on the host in a fixed order.

The kernels are compiled once per ``Tiles`` (compile-time tile shapes), dtype (bfloat16
travels as int16 bit patterns, and to the tensor cores as int32 words of feature pairs) and
whether the scores take a softcap or ALiBi (``score_mods``: without, the kernels hold none of
their code; the dQ kernel also by whether it writes the terms of dsinks), on first use, and
kept on disk (``disk_cache``): a later process loads them, compiled; head dims, lengths,
layouts and options, the softcap, slopes and sinks among them, are run-time arguments.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, types

from flashx_numba.disk_cache import cached_kernel
from flashx_numba.fragments import micro_tile_form, tensor_core_form
from flashx_numba.philox import dropout_keep
from flashx_numba.primitives import (NEG_INF, SIMULATOR, SKIP, device_function, exp2, lanes_max, lanes_sum, load,
                                     max_nan, store)
from flashx_numba.score_mods import modify, sink_term, through_softcap, with_sink


@dataclass(frozen=True)
class Tiles:
    """A kernel's compile-time shape: ``rows`` rows of its own and tiles of ``cols`` rows of the
    other axis, ``row_groups`` x ``lanes`` threads (see ``primitives``), feature columns up to
    ``width`` (the head dims, D and Dv, at most)."""

    rows: int
    cols: int
    row_groups: int
    lanes: int
    width: int

    @property
    def threads(self) -> int:
        return self.row_groups * self.lanes

    def __post_init__(self):
        assert self.rows % self.row_groups == 0 and self.cols % self.lanes == 0 and self.width % self.lanes == 0
        assert 32 % self.lanes == 0, "the lanes of a row must lie in one warp"


# -- signatures: one compile per kernel, tile shape and storage dtype -----------------------------
#
# Arrays are typed with any layout ("A"), so transposed, sliced or broadcast inputs reuse the
# kernel compiled for contiguous ones, lse and delta excepted; bfloat16 is stored as int16 bit patterns.

#: The alignment of the shared tiles, in bytes: whole 16-byte copies, ``ldmatrix`` rows and
#: the micro-tiles' 16-byte loads (the simulator takes none).
ALIGNED = None if SIMULATOR else 16
STORAGE = {"float16": types.float16, "bfloat16": types.int16, "float32": types.float32}
_ROWS = types.Array(types.float32, 3, "C")  # lse, delta: contiguous, so a thread's rows lie at constant offsets
_INDEX = types.Array(types.int32, 1, "A")  # cu_seqlens, seqlens
_FLAGS = types.Array(types.boolean, 4, "A")  # mask, block mask
_SLOPES = types.Array(types.float32, 2, "A")  # ALiBi's slopes, (B, Hq): (Hq,) ones broadcast
_SINKS = types.Array(types.float32, 1, "A")
_i, _b, _f = types.int64, types.boolean, types.float32
_COMMON = (_INDEX, _INDEX, _INDEX, _INDEX, _FLAGS, _FLAGS, _i, _i, _i, _i, _i, _i, _b, _b, _b, _b, _b, _i, _i, _i, _i,
           _f, _b, _i, _i, _i, _i, _f, _i, _i, _f, _SLOPES, _b, _SINKS, _b)


def _tensor(dtype: str):
    return types.Array(STORAGE[dtype], 4, "A")


def _form(tiles: Tiles, dtype: str, tensor_cores: bool):
    """(the ``fragments`` form of a kernel, the type of its inputs): on tensor cores, q, k, v (and
    dO) arrive as int32 words of feature pairs."""
    if tensor_cores:
        form = tensor_core_form(tiles.rows, tiles.cols, tiles.width, dtype)
        inputs = types.Array(types.int32, 4, "A")
    else:
        form = micro_tile_form(tiles.rows, tiles.cols, tiles.row_groups, tiles.lanes, tiles.width, dtype == "bfloat16")
        inputs = _tensor(dtype)
    assert form.threads == tiles.threads and (SIMULATOR or form.held_rows * form.held_cols <= 64)  # pair flags
    return form, inputs


# -- what every kernel asks of a sequence ------------------------------------------------------


@device_function
def sequence(b, cu_seqlens, seqlens, padded, varlen, has_seqlens):
    """(first row of sequence b in its tensor, its length)."""
    if varlen:
        start = np.int64(cu_seqlens[b])
        return start, np.int64(cu_seqlens[b + 1]) - start
    if has_seqlens:
        return np.int64(0), np.int64(seqlens[b])
    return np.int64(0), np.int64(padded)


@device_function
def allowed(i, j, lq, lk, left, right, b, h, mask, has_mask, blocks, has_blocks, block_q, block_k):
    """Whether query i may attend key j of sequence b, head h (the contract's Scores and masking
    section); ``left``/``right`` are the band's reaches, unbounded ones larger than any length."""
    if i >= lq or j >= lk:
        return False
    diagonal = i + lk - lq
    if j < diagonal - left or j > diagonal + right:
        return False
    if has_mask and not mask[b, h, i, j]:
        return False
    if has_blocks and not blocks[b, h, i // block_q, j // block_k]:
        return False
    return True


@device_function
def keys_seen(i0, i1, lq, lk, left, right):
    """[lo, hi): the keys the band lets any of the queries i0:i1 (i1 <= lq) see."""
    lo = max(np.int64(0), i0 + lk - lq - left)
    hi = min(lk, i1 - 1 + lk - lq + right + 1)
    return lo, max(lo, hi)


@device_function
def queries_seeing(j0, j1, lq, lk, left, right):
    """[lo, hi): the queries the band lets see any of the keys j0:j1 (j1 <= lk)."""
    lo = max(np.int64(0), j0 - (lk - lq) - right)
    hi = min(lq, j1 - 1 - (lk - lq) + left + 1)
    return lo, max(lo, hi)


@device_function
def inside_band(i0, i1, j0, j1, lq, lk, left, right):
    """Whether every pair of queries i0:i1 and keys j0:j1 lies in the sequence and the band."""
    diagonal = lk - lq
    return i1 <= lq and j1 <= lk and j0 >= i1 - 1 + diagonal - left and j1 - 1 <= i0 + diagonal + right


@device_function
def any_block(blocks, b, h, i0, i1, j0, j1, block_q, block_k):
    """Whether any block of the block mask covering queries i0:i1 and keys j0:j1 is allowed."""
    for bi in range(i0 // block_q, (i1 - 1) // block_q + 1):
        for bj in range(j0 // block_k, (j1 - 1) // block_k + 1):
            if blocks[b, h, bi, bj]:
                return True
    return False


@device_function
def key_tile_from(j0, hi, cols, lk, i0, i1, b, h, blocks, has_blocks, block_q, block_k):
    """The first tile of ``cols`` keys from key j0 on (below hi) that the block mask lets any of
    the queries i0:i1 see; hi if none."""
    while j0 < hi and has_blocks and not any_block(blocks, b, h, i0, i1, j0, min(j0 + cols, lk), block_q, block_k):
        j0 += cols
    return j0


@device_function
def fold_row(s, i, tile_max, row_max, row_sum, acc, dropped, row_lanes):
    """Row i of a tile's scores ``s`` (-inf where disallowed; ``tile_max`` this thread's maximum
    of them) into the online softmax's running maximum, sum and accumulator; s[i] becomes the
    row's P, SKIP where disallowed or dropped (bit i * C + c of ``dropped``, C the held columns)."""
    C, A = s.shape[1], acc.shape[1]
    new_max = max_nan(row_max[i], lanes_max(tile_max, row_lanes))
    reference = np.float32(0) if new_max == NEG_INF else new_max  # no key yet: exp(-inf - 0) = 0
    rescale = math.exp(row_max[i] - reference)
    tile_sum = np.float32(0)
    for c in range(C):
        score = s[i, c]
        p = math.exp(score - reference)
        tile_sum += p  # dropped pairs count here too
        s[i, c] = SKIP if score == NEG_INF or (dropped >> (i * C + c)) & 1 else p
    row_sum[i] = row_sum[i] * rescale + tile_sum
    row_max[i] = new_max
    for a in range(A):
        acc[i, a] *= rescale


#: Pair flags (``pair_flags``): bit i * held_cols + c for a thread's held element (i, c), an
#: int64 on a GPU; the simulator's one thread a block holds a whole tile, its flags Python integers.
ONE_PAIR = 1 if SIMULATOR else np.int64(1)
NO_PAIRS = 0 if SIMULATOR else np.int64(0)
LOG2E = np.float32(math.log2(math.e))


@functools.cache
def _pair_flags(form):
    """``pair_flags`` for a form's held elements: element (i, c) pairs the block's own row
    ``row_of(tid, i)`` with streamed row ``col_of(tid, c)``, queries or keys as ``keys_are_rows`` says."""
    R, C, row_of, col_of = form.held_rows, form.held_cols, form.row_of, form.col_of

    @device_function
    def pair_flags(i0, j0, keys_are_rows, tid, plain, lq, lk, left, right, b, h, mask, has_mask, blocks, has_blocks,
                   block_q, block_k, dropout, row_offset, key_offset, stream, rng_offset, seed_low, seed_high,
                   threshold):
        """(masked, dropped): bit i * held_cols + c of masked says that the pair of held element
        (i, c) (query tile i0, key tile j0) is disallowed, of dropped that it is dropped. Two
        words, not arrays: the tests' loops need not unroll for the flags to stay in registers."""
        masked = dropped = NO_PAIRS
        if plain and not dropout:
            return masked, dropped
        for i in range(R):
            for c in range(C):
                query = i0 + (col_of(tid, c) if keys_are_rows else row_of(tid, i))
                key = j0 + (row_of(tid, i) if keys_are_rows else col_of(tid, c))
                if not plain and not allowed(query, key, lq, lk, left, right, b, h, mask, has_mask, blocks, has_blocks,
                                             block_q, block_k):
                    masked |= ONE_PAIR << (i * C + c)
                if dropout and not dropout_keep(row_offset + query, key_offset + key, stream, rng_offset, seed_low,
                                                seed_high, threshold):
                    dropped |= ONE_PAIR << (i * C + c)
        return masked, dropped

    return pair_flags


# -- the kernels ------------------------------------------------------------------------------
#
# Common arguments, in this order after the kernel's arrays:
#   cu_q, cu_k, seqlens_q, seqlens_k, mask (B, Hq, Nq, Nk) and blocks (B, Hq, Nq/bq, Nk/bk)
#   (broadcast views; placeholders when absent), nq, nk (padded or longest lengths), heads_q,
#   group, dim, dim_v, varlen, has_seqlens_q, has_seqlens_k, has_mask, has_blocks, block_q,
#   block_k, left, right, scale, dropout, threshold, seed_low, seed_high, rng_offset, drop_scale,
#   row_offset, key_offset (dropout_offsets: the draw's positions of query 0 and key 0), softcap
#   (0: none), slopes (B, Hq) and has_alibi, sinks (Hq,) and has_sinks (placeholders when absent;
#   the dQ kernel, compiled with or without its sink terms, reads the sinks only where it has them).


@functools.cache
def forward_kernel(tiles: Tiles, dtype: str, tensor_cores: bool, score_mods: bool):
    """The forward: (o, lse) for a grid of ceil(nq / rows) * B * Hq blocks of ``tiles.threads``.

    ``tensor_cores``: float16 or bfloat16 on m16n8k16 fragments, q, k, v arriving as int32 words
    of feature pairs; otherwise float32 micro-tiles (see ``fragments``). ``score_mods``: the
    scores take a softcap or ALiBi."""
    bf16 = dtype == "bfloat16"
    ROWS, COLS = tiles.rows, tiles.cols
    form, inputs = _form(tiles, dtype, tensor_cores)
    R, C, A, ROW_LANES, TILE = form.held_rows, form.held_cols, form.held_features, form.row_lanes, form.tile_dtype
    Q_SHAPE, K_SHAPE, V_SHAPE, P_SHAPE, FRAG = form.q_shape, form.k_shape, form.v_shape, form.p_shape, form.frag_words
    row_of, col_of, feature_of, stage_queries, start_tile, wait_tiles, has_nonfinite, qk, share_weights, pv = (
        form.row_of, form.col_of, form.feature_of, form.stage_queries, form.start_tile, form.wait_tiles,
        form.has_nonfinite, form.qk, form.share_weights, form.pv)
    pair_flags = _pair_flags(form)

    @cached_kernel(types.void(inputs, inputs, inputs, _tensor(dtype), _ROWS, *_COMMON), tiles, dtype, tensor_cores,
                   score_mods)
    def kernel(q, k, v, o, lse, cu_q, cu_k, seqlens_q, seqlens_k, mask, blocks, nq, nk, heads_q, group, dim,
               dim_v, varlen, has_seqlens_q, has_seqlens_k, has_mask, has_blocks, block_q, block_k, left, right,
               scale, dropout, threshold, seed_low, seed_high, rng_offset, drop_scale, row_offset, key_offset,
               softcap, slopes, has_alibi, sinks, has_sinks):
        tid = cuda.threadIdx.x
        query_tiles = (nq + ROWS - 1) // ROWS
        pid = cuda.blockIdx.x
        b = pid // query_tiles // heads_q
        h = pid // query_tiles % heads_q
        i0 = (query_tiles - 1 - pid % query_tiles) * ROWS  # the last tiles, which see the most keys, first
        q_start, lq = sequence(b, cu_q, seqlens_q, nq, varlen, has_seqlens_q)
        k_start, lk = sequence(b, cu_k, seqlens_k, nk, varlen, has_seqlens_k)
        rows_out = lq if varlen else nq  # padding rows of the padded layout get o = 0, lse = -inf
        if i0 >= rows_out:
            return
        batch = 0 if varlen else b
        kv_head = h // group
        stream = b * heads_q + h
        slope = slopes[b, h] if has_alibi else np.float32(0)

        q_tile = cuda.shared.array(Q_SHAPE, TILE, alignment=ALIGNED)
        k_tile = cuda.shared.array(K_SHAPE, TILE, alignment=ALIGNED)
        v_tile = cuda.shared.array(V_SHAPE, TILE, alignment=ALIGNED)
        p_tile = cuda.shared.array(P_SHAPE, np.float32, alignment=ALIGNED)
        q_frag = cuda.local.array(FRAG, np.uint32)
        s = cuda.local.array((R, C), np.float32)
        acc = cuda.local.array((R, A), np.float32)
        row_max = cuda.local.array(R, np.float32)
        row_sum = cuda.local.array(R, np.float32)  # this thread's columns only, summed across lanes at the end
        for i in range(R):
            row_max[i] = NEG_INF
            row_sum[i] = 0
            for a in range(A):
                acc[i, a] = 0

        i1 = min(i0 + ROWS, lq)
        stage_queries(q_frag, q_tile, k_tile, q, batch, q_start + i0, i1 - i0, h, dim, tid)
        lo, hi = keys_seen(i0, i1, lq, lk, left, right) if i0 < lq else (np.int64(0), np.int64(0))
        # K of a tile loads while the last tile's P V runs, V while this tile's scores are computed
        j0 = key_tile_from(lo - lo % COLS, hi, COLS, lk, i0, i1, b, h, blocks, has_blocks, block_q, block_k)
        if j0 < hi:
            start_tile(k_tile, k, batch, k_start + j0, min(j0 + COLS, lk) - j0, kv_head, dim, tid)
        while j0 < hi:
            j1 = min(j0 + COLS, lk)
            wait_tiles()
            cuda.syncthreads()  # K is in; the last tile's readers are done with V
            start_tile(v_tile, v, batch, k_start + j0, j1 - j0, kv_head, dim_v, tid)
            # plain: every pair of the tile is allowed; otherwise P holds SKIP weights
            plain = not (has_mask or has_blocks) and inside_band(i0, i0 + ROWS, j0, j0 + COLS, lq, lk, left, right)
            # the flags before the scores: their registers are free there
            masked, dropped = pair_flags(i0, j0, False, tid, plain, lq, lk, left, right, b, h, mask, has_mask,
                                         blocks, has_blocks, block_q, block_k, dropout, row_offset, key_offset, stream,
                                         rng_offset, seed_low, seed_high, threshold)
            qk(s, q_frag, q_tile, k_tile, dim, tid)
            # Each row of this thread: scaled, modified and masked scores, then P (SKIP where
            # disallowed or dropped; a -inf score reads as disallowed).
            distance = i0 + lk - lq - j0  # ALiBi's, of the tile's first query and first key
            for i in range(R):
                tile_max = NEG_INF
                for c in range(C):
                    score = s[i, c] * scale
                    if score_mods:
                        score, _ = modify(score, softcap, slope, distance + row_of(tid, i) - col_of(tid, c))
                    s[i, c] = NEG_INF if (masked >> (i * C + c)) & 1 else score
                    tile_max = max_nan(tile_max, s[i, c])
                fold_row(s, i, tile_max, row_max, row_sum, acc, dropped, ROW_LANES)
            share_weights(p_tile, s, tid)
            wait_tiles()
            # V is in, and every reader is done with K
            exact = cuda.syncthreads_or(np.int32((dropout or not plain) and has_nonfinite(v_tile, tid))) != 0
            next_j0 = key_tile_from(j0 + COLS, hi, COLS, lk, i0, i1, b, h, blocks, has_blocks, block_q, block_k)
            if next_j0 < hi and not exact:  # the exact product passes P through the key tile
                start_tile(k_tile, k, batch, k_start + next_j0, min(next_j0 + COLS, lk) - next_j0, kv_head, dim, tid)
            pv(acc, s, k_tile, v_tile, p_tile, dim_v, tid, exact)
            if next_j0 < hi and exact:
                cuda.syncthreads()
                start_tile(k_tile, k, batch, k_start + next_j0, min(next_j0 + COLS, lk) - next_j0, kv_head, dim, tid)
            j0 = next_j0

        sink = sinks[h] if has_sinks else NEG_INF  # -inf: exactly no sink
        for i in range(R):
            row = i0 + row_of(tid, i)
            total = lanes_sum(row_sum[i], ROW_LANES)
            if row < rows_out:
                empty = row >= lq or total == 0  # no allowed key (NaN rows stay NaN)
                row_lse, factor = sink, np.float32(0)  # an empty row's: the logsumexp of the sink alone
                if not empty:
                    row_lse, factor = with_sink(row_max[i], total, sink, drop_scale)
                for a in range(A):
                    d = feature_of(tid, a)
                    if d < dim_v:
                        store(o, batch, q_start + row, h, d, np.float32(0) if empty else acc[i, a] * factor, bf16)
                if feature_of(tid, 0) == 0:
                    lse[batch, h, q_start + row] = row_lse

    return kernel


@functools.cache
def delta_kernel(dtype: str):
    """delta[b, h, n] = sum over d of do[b, n, h, d] * o[b, n, h, d] in float32, one thread per
    (b, n, h) of a grid covering the (B, N, H) rows of o."""
    x, bf16 = _tensor(dtype), dtype == "bfloat16"

    @cached_kernel(types.void(x, x, _ROWS, types.int64), dtype)
    def kernel(o, do, delta, dim_v):
        index = cuda.grid(1)
        batch, length, heads = o.shape[0], o.shape[1], o.shape[2]
        if index < batch * length * heads:
            b, n, h = index // (length * heads), index // heads % length, index % heads
            total = np.float32(0)
            for d in range(dim_v):
                total += load(do, b, n, h, d, bf16) * load(o, b, n, h, d, bf16)
            delta[b, h, n] = total

    return kernel


@device_function
def gradient_pair(p, dp, delta, keep, drop_scale):
    """(weight of dO in dV, dS) of one allowed pair: P * Z / (1 - p) and P * (dP - delta), where
    dP = dO . v * Z / (1 - p) (dropped pairs: SKIP, and dP = 0). dS is +0, never -0 (the weight
    SKIP), where P = 0 and dP < delta: the pair still multiplies its operands, and an infinite
    entry of q or k gives NaN there, as the contract's arithmetic does."""
    if keep:
        return p * drop_scale, p * (dp * drop_scale - delta) + np.float32(0)
    return SKIP, p * (np.float32(0) - delta) + np.float32(0)


@functools.cache
def _gradient_weights(form, keys_are_rows: bool, score_mods: bool):
    """``gradient_weights`` for a form's held elements, the tile's queries along its columns
    (dK/dV: ``keys_are_rows``) or its rows (dQ); ``score_mods``: the scores take a softcap or ALiBi."""
    R, C, row_of, col_of = form.held_rows, form.held_cols, form.row_of, form.col_of

    @device_function
    def gradient_weights(s, dp, masked, dropped, dropout, lse, delta, batch, h, first_query, tid, scale, scale_log2,
                         drop_scale, softcap, slope, distance):
        """s <- the weights of dO in dV, dp <- dS (``gradient_pair``; through the softcap, dS of
        the scaled score), from the scores s and dP dp, of the held pairs (flags as ``pair_flags``
        gives them; a query is ``first_query`` + its place in the tile, ``distance`` ALiBi's of
        the tile's first query and first key). A tile without disallowed pairs or dropout takes a
        copy of the loop given literal zeros as the flags and 1 as ``drop_scale``: its tests and
        scalings fold away, and with them the branches that kept each query's lse and delta from
        being loaded once."""
        if masked or dropout:
            weights_of_pairs(s, dp, masked, dropped, lse, delta, batch, h, first_query, tid, scale, scale_log2,
                             drop_scale, softcap, slope, distance)
        else:
            weights_of_pairs(s, dp, 0, 0, lse, delta, batch, h, first_query, tid, scale, scale_log2, np.float32(1),
                             softcap, slope, distance)

    @device_function
    def weights_of_pairs(s, dp, masked, dropped, lse, delta, batch, h, first_query, tid, scale, scale_log2,
                         drop_scale, softcap, slope, distance):
        """``gradient_weights``' loop. P = 2^(S scale log2(e) - lse log2(e)): an FMA and an ex2 a
        pair; with score modifications, 2^(S' log2(e) - lse log2(e)) of the modified score S'."""
        for i in range(R):
            for c in range(C):
                query_in_tile = col_of(tid, c) if keys_are_rows else row_of(tid, i)
                key_in_tile = row_of(tid, i) if keys_are_rows else col_of(tid, c)
                # unsigned: no wraparound test, and the thread's queries lie at constant offsets
                query = np.uint64(first_query + query_in_tile)
                weight_v, weight_q = SKIP, SKIP
                if not (masked >> (i * C + c)) & 1:  # a masked pair's query may lie past the sequence: no lse read
                    score, log2_factor = s[i, c], scale_log2
                    if score_mods:
                        score, capped = modify(score * scale, softcap, slope, distance + query_in_tile - key_in_tile)
                        log2_factor = LOG2E
                    p = exp2(score * log2_factor - lse[batch, h, query] * LOG2E)
                    weight_v, weight_q = gradient_pair(p, dp[i, c], delta[batch, h, query],
                                                       not (dropped >> (i * C + c)) & 1, drop_scale)
                    if score_mods:
                        weight_q = through_softcap(weight_q, capped, softcap)
                s[i, c] = weight_v
                dp[i, c] = weight_q

    return gradient_weights


# The backward kernels are written against a ``fragments`` form, as the forward. The dQ kernel
# holds Q as the forward does, and dO in a shared row tile (``qk_shared``: on tensor cores,
# registers for both would leave the accumulators too few); the dK/dV kernel, whose two
# accumulators take most registers, holds both K and V in shared row tiles. A block streams the
# other axis's tiles through shared memory as rows, which the score products read as their B
# operand and the second products (Q and dO in dK/dV, K in dQ) as the forward's P V reads V. A
# tile with skipped pairs whose second products' operand holds a NaN or an infinity is
# multiplied term by term (``exact``), as in the forward.


@functools.cache
def dkdv_kernel(tiles: Tiles, dtype: str, tensor_cores: bool, score_mods: bool):
    """dK and dV for a grid of ceil(nk / rows) * B * Hk blocks of ``tiles.threads``: its rows are
    keys, its streamed tiles query rows of each head in the key/value head's group. Per tile,
    S^T = K Q^T and dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q."""
    bf16 = dtype == "bfloat16"
    ROWS, COLS = tiles.rows, tiles.cols
    form, inputs = _form(tiles, dtype, tensor_cores)
    R, C, A, TILE = form.held_rows, form.held_cols, form.held_features, form.tile_dtype
    ROWS_SHAPE, P_SHAPE = form.k_shape, form.p_shape
    SCRATCH_SHAPE = ROWS_SHAPE if tensor_cores else (1, 1)
    row_of, feature_of, start_tile, wait_tiles, has_nonfinite, qk_shared, share_weights, pv = (
        form.row_of, form.feature_of, form.start_tile, form.wait_tiles, form.has_nonfinite, form.qk_shared,
        form.share_weights, form.pv)
    pair_flags, gradient_weights = _pair_flags(form), _gradient_weights(form, True, score_mods)
    assert ROWS <= COLS  # the own operands in shared memory take a streamed tile's shape

    @cached_kernel(types.void(inputs, inputs, inputs, inputs, _ROWS, _ROWS, _tensor(dtype), _tensor(dtype), *_COMMON),
                   tiles, dtype, tensor_cores, score_mods)
    def kernel(q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, seqlens_q, seqlens_k, mask, blocks, nq, nk, heads_q,
               group, dim, dim_v, varlen, has_seqlens_q, has_seqlens_k, has_mask, has_blocks, block_q, block_k, left,
               right, scale, dropout, threshold, seed_low, seed_high, rng_offset, drop_scale, row_offset, key_offset,
               softcap, slopes, has_alibi, sinks, has_sinks):
        tid = cuda.threadIdx.x
        key_tiles = (nk + ROWS - 1) // ROWS
        heads_k = heads_q // group
        pid = cuda.blockIdx.x
        b = pid // key_tiles // heads_k
        kv_head = pid // key_tiles % heads_k
        j0 = pid % key_tiles * ROWS
        q_start, lq = sequence(b, cu_q, seqlens_q, nq, varlen, has_seqlens_q)
        k_start, lk = sequence(b, cu_k, seqlens_k, nk, varlen, has_seqlens_k)
        rows_out = lk if varlen else nk
        if j0 >= rows_out:
            return
        batch = 0 if varlen else b
        scale_log2 = scale * LOG2E

        k_own = cuda.shared.array(ROWS_SHAPE, TILE, alignment=ALIGNED)
        v_own = cuda.shared.array(ROWS_SHAPE, TILE, alignment=ALIGNED)
        q_rows = cuda.shared.array(ROWS_SHAPE, TILE, alignment=ALIGNED)
        do_rows = cuda.shared.array(ROWS_SHAPE, TILE, alignment=ALIGNED)
        scratch = cuda.shared.array(SCRATCH_SHAPE, TILE)  # the exact products' P (both row tiles are operands)
        # P^T with dropout applied (dO's weights in dV), dS^T (Q's weights in dK)
        p_tile = cuda.shared.array(P_SHAPE, np.float32, alignment=ALIGNED)
        ds_tile = cuda.shared.array(P_SHAPE, np.float32, alignment=ALIGNED)
        s = cuda.local.array((R, C), np.float32)
        dp = cuda.local.array((R, C), np.float32)
        dk_acc = cuda.local.array((R, A), np.float32)
        dv_acc = cuda.local.array((R, A), np.float32)
        for i in range(R):  # one array a loop, as every loop over the accumulators: loops that unroll
            for a in range(A):
                dk_acc[i, a] = 0
        for i in range(R):
            for a in range(A):
                dv_acc[i, a] = 0

        j1 = min(j0 + ROWS, lk)
        start_tile(k_own, k, batch, k_start + j0, j1 - j0, kv_head, dim, tid)
        start_tile(v_own, v, batch, k_start + j0, j1 - j0, kv_head, dim_v, tid)
        wait_tiles()  # no copy outlives the block, even one without a query tile
        lo, hi = queries_seeing(j0, j1, lq, lk, left, right) if j0 < lk else (np.int64(0), np.int64(0))
        for h in range(kv_head * group, (kv_head + 1) * group):
            stream = b * heads_q + h
            slope = slopes[b, h] if has_alibi else np.float32(0)
            for i0 in range(lo - lo % COLS, hi, COLS):
                i1 = min(i0 + COLS, lq)
                if has_blocks and not any_block(blocks, b, h, i0, i1, j0, j1, block_q, block_k):
                    continue
                cuda.syncthreads()  # the last tile's readers are done with the shared tiles
                start_tile(q_rows, q, batch, q_start + i0, i1 - i0, h, dim, tid)
                start_tile(do_rows, do, batch, q_start + i0, i1 - i0, h, dim_v, tid)
                plain = not (has_mask or has_blocks) and inside_band(i0, i0 + COLS, j0, j0 + ROWS, lq, lk, left, right)
                wait_tiles()
                exact = cuda.syncthreads_or(np.int32((dropout or not plain) and (
                    has_nonfinite(q_rows, tid) or has_nonfinite(do_rows, tid)))) != 0
                masked, dropped = pair_flags(i0, j0, True, tid, plain, lq, lk, left, right, b, h, mask, has_mask,
                                             blocks, has_blocks, block_q, block_k, dropout, row_offset, key_offset,
                                             stream, rng_offset, seed_low, seed_high, threshold)
                qk_shared(s, k_own, q_rows, dim, tid)  # S^T
                qk_shared(dp, v_own, do_rows, dim_v, tid)  # dP^T before dropout
                gradient_weights(s, dp, masked, dropped, dropout, lse, delta, batch, h, q_start + i0, tid, scale,
                                 scale_log2, drop_scale, softcap, slope, i0 + lk - lq - j0)
                share_weights(p_tile, s, tid)
                share_weights(ds_tile, dp, tid)
                cuda.syncthreads()
                pv(dv_acc, s, scratch, do_rows, p_tile, dim_v, tid, exact)
                pv(dk_acc, dp, scratch, q_rows, ds_tile, dim, tid, exact)

        for i in range(R):
            key = j0 + row_of(tid, i)
            if key < rows_out:
                for a in range(A):
                    if feature_of(tid, a) < dim:
                        store(dk, batch, k_start + key, kv_head, feature_of(tid, a), dk_acc[i, a] * scale, bf16)
        for i in range(R):
            key = j0 + row_of(tid, i)
            if key < rows_out:
                for a in range(A):
                    if feature_of(tid, a) < dim_v:
                        store(dv, batch, k_start + key, kv_head, feature_of(tid, a), dv_acc[i, a], bf16)

    return kernel


@functools.cache
def dq_kernel(tiles: Tiles, dtype: str, tensor_cores: bool, score_mods: bool, dsinks: bool):
    """dQ for a grid of ceil(nq / rows) * B * Hq blocks of ``tiles.threads``. Per key tile,
    S = Q K^T and dP = dO V^T, then dQ += dS K. ``dsinks`` (calls with sinks): also each row's
    term of dsinks into ``sink_terms`` (B, Hq, Nq), where the row has an allowed key (the others
    are left as they are: zeros). A compile-time choice: its tracking of the rows, though small,
    took 40 more registers a thread from the float16 and bfloat16 kernel at d64 as a run-time one."""
    bf16 = dtype == "bfloat16"
    ROWS, COLS = tiles.rows, tiles.cols
    form, inputs = _form(tiles, dtype, tensor_cores)
    R, C, A, ROW_LANES, TILE, FRAG = (form.held_rows, form.held_cols, form.held_features, form.row_lanes,
                                      form.tile_dtype, form.frag_words)
    OWN_SHAPE, ROWS_SHAPE, P_SHAPE = form.q_shape, form.k_shape, form.p_shape
    row_of, feature_of, stage_queries, start_tile, wait_tiles, has_nonfinite, qk, qk_shared, share_weights, pv = (
        form.row_of, form.feature_of, form.stage_queries, form.start_tile, form.wait_tiles, form.has_nonfinite, form.qk,
        form.qk_shared, form.share_weights, form.pv)
    pair_flags, gradient_weights = _pair_flags(form), _gradient_weights(form, False, score_mods)
    ROW_PAIRS = (ONE_PAIR << C) - ONE_PAIR  # the pair flags of a held row, bits 0:C
    assert ROWS <= COLS  # the own operand in shared memory takes a streamed tile's shape

    @cached_kernel(types.void(inputs, inputs, inputs, inputs, _ROWS, _ROWS, _tensor(dtype), _ROWS, *_COMMON), tiles,
                   dtype, tensor_cores, score_mods, dsinks)
    def kernel(q, k, v, do, lse, delta, dq, sink_terms, cu_q, cu_k, seqlens_q, seqlens_k, mask, blocks, nq, nk,
               heads_q, group, dim, dim_v, varlen, has_seqlens_q, has_seqlens_k, has_mask, has_blocks, block_q,
               block_k, left, right, scale, dropout, threshold, seed_low, seed_high, rng_offset, drop_scale,
               row_offset, key_offset, softcap, slopes, has_alibi, sinks, has_sinks):
        tid = cuda.threadIdx.x
        query_tiles = (nq + ROWS - 1) // ROWS
        pid = cuda.blockIdx.x
        b = pid // query_tiles // heads_q
        h = pid // query_tiles % heads_q
        i0 = (query_tiles - 1 - pid % query_tiles) * ROWS
        q_start, lq = sequence(b, cu_q, seqlens_q, nq, varlen, has_seqlens_q)
        k_start, lk = sequence(b, cu_k, seqlens_k, nk, varlen, has_seqlens_k)
        rows_out = lq if varlen else nq
        if i0 >= rows_out:
            return
        batch = 0 if varlen else b
        kv_head = h // group
        stream = b * heads_q + h
        scale_log2 = scale * LOG2E
        slope = slopes[b, h] if has_alibi else np.float32(0)

        q_own = cuda.shared.array(OWN_SHAPE, TILE, alignment=ALIGNED)
        do_own = cuda.shared.array(ROWS_SHAPE, TILE, alignment=ALIGNED)
        k_rows = cuda.shared.array(ROWS_SHAPE, TILE, alignment=ALIGNED)
        v_rows = cuda.shared.array(ROWS_SHAPE, TILE, alignment=ALIGNED)
        ds_tile = cuda.shared.array(P_SHAPE, np.float32, alignment=ALIGNED)  # dS: K's weights in dQ
        q_frag = cuda.local.array(FRAG, np.uint32)
        s = cuda.local.array((R, C), np.float32)
        dp = cuda.local.array((R, C), np.float32)
        dq_acc = cuda.local.array((R, A), np.float32)
        reads_a_key = cuda.local.array(R, np.float32)  # 1 where a held row has an allowed pair: its dsinks term counts
        for i in range(R):
            for a in range(A):
                dq_acc[i, a] = 0
        for i in range(R):
            reads_a_key[i] = 0

        i1 = min(i0 + ROWS, lq)
        stage_queries(q_frag, q_own, k_rows, q, batch, q_start + i0, i1 - i0, h, dim, tid)
        start_tile(do_own, do, batch, q_start + i0, i1 - i0, h, dim_v, tid)
        wait_tiles()  # no copy outlives the block, even one without a key tile
        lo, hi = keys_seen(i0, i1, lq, lk, left, right) if i0 < lq else (np.int64(0), np.int64(0))
        for j0 in range(lo - lo % COLS, hi, COLS):
            j1 = min(j0 + COLS, lk)
            if has_blocks and not any_block(blocks, b, h, i0, i1, j0, j1, block_q, block_k):
                continue
            cuda.syncthreads()  # the last tile's readers are done with the shared tiles
            start_tile(k_rows, k, batch, k_start + j0, j1 - j0, kv_head, dim, tid)
            start_tile(v_rows, v, batch, k_start + j0, j1 - j0, kv_head, dim_v, tid)
            plain = not (has_mask or has_blocks) and inside_band(i0, i0 + ROWS, j0, j0 + COLS, lq, lk, left, right)
            wait_tiles()
            exact = cuda.syncthreads_or(np.int32((dropout or not plain) and has_nonfinite(k_rows, tid))) != 0
            masked, dropped = pair_flags(i0, j0, False, tid, plain, lq, lk, left, right, b, h, mask, has_mask,
                                         blocks, has_blocks, block_q, block_k, dropout, row_offset, key_offset, stream,
                                         rng_offset, seed_low, seed_high, threshold)
            qk(s, q_frag, q_own, k_rows, dim, tid)
            qk_shared(dp, do_own, v_rows, dim_v, tid)  # dP before dropout
            if dsinks:
                for i in range(R):
                    if (~masked >> (i * C)) & ROW_PAIRS:
                        reads_a_key[i] = 1
            gradient_weights(s, dp, masked, dropped, dropout, lse, delta, batch, h, q_start + i0, tid, scale,
                             scale_log2, drop_scale, softcap, slope, i0 + lk - lq - j0)
            share_weights(ds_tile, dp, tid)
            cuda.syncthreads()
            pv(dq_acc, dp, v_rows, k_rows, ds_tile, dim, tid, exact)  # V's row tile is free: dS may pass through it

        for i in range(R):
            row = i0 + row_of(tid, i)
            if row < rows_out:
                for a in range(A):
                    d = feature_of(tid, a)
                    if d < dim:
                        store(dq, batch, q_start + row, h, d, dq_acc[i, a] * scale, bf16)
        if dsinks:  # a row without an allowed key adds nothing, whatever its delta (its do may be NaN)
            for i in range(R):
                query = q_start + i0 + row_of(tid, i)
                if lanes_max(reads_a_key[i], ROW_LANES) > 0 and feature_of(tid, 0) == 0:
                    sink_terms[batch, h, query] = sink_term(sinks[h], lse[batch, h, query], delta[batch, h, query])

    return kernel
