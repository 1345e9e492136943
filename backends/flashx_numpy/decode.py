"""Decoding with a KV cache in NumPy: the reference for ``flashx.attention_with_kvcache``.

The new tokens are written into the cache first (through the block table when it is paged).
Then, per sequence, its Lk keys are gathered in order, the pairs each query row may attend to
become one boolean mask (the band of causal and window at the sequence's own length, and the
tree mask over its last Nq keys), and the keys are cut into ``num_splits`` consecutive parts
(one part when it is 0). Each part is attended to by the tiled forward (``flashx_numpy.attention``,
which keeps masked-out NaN out of every product) and the parts are combined as the contract's
"Merging partial results" says, through ``flashx.merge_states``.

An FP8 cache (the contract's FP8 section) arrives as its bytes: new tokens are quantized into it
by its descales (``flashx_numpy.fp8.quantized``), and the keys and values gathered are decoded and
multiplied by them, then attended to in float32 as any cache.

Softcap and ALiBi are the forward's own. A part's call holds the keys from its first one to the
sequence's end, those past the part masked out, so that its bottom-right diagonal is the
sequence's: the one ALiBi measures its distance from. The parts are computed without the sink,
which joins each row once, after the merge (``_join_sink``): a split that holds no key adds
nothing, the sink included.
"""

from __future__ import annotations

import numpy as np

import flashx
from flashx.validation import build_problem
from flashx_numpy import fp8
from flashx_numpy.attention import forward, with_sink


def decode(problem, q, k_cache, v_cache, k_new, v_new, *, block_q: int, block_k: int):
    """(o, lse) in the layouts of the contract's Shapes section; o in float32 or float64."""
    lengths = problem.cache_seqlens.astype(np.int64)
    if k_new is not None:
        for b in range(problem.batch):
            where = _slots(problem, b, lengths[b] + np.arange(problem.new_tokens))
            k_cache[where] = _stored(problem, k_new[b], problem.k_descale, b)
            v_cache[where] = _stored(problem, v_new[b], problem.v_descale, b)
    work = np.float64 if problem.dtype == "float64" else np.float32
    o = np.empty(problem.o_shape, work)
    lse = np.empty(problem.lse_shape, problem.lse_dtype)
    parts = problem.num_splits or 1
    for b in range(problem.batch):
        where = _slots(problem, b, np.arange(lengths[b] + problem.new_tokens))
        keys = _loaded(problem, k_cache[where], problem.k_descale, b, work)
        values = _loaded(problem, v_cache[where], problem.v_descale, b, work)
        queries = q[b].astype(work)
        length = keys.shape[0]
        allowed = _allowed(problem, b, length)
        bounds = length * np.arange(parts + 1) // parts
        merged = None
        for j0, j1 in zip(bounds[:-1], bounds[1:]):
            in_part = allowed[..., j0:] & (np.arange(j0, length) < j1)
            part = _attend(problem, b, queries, keys[j0:], values[j0:], in_part, block_q, block_k)
            with np.errstate(invalid="ignore"):  # NaN in, NaN out
                merged = part if merged is None else flashx.merge_states(*merged, *part)
        o[b], lse[b] = _join_sink(problem, merged[0][0], merged[1][0])
    return o, lse


def _stored(problem, x, descale, b: int):
    """New tokens x (Nn, Hk, D) of sequence b as the cache holds them."""
    return fp8.quantized(x, None if descale is None else descale[b]) if problem.fp8 else x


def _loaded(problem, x, descale, b: int, work):
    """Cached tokens x (Lk, Hk, D) of sequence b as the values they stand for, in ``work``."""
    if not problem.fp8:
        return x.astype(work)
    values = fp8.decoded(x, problem.cache_dtype)
    return values if descale is None else values * np.asarray(descale[b], np.float32)[None, :, None]


def _slots(problem, b: int, positions: np.ndarray) -> tuple:
    """The index into a cache of sequence b's tokens at ``positions``."""
    if not problem.paged:
        return b, positions
    pages = problem.block_table[b, positions // problem.page_size]
    return pages, positions % problem.page_size


def _allowed(problem, b: int, length: int) -> np.ndarray:
    """(1 or Hq, Nq, Lk) bool: which keys each query row of sequence b may attend to."""
    nq = problem.seqlen_q
    position = np.arange(nq)[:, None] + length - nq  # query i's position among the keys
    keys = np.arange(length)[None, :]
    allowed = np.ones((nq, length), bool)
    left, right = problem.band or (-1, -1)
    if left != -1:
        allowed &= keys >= position - left
    if right != -1:
        allowed &= keys <= position + right
    if problem.mask is None:
        return allowed[None]
    tree = np.broadcast_to(problem.mask, (problem.batch, problem.heads_q, nq, nq))[b]
    first = length - nq  # the key the tree mask's column 0 stands for
    columns = np.arange(max(first, 0), length)
    full = np.ones((problem.heads_q, nq, length), bool)
    full[:, :, columns] = tree[:, :, columns - first]
    return allowed & full


def _attend(problem, b, q, k, v, allowed, block_q, block_k):
    """(o (1, Nq, Hq, Dv), lse (1, Hq, Nq)) of query rows q over the keys k, v that ``allowed``
    lets them see, without the sink; the last key of k is the sequence's last."""
    if k.shape[0] == 0:
        return (np.zeros((1,) + q.shape[:2] + (v.shape[-1],), q.dtype),
                np.full((1, q.shape[1], q.shape[0]), -np.inf, q.dtype))
    slopes = problem.alibi_slopes
    if slopes is not None and slopes.ndim == 2:
        slopes = slopes[b]
    part = build_problem(q[None], k[None], v[None], mask=allowed[None], softmax_scale=problem.softmax_scale,
                         softcap=problem.softcap, alibi_slopes=slopes)
    return forward(part, q[None], k[None], v[None], block_q=block_q, block_k=block_k)


def _join_sink(problem, o, keys_lse):
    """(o (Nq, Hq, Dv), lse (Hq, Nq)) with the sink's column joined once, given the merged result
    over the keys: o takes the keys' share exp(keys_lse - lse) of the row's weight; a row with
    no key keeps o = 0 and gets lse = sink."""
    if problem.sinks is None:
        return o, keys_lse
    with np.errstate(divide="ignore", invalid="ignore"):  # -inf and NaN where the contract says
        lse = with_sink(keys_lse, problem.sinks[:, None].astype(keys_lse.dtype))
        share = np.where(keys_lse == -np.inf, 0.0, np.exp(keys_lse - lse))
    return o * share.T[:, :, None], lse
