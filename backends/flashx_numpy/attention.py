"""FlashAttention in NumPy: the tiled online-softmax forward and the recomputing backward.

Work is cut into tiles of keys x query rows. The g = Hq // Hk query heads that read one
key/value head are folded into the rows (row r of a tile is query i0 + r // g, head
r % g of the group), so a single matmul serves the whole group and K/V are never
repeated. Score tiles are stored keys-first, (keys, rows): OpenBLAS runs K Q^T faster
than Q K^T for these thin shapes, and the row maxima become a reduction over the
leading axis. Tiles whose every element is disallowed (band, block_mask, mask,
lengths) are skipped, fully allowed tiles take a mask-free path, and only the rest
build a mask.

Two extra columns let BLAS do two of the elementwise passes over the scores:
- k carries a column of ones and the scaled q^T a row holding -ref, so K Q^T is already
  (S - ref)^T (ref: each row's reference maximum);
- v carries a column of ones, so P V also yields each row's sum of P.
A row's first tile with an allowed key sets ref to that tile's exact maximum; after
that ref moves only when a tile's maximum runs ahead of it by more than log(256) (the
conditional rescaling of FlashAttention-4): exp(S - ref) then stays <= 256 and the
accumulator is rescaled only on those tiles. The forward saves lse = ref + log(sum P);
the backward rebuilds P = exp(S - lse) tile by tile, on the forward's tile grid so that
S comes out bitwise the same (a row with one key gets P = 1 exactly), with
D = rowsum(dO * O). Products with masked-out pairs add exactly 0 even where the data
holds NaN or inf (``_masked_matmul``); padding is never read at all.

The score modifications of the contract follow its order. softcap and ALiBi are not linear
in q, so with either one the -ref row stays 0: each tile's scores come out of BLAS as S, are
capped and biased (``_ScoreMods``), and then lose ref. The backward keeps tanh(S / c) of the
tile for softcap's derivative. A sink enters once per row, after the last tile: the keys'
logsumexp ref + log(sum P) and the sink combine into lse, and o is scaled by the keys' share
exp(lse_keys - lse). The backward needs nothing new for dq, dk, dv (P = exp(S - lse) with the
sink's lse); dsinks[h] = -sum of exp(sink - lse) * D over the rows of head h that read a key,
which the tiles record as they visit them, so that do of an empty row is never read.

FP8 inputs (forward only) are dequantized to float32 once, descales multiplied in
(``flashx_numpy.fp8``). A row's ref then follows every new maximum, without the conditional
rescaling, so that P <= 1 and P = 1 exactly at the maximum, and each tile's P is rounded to e4m3
before its product with V, as plain attention in FP8 rounds its weights; the row sums add P
before the rounding.

Peak extra memory: one score tile per worker plus per-head copies of K and V (and, in
the backward, of the head group's q, dO and dq): O(N * block), never N^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial, reduce

import numpy as np

from flashx import Problem
from flashx_numpy import fp8
from flashx_numpy.parallel import workers
from flashx_numpy.philox import dropout_keep

# How far a row's maximum may run ahead of its reference before the accumulator is rescaled.
_RESCALE_LIMIT = 256.0
_RESCALE_MARGIN = math.log(_RESCALE_LIMIT)

BLOCK_Q = 512  # query rows per tile, all heads of a group together
BLOCK_K = 512  # keys per tile: a 512 x 512 float32 score tile fits a 1 MiB L2


@dataclass(frozen=True)
class _Sequence:
    """One sequence: where its rows live in the arrays, and its slices of the masks."""

    b: int  # the sequence index of the dropout counter
    lq: int
    lk: int
    rows_q: tuple  # index of its query rows in q, o, do, dq: (b, 0:lq) or (start:end,)
    rows_k: tuple  # index of its keys in k, v, dk, dv
    mask: np.ndarray | None  # (Hq, Nq, Nk) view of the broadcast mask
    blocks: np.ndarray | None  # (Hq, ceil(Nq / bq), ceil(Nk / bk)) view of block_mask.blocks


def _lse_index(rows: tuple) -> tuple:
    """The index in lse of the query rows ``rows`` indexes in q (heads come before rows)."""
    return rows[:-1] + (slice(None),) + rows[-1:]


def _layout(problem: Problem):
    """(sequences, query padding, key padding): padding as row indices outside every sequence."""
    if problem.varlen:
        cu_q = [int(x) for x in problem.cu_seqlens_q]
        cu_k = [int(x) for x in problem.cu_seqlens_k]
        sequences = [
            _Sequence(b, cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b],
                      (slice(cu_q[b], cu_q[b + 1]),), (slice(cu_k[b], cu_k[b + 1]),), None, None)
            for b in range(problem.batch)
        ]
        return sequences, [(slice(cu_q[-1], None),)], [(slice(cu_k[-1], None),)]
    batch, heads, nq, nk = problem.batch, problem.heads_q, problem.seqlen_q, problem.seqlen_k
    lq = [nq] * batch if problem.seqlens_q is None else [int(x) for x in problem.seqlens_q]
    lk = [nk] * batch if problem.seqlens_k is None else [int(x) for x in problem.seqlens_k]
    mask = blocks = None
    if problem.mask is not None:
        mask = np.broadcast_to(problem.mask, (batch, heads, nq, nk))
    if problem.block_mask is not None:
        bq, bk = problem.block_mask.block_size
        blocks = np.broadcast_to(problem.block_mask.blocks, (batch, heads, -(-nq // bq), -(-nk // bk)))
    sequences = [
        _Sequence(b, lq[b], lk[b], (b, slice(0, lq[b])), (b, slice(0, lk[b])),
                  None if mask is None else mask[b], None if blocks is None else blocks[b])
        for b in range(batch)
    ]
    return sequences, [(b, slice(lq[b], None)) for b in range(batch)], [(b, slice(lk[b], None)) for b in range(batch)]


class _Tiles:
    """Which elements of a tile (keys j0:j1, queries i0:i1, the heads of one group) are allowed."""

    def __init__(self, problem: Problem, seq: _Sequence):
        self.lq, self.lk = seq.lq, seq.lk
        self.diagonal = seq.lk - seq.lq  # query i's band is centred on key i + diagonal
        self.left, self.right = problem.band or (-1, -1)
        self.mask, self.blocks = seq.mask, seq.blocks
        self.block_size = None if problem.block_mask is None else problem.block_mask.block_size

    def keys(self, i0: int, i1: int) -> tuple[int, int]:
        """[lo, hi): the keys the band lets any of the queries i0:i1 see."""
        lo = 0 if self.left < 0 else max(0, i0 + self.diagonal - self.left)
        hi = self.lk if self.right < 0 else min(self.lk, i1 + self.diagonal + self.right)
        return lo, max(lo, hi)

    def queries(self, j0: int, j1: int) -> tuple[int, int]:
        """[lo, hi): the queries the band lets see any of the keys j0:j1."""
        lo = 0 if self.right < 0 else max(0, j0 - self.diagonal - self.right)
        hi = self.lq if self.left < 0 else min(self.lq, j1 - self.diagonal + self.left)
        return lo, max(lo, hi)

    def disallowed(self, heads: slice, i0: int, i1: int, j0: int, j1: int):
        """(any allowed, disallowed): disallowed is None when the whole tile is allowed, else
        a bool array (keys j0:j1, rows) in the layout of the score tiles, True where disallowed."""
        parts = []
        band_inside = (self.left < 0 or j0 >= i1 - 1 + self.diagonal - self.left) and (
            self.right < 0 or j1 - 1 <= i0 + self.diagonal + self.right
        )
        if not band_inside:
            j = np.arange(j0, j1)[:, None, None]
            centre = np.arange(i0, i1)[:, None] + self.diagonal
            outside = np.zeros((j1 - j0, i1 - i0, 1), bool)
            if self.left >= 0:
                outside |= j < centre - self.left
            if self.right >= 0:
                outside |= j > centre + self.right
            parts.append(outside)
        if self.mask is not None:
            allowed = self.mask[heads, i0:i1, j0:j1].transpose(2, 1, 0)
            if not allowed.any():
                return False, None
            if not allowed.all():
                parts.append(~allowed)
        if self.blocks is not None:
            bq, bk = self.block_size
            blocks = self.blocks[heads]
            covering = blocks[:, i0 // bq : (i1 - 1) // bq + 1, j0 // bk : (j1 - 1) // bk + 1]
            if not covering.any():
                return False, None
            if not covering.all():
                allowed = blocks[:, np.arange(i0, i1) // bq, (np.arange(j0, j1) // bk)[:, None]]
                parts.append(~allowed.transpose(1, 2, 0))
        if not parts:
            return True, None
        group = heads.stop - heads.start
        outside = np.broadcast_to(reduce(np.logical_or, parts), (j1 - j0, i1 - i0, group))
        if outside.all():
            return False, None
        return True, outside.reshape(j1 - j0, (i1 - i0) * group)


def _masked_matmul(a, b, disallowed, out=None):
    """a @ b in which a disallowed pair (i, j) adds exactly 0 (a[i, j] is 0 there), even when
    b[j] holds NaN or inf that BLAS would turn into 0 * inf = NaN: masked-out data never leaks.

    ``disallowed``: None when every pair is allowed, else the bool array shaped like ``a``.
    """
    if disallowed is None:
        return np.matmul(a, b, out=out)
    finite = np.isfinite(b).all(axis=1)
    if finite.all():
        return np.matmul(a, b, out=out)
    out = np.matmul(a, np.where(finite[:, None], b, 0), out=out)
    for j in np.flatnonzero(~finite):
        out += np.where(disallowed[:, j, None], 0, a[:, j, None] * b[j])
    return out


def _compute_dtype(problem: Problem):
    return np.float64 if problem.dtype == "float64" else np.float32


def _with_ones(x: np.ndarray, dtype) -> np.ndarray:
    """(L, H, D) keys or values -> (H, L, D + 1): per head, with a column of ones on the right."""
    length, heads, dim = x.shape
    out = np.empty((heads, length, dim + 1), dtype)
    out[..., :dim] = x.transpose(1, 0, 2)
    out[..., dim] = 1
    return out


def _scaled_queries_t(problem: Problem, q: np.ndarray, heads: slice, i0: int, i1: int, dtype) -> np.ndarray:
    """(D + 1, rows): (softmax_scale * q)^T of queries i0:i1 and the group's heads, folded
    into rows; the last row (for -ref or -lse) is left to the caller."""
    group, dim = problem.group, problem.head_dim
    out = np.empty((dim + 1, i1 - i0, group), dtype)
    np.multiply(q[i0:i1, heads].transpose(2, 0, 1), problem.softmax_scale, out=out[:dim], dtype=dtype)
    return out.reshape(dim + 1, (i1 - i0) * group)


class _ScoreMods:
    """softcap and ALiBi (the contract's "Score modifications", steps 2 and 3) on the score tiles
    of one sequence and the heads of one group, in place, in the tiles' layout (keys, rows)."""

    def __init__(self, problem: Problem, seq: _Sequence, heads: slice, dtype):
        self.softcap = problem.softcap
        self.diagonal = seq.lk - seq.lq  # ALiBi's distance is from the bottom-right aligned diagonal
        self.slopes = None
        if problem.alibi_slopes is not None:
            slopes = problem.alibi_slopes[seq.b] if problem.alibi_slopes.ndim == 2 else problem.alibi_slopes
            self.slopes = slopes[heads].astype(dtype)

    @classmethod
    def of(cls, problem: Problem, seq: _Sequence, heads: slice, dtype):
        """The modifications of this call, or None when it has neither."""
        if problem.softcap is None and problem.alibi_slopes is None:
            return None
        return cls(problem, seq, heads, dtype)

    def apply(self, s: np.ndarray, i0: int, i1: int, j0: int, j1: int):
        """Scaled scores of keys j0:j1 and queries i0:i1 (all heads of the group) -> modified, in
        place; returns tanh(S / c) when there is a softcap (its derivative needs it), else None."""
        capped = None
        if self.softcap is not None:
            capped = np.tanh(s / self.softcap)
            np.multiply(capped, self.softcap, out=s)
        if self.slopes is not None:
            queries = np.arange(i0, i1)[None, :, None] + self.diagonal
            distance = np.abs(queries - np.arange(j0, j1)[:, None, None]).astype(s.dtype)
            s -= (distance * self.slopes).reshape(s.shape)
        return capped


def _sink_of_rows(problem: Problem, heads: slice, queries: int, dtype) -> np.ndarray:
    """The sink of each row of a tile: row r is a query of head heads.start + r % group."""
    return np.tile(problem.sinks[heads].astype(dtype), queries)


def with_sink(keys_lse: np.ndarray, sink: np.ndarray) -> np.ndarray:
    """log(exp(keys_lse) + exp(sink)) as the contract's softmax computes it: a NaN or +inf sink
    gives NaN (as such a score would), a row without keys (keys_lse = -inf) the sink itself."""
    top = np.maximum(keys_lse, sink)
    top = np.where(top == -np.inf, 0, top)
    lse = top + np.log(np.exp(keys_lse - top) + np.exp(sink - top))
    return np.where(keys_lse == -np.inf, sink, lse)


def _keep(problem: Problem, seq, heads: slice, i0, i1, j0, j1) -> np.ndarray:
    """The dropout keep mask of a tile, (keys, rows) like its scores."""
    row0, key0 = problem.dropout_offsets
    keep = dropout_keep(problem.dropout_p, problem.seed, problem.rng_offset, seq.b,
                        np.arange(heads.start, heads.stop), problem.heads_q, row0 + i0, row0 + i1, key0 + j0, key0 + j1)
    return keep.reshape(j1 - j0, -1)


def forward(problem: Problem, q, k, v, *, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
    """(o, lse) in the layouts of the contract's Shapes section; o in q's dtype (float32 for FP8)."""
    if problem.fp8:
        q, k, v = fp8.dequantized(problem, q, k, v)
    dtype = _compute_dtype(problem)
    # NaN until written: an element the tiles miss cannot pass for a result.
    o = np.full(problem.o_shape, np.nan, q.dtype)
    lse = np.full(problem.lse_shape, np.nan, problem.lse_dtype)
    sequences, padding, _ = _layout(problem)
    for rows in padding:  # rows with no key at all: o = 0, lse = -inf or the head's sink
        o[rows] = 0
        lse[_lse_index(rows)] = -np.inf if problem.sinks is None else problem.sinks[:, None]
    queries_per_tile = max(1, block_q // problem.group)
    tasks = []
    for seq in sequences:
        keys, values = _with_ones(k[seq.rows_k], dtype), _with_ones(v[seq.rows_k], dtype)
        tiles = _Tiles(problem, seq)
        for head_k in range(problem.heads_k):
            for i0 in range(0, seq.lq, queries_per_tile):
                tasks.append(partial(
                    _forward_tile_rows, problem, seq, tiles, head_k, i0, min(i0 + queries_per_tile, seq.lq),
                    q[seq.rows_q], keys[head_k], values[head_k], o[seq.rows_q], lse[_lse_index(seq.rows_q)], block_k,
                ))
    workers.run(tasks)
    return o, lse


def _forward_tile_rows(problem, seq, tiles, head_k, i0, i1, q, keys, values, o, lse, block_k):
    """Queries i0:i1 of one sequence and of the heads reading kv head ``head_k``: every key tile."""
    group, dim_v, p = problem.group, problem.head_dim_v, problem.dropout_p
    heads = slice(head_k * group, (head_k + 1) * group)
    rows = (i1 - i0) * group
    dtype = keys.dtype
    mods = _ScoreMods.of(problem, seq, heads, dtype)
    qa = _scaled_queries_t(problem, q, heads, i0, i1, dtype)
    qa[-1] = 0  # -ref once rows have one, unless mods must see S itself
    ref = np.zeros(rows, dtype)
    started = np.zeros(rows, bool)  # ref is a maximum this row has seen
    acc = np.zeros((rows, dim_v + 1), dtype)  # [sum_j P_ij v_j | sum_j P_ij], in units of exp(ref)
    pv = np.empty_like(acc)
    scores_buffer = np.empty(block_k * rows, dtype)
    # FP8 rounds P to e4m3, which keeps 4 significant bits: its ref follows every new maximum
    # (P <= 1, a row's largest P exactly 1, as in plain attention in FP8) rather than letting the
    # largest P of a row, the one that weighs most, take the rounding of an arbitrary value.
    margin = 0.0 if problem.fp8 else _RESCALE_MARGIN

    def scores(j0, j1, disallowed):  # (S - ref)^T of a tile, disallowed elements -inf
        s = scores_buffer[: (j1 - j0) * rows].reshape(j1 - j0, rows)
        np.matmul(keys[j0:j1], qa, out=s)
        if mods is not None:
            mods.apply(s, i0, i1, j0, j1)
            s -= ref
        if disallowed is not None:
            np.copyto(s, -np.inf, where=disallowed)
        return s

    def exp_times_values(s, j0, j1, disallowed):  # [P V | sum_j P]: s becomes P in place
        np.exp(s, out=s)
        # the normaliser sums P before dropout (dropped elements count) and before FP8's rounding
        total = s.sum(axis=0) if p or problem.fp8 else None
        if problem.fp8:  # plain attention in FP8 multiplies V by P rounded to e4m3
            s[...] = fp8.round_e4m3(s)
        if p:
            # A dropped pair adds exactly 0, as a disallowed one does, even where v holds NaN.
            dropped = ~_keep(problem, seq, heads, i0, i1, j0, j1)
            np.copyto(s, 0, where=dropped)
            disallowed = dropped if disallowed is None else disallowed | dropped
        _masked_matmul(s.T, values[j0:j1], None if disallowed is None else disallowed.T, out=pv)
        if total is not None:
            pv[:, -1] = total
        return pv

    with np.errstate(all="ignore"):  # exp(-inf) = 0 and log(0) = -inf are the intended values
        lo, hi = tiles.keys(i0, i1)
        for j0 in range(lo - lo % block_k, hi, block_k):  # the backward's tile grid (see there)
            j1 = min(j0 + block_k, seq.lk)
            any_allowed, disallowed = tiles.disallowed(heads, i0, i1, j0, j1)
            if not any_allowed:
                continue
            s = scores(j0, j1, disallowed)
            if started.all() and not problem.fp8:
                # The usual tile once every row has its ref: no pass for the maxima. A row
                # that ran far ahead (or holds NaN) shows in its sum of P; then the tile is
                # done again the careful way.
                exp_times_values(s, j0, j1, disallowed)
                if np.all(pv[:, -1] <= _RESCALE_LIMIT * (j1 - j0)):
                    acc += pv
                    continue
                s = scores(j0, j1, disallowed)
            ahead = s.max(axis=0)
            moved = (ahead > margin) | (~started & (ahead > -np.inf))
            if moved.any():
                shift = np.where(moved, ahead, 0)
                s -= shift
                acc *= np.where(started, np.exp(-shift), 0)[:, None]
                ref += shift
                started |= moved
                if mods is None:
                    qa[-1] = -ref
            acc += exp_times_values(s, j0, j1, disallowed)
        total = acc[:, -1]
        out = acc[:, :-1] / (total * (1 - p))[:, None]
        row_lse = ref + np.log(total)
        if problem.sinks is not None:
            keys_lse, row_lse = row_lse, with_sink(row_lse, _sink_of_rows(problem, heads, i1 - i0, dtype))
            out *= np.exp(keys_lse - row_lse)[:, None]  # the keys' share of the row's weight
        np.copyto(out, 0, where=(total == 0)[:, None])  # rows with no allowed key
        o[i0:i1, heads] = out.reshape(i1 - i0, group, dim_v)
        lse[heads, i0:i1] = row_lse.reshape(i1 - i0, group).T


def backward(problem: Problem, q, k, v, o, lse, do, *, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
    """(dq, dk, dv) like q, k, v; dk and dv summed over each group of query heads. With sinks
    also dsinks (Hq,), summed over the sequences in their order: the same bits at any thread count."""
    dq, dk, dv = (np.full(x.shape, np.nan, x.dtype) for x in (q, k, v))  # NaN until written
    sequences, padding_q, padding_k = _layout(problem)
    # each task writes the dsinks of its sequence and heads: padding rows read no key and add 0
    dsinks = np.zeros((len(sequences), problem.heads_q), problem.lse_dtype)
    for rows in padding_q:
        dq[rows] = 0
    for rows in padding_k:
        dk[rows] = 0
        dv[rows] = 0
    workers.run(
        partial(_backward_head, problem, seq, head_k,
                *(x[seq.rows_q] for x in (q, o, do, dq)), lse[_lse_index(seq.rows_q)],
                *(x[seq.rows_k] for x in (k, v, dk, dv)), dsinks[n], block_q, block_k)
        for n, seq in enumerate(sequences)
        for head_k in range(problem.heads_k)
    )
    if problem.sinks is None:
        return dq, dk, dv
    return dq, dk, dv, dsinks.sum(axis=0)


def _backward_head(problem, seq, head_k, q, o, do, dq, lse, k, v, dk, dv, dsinks, block_q, block_k):
    """Gradients of one sequence and one kv head: key tiles outer (dk, dv stay in a
    per-tile accumulator), query tiles inner (dq accumulates over the key tiles)."""
    group, dim, dim_v, p = problem.group, problem.head_dim, problem.head_dim_v, problem.dropout_p
    heads = slice(head_k * group, (head_k + 1) * group)
    rows = seq.lq * group
    dtype = _compute_dtype(problem)
    tiles = _Tiles(problem, seq)
    mods = _ScoreMods.of(problem, seq, heads, dtype)
    reads_a_key = None if problem.sinks is None else np.zeros(rows, bool)  # the rows whose dsinks term counts
    qa = _scaled_queries_t(problem, q, heads, 0, seq.lq, dtype)
    qa[-1] = 0
    queries = qa[:-1].T  # (rows, D), scaled
    # A row without weight (no allowed key, or every allowed score -inf) has lse = -inf: as +inf,
    # its P = exp(S - lse) is exactly 0 rather than exp(-inf + inf) = NaN.
    lse_rows = lse[heads].T.reshape(rows)
    lse_rows = np.where(lse_rows == -np.inf, np.inf, lse_rows)
    d_out = do[:, heads].reshape(rows, dim_v).astype(dtype)
    delta = np.einsum("rd,rd->r", d_out, o[:, heads].reshape(rows, dim_v).astype(dtype))
    keys = _with_ones(k[:, head_k : head_k + 1], dtype)[0]  # (Lk, D + 1)
    values = v[:, head_k].astype(dtype)
    dq_acc = np.zeros((rows, dim), dtype)
    queries_per_tile = max(1, block_q // group)
    with np.errstate(all="ignore"):
        for j0 in range(0, seq.lk, block_k):
            j1 = min(j0 + block_k, seq.lk)
            dk_acc = np.zeros((j1 - j0, dim), dtype)
            dv_acc = np.zeros((j1 - j0, dim_v), dtype)
            lo, hi = tiles.queries(j0, j1)
            for i0 in range(lo - lo % queries_per_tile, hi, queries_per_tile):
                i1 = min(i0 + queries_per_tile, seq.lq)
                r0, r1 = i0 * group, i1 * group
                any_allowed, disallowed = tiles.disallowed(heads, i0, i1, j0, j1)
                if not any_allowed:
                    continue
                # The forward's tiles and product again, so S comes out bitwise as the forward
                # saw it: a row with a single key then gets P = exp(0) = 1 exactly.
                probs = keys[j0:j1] @ qa[:, r0:r1]  # S^T: (keys, rows) like every tile here
                capped = None if mods is None else mods.apply(probs, i0, i1, j0, j1)
                probs -= lse_rows[r0:r1]
                if disallowed is not None:
                    np.copyto(probs, -np.inf, where=disallowed)
                np.exp(probs, out=probs)
                d_scores = values[j0:j1] @ d_out[r0:r1].T  # dP^T
                kept_probs, unused = probs, disallowed  # unused: pairs that add exactly 0 to dv
                if p:
                    dropped = ~_keep(problem, seq, heads, i0, i1, j0, j1)
                    kept_probs = probs / (1 - p)
                    np.copyto(kept_probs, 0, where=dropped)
                    np.copyto(d_scores, 0, where=dropped)
                    d_scores /= 1 - p
                    unused = dropped if disallowed is None else disallowed | dropped
                dv_acc += _masked_matmul(kept_probs, d_out[r0:r1], unused)
                d_scores -= delta[r0:r1]
                d_scores *= probs  # dS^T = P^T * (dP^T - D)
                if capped is not None:
                    d_scores *= 1 - capped * capped  # through the softcap, to the scaled score
                if disallowed is not None:  # P = 0 there, but dP may hold NaN from masked-out data
                    np.copyto(d_scores, 0, where=disallowed)
                if reads_a_key is not None:
                    reads_a_key[r0:r1] |= True if disallowed is None else ~disallowed.all(axis=0)
                dk_acc += _masked_matmul(d_scores, queries[r0:r1], disallowed)
                dq_acc[r0:r1] += _masked_matmul(d_scores.T, keys[j0:j1, :-1], None if disallowed is None else disallowed.T)
            dk[j0:j1, head_k] = dk_acc
            dv[j0:j1, head_k] = dv_acc
        if reads_a_key is not None:
            p_sink = np.exp(_sink_of_rows(problem, heads, seq.lq, dtype) - lse_rows)
            terms = np.where(reads_a_key, p_sink * delta, 0)
            dsinks[heads] = -terms.reshape(seq.lq, group).sum(axis=0)
    dq[:, heads] = (dq_acc * problem.softmax_scale).reshape(seq.lq, group, dim)
