"""Decoding with a KV cache in NumPy: the reference for ``flashx.attention_with_kvcache``.

The new tokens are written into the cache first (through the block table when it is paged).
Then, per sequence, its Lk keys are gathered in order, the pairs each query row may attend to
become one boolean mask (the band of causal and window at the sequence's own length, and the
tree mask over its last Nq keys), and the keys are cut into ``num_splits`` consecutive parts
(one part when it is 0). Each part is attended to by the tiled forward (``flashx_numpy.attention``,
which keeps masked-out NaN out of every product) and the parts are combined as the contract's
"Merging partial results" says, through ``flashx.merge_states``.
"""

from __future__ import annotations

import numpy as np

import flashx
from flashx.validation import build_problem
from flashx_numpy.attention import forward


def decode(problem, q, k_cache, v_cache, k_new, v_new, *, block_q: int, block_k: int):
    """(o, lse) in the layouts of the contract's Shapes section; o in float32 or float64."""
    lengths = problem.cache_seqlens.astype(np.int64)
    if k_new is not None:
        for b in range(problem.batch):
            where = _slots(problem, b, lengths[b] + np.arange(problem.new_tokens))
            k_cache[where] = k_new[b]
            v_cache[where] = v_new[b]
    work = np.float64 if problem.dtype == "float64" else np.float32
    o = np.empty(problem.o_shape, work)
    lse = np.empty(problem.lse_shape, problem.lse_dtype)
    parts = problem.num_splits or 1
    for b in range(problem.batch):
        where = _slots(problem, b, np.arange(lengths[b] + problem.new_tokens))
        keys, values = k_cache[where].astype(work), v_cache[where].astype(work)
        queries = q[b].astype(work)
        allowed = _allowed(problem, b, keys.shape[0])
        bounds = keys.shape[0] * np.arange(parts + 1) // parts
        merged = None
        for j0, j1 in zip(bounds[:-1], bounds[1:]):
            part = _attend(problem, queries, keys[j0:j1], values[j0:j1], allowed[..., j0:j1], block_q, block_k)
            with np.errstate(invalid="ignore"):  # NaN in, NaN out
                merged = part if merged is None else flashx.merge_states(*merged, *part)
        o[b], lse[b] = merged[0][0], merged[1][0]
    return o, lse


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


def _attend(problem, q, k, v, allowed, block_q, block_k):
    """(o (1, Nq, Hq, Dv), lse (1, Hq, Nq)) of query rows q over the keys k, v of one part."""
    if k.shape[0] == 0:
        return (np.zeros((1,) + q.shape[:2] + (v.shape[-1],), q.dtype),
                np.full((1, q.shape[1], q.shape[0]), -np.inf, q.dtype))
    part = build_problem(q[None], k[None], v[None], mask=allowed[None], softmax_scale=problem.softmax_scale)
    return forward(part, q[None], k[None], v[None], block_q=block_q, block_k=block_k)
