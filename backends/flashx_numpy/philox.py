"""Philox4x32-10 and the dropout keep-mask of the contract's Dropout section, vectorised in NumPy."""

from __future__ import annotations

import numpy as np

_MUL0, _MUL1 = 0xD2511F53, 0xCD9E8D57
_BUMP0, _BUMP1 = 0x9E3779B9, 0xBB67AE85
_WORD = 0xFFFFFFFF


def philox4x32(c0, c1, c2, c3, key0: int, key1: int) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 of broadcastable uint32 counter words under the key (key0, key1).

    Returns the four uint32 output words, broadcast against each other. The 32x32-bit
    products are taken in uint64 so their high words are exact.
    """
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in (c0, c1, c2, c3))
    for _ in range(10):
        product0 = c0.astype(np.uint64) * np.uint64(_MUL0)
        product1 = c2.astype(np.uint64) * np.uint64(_MUL1)
        high0, low0 = (product0 >> np.uint64(32)).astype(np.uint32), product0.astype(np.uint32)
        high1, low1 = (product1 >> np.uint64(32)).astype(np.uint32), product1.astype(np.uint32)
        c0, c1, c2, c3 = high1 ^ c1 ^ np.uint32(key0), low1, high0 ^ c3 ^ np.uint32(key1), low0
        key0, key1 = (key0 + _BUMP0) & _WORD, (key1 + _BUMP1) & _WORD
    return np.broadcast_arrays(c0, c1, c2, c3)


def dropout_keep(p: float, seed: int, rng_offset: int, b: int, heads: np.ndarray, heads_q: int,
                 i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
    """Z for keys j0:j1, queries i0:i1 (within sequence b) and query heads ``heads``.

    Returns bool of shape (j1 - j0, i1 - i0, len(heads)), keys first like the backend's
    score tiles: True where the element is kept. One Philox call yields the words of four
    consecutive keys (counter word 0 is j // 4).
    """
    first, last = j0 // 4, (j1 + 3) // 4
    words = philox4x32(
        np.arange(first, last, dtype=np.uint32)[:, None, None],
        np.arange(i0, i1, dtype=np.uint32)[None, :, None],
        (b * heads_q + np.asarray(heads, dtype=np.int64)).astype(np.uint32)[None, None, :],
        rng_offset & _WORD,
        seed & _WORD,
        (seed >> 32) & _WORD,
    )
    # words[w][t] belongs to key 4 * (first + t) + w: interleave them into key order.
    r = np.stack(words, axis=1).reshape(4 * (last - first), i1 - i0, len(heads))
    start = j0 - 4 * first
    return r[start : start + j1 - j0] >= np.uint32(int(p * 2**32))
