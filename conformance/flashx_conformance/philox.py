"""Philox4x32-10 and the dropout keep mask of the contract's Dropout section, vectorised in NumPy.

Written from the Salmon et al. (2011) definition; the known-answer vectors of Random123
and of shared/reference/philox.md are checked in ``test_oracle.py``.
"""

from __future__ import annotations

import math

import numpy as np

_WORD = np.uint64(0xFFFFFFFF)
_MULTIPLIERS = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_KEY_INCREMENTS = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))


def philox4x32(counter, key, rounds: int = 10) -> tuple[np.ndarray, ...]:
    """The four uint32 output words for counters (c0, c1, c2, c3) and key (k0, k1).

    Every word may be an array (broadcast together); the 32x32 -> 64-bit products are
    taken in uint64, which cannot overflow.
    """
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) for k in key)
    for _ in range(rounds):
        product0, product1 = _MULTIPLIERS[0] * c0, _MULTIPLIERS[1] * c2
        c0, c1, c2, c3 = (
            (product1 >> np.uint64(32)) ^ c1 ^ k0,
            product1 & _WORD,
            (product0 >> np.uint64(32)) ^ c3 ^ k1,
            product0 & _WORD,
        )
        k0, k1 = (k0 + _KEY_INCREMENTS[0]) & _WORD, (k1 + _KEY_INCREMENTS[1]) & _WORD
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def keep_mask(seed: int, rng_offset: int, dropout_p: float, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int,
              offsets: tuple[int, int] = (0, 0)) -> np.ndarray:
    """Z[b, h, i, j] of the contract's Dropout section as a bool array (B, Hq, Nq, Nk); i, j within sequence b,
    counted from ``offsets`` (the positions of row 0 and key 0: the ``dropout_offsets`` option)."""
    row0, key0 = offsets
    first, end = key0 // 4, -(-(key0 + seqlen_k) // 4)
    b = np.arange(batch, dtype=np.uint64).reshape(-1, 1, 1, 1)
    h = np.arange(heads_q, dtype=np.uint64).reshape(1, -1, 1, 1)
    i = np.arange(row0, row0 + seqlen_q, dtype=np.uint64).reshape(1, 1, -1, 1)
    column_group = np.arange(first, end, dtype=np.uint64).reshape(1, 1, 1, -1)
    counter = (column_group, i, b * np.uint64(heads_q) + h, np.uint64(rng_offset & 0xFFFFFFFF))
    counter = np.broadcast_arrays(*counter)
    words = philox4x32(counter, (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    # word j % 4 of call j // 4: interleave the four words along the key axis
    r = np.stack(words, axis=-1).reshape(batch, heads_q, seqlen_q, 4 * (end - first))
    r = r[..., key0 - 4 * first : key0 - 4 * first + seqlen_k]
    return r >= np.uint32(math.floor(dropout_p * 2**32))
