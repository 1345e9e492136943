"""Philox4x32-10 and the dropout draw of the contract's Dropout section, as numba device functions.

Every word is held in uint64 with only its low 32 bits used: Numba types uint32 + uint32 as
uint64 anyway, and the 32x32 -> 64-bit products of Philox need the high word exact. Constants
are np.uint64 throughout, since mixing uint64 with a signed integer makes Numba compute in
float64, which silently breaks bit-exactness. Under the CUDA simulator the same functions run
as Python on NumPy scalars, with the same results.
"""

from __future__ import annotations

import numpy as np
from flashx_numba.primitives import device_function

_WORD = np.uint64(0xFFFFFFFF)
_HIGH = np.uint64(32)
_MUL0, _MUL1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_BUMP0, _BUMP1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)


@device_function
def philox4x32(c0, c1, c2, c3, k0, k1):
    """The four output words of Philox4x32-10 for counter (c0, c1, c2, c3) and key (k0, k1).

    Arguments and results are uint64 holding 32-bit words.
    """
    for _ in range(10):
        product0 = _MUL0 * c0
        product1 = _MUL1 * c2
        c0, c1, c2, c3 = ((product1 >> _HIGH) ^ c1 ^ k0, product1 & _WORD,
                          (product0 >> _HIGH) ^ c3 ^ k1, product0 & _WORD)
        k0 = (k0 + _BUMP0) & _WORD
        k1 = (k1 + _BUMP1) & _WORD
    return c0, c1, c2, c3


@device_function
def dropout_word(i, j, stream, rng_offset, seed_low, seed_high):
    """r of the contract's Dropout section: word j % 4 of Philox4x32-10 at counter
    (j // 4, i, stream, rng_offset) under key (seed_low, seed_high); i and j count within
    the sequence, stream is b * Hq + h. All arguments are non-negative; the result is uint64."""
    r0, r1, r2, r3 = philox4x32(np.uint64(j // 4) & _WORD, np.uint64(i) & _WORD, np.uint64(stream) & _WORD,
                                np.uint64(rng_offset) & _WORD, np.uint64(seed_low), np.uint64(seed_high))
    word = j % 4
    if word == 0:
        return r0
    if word == 1:
        return r1
    if word == 2:
        return r2
    return r3


@device_function
def dropout_keep(i, j, stream, rng_offset, seed_low, seed_high, threshold):
    """Z of the contract's Dropout section: whether pair (i, j) is kept (r >= floor(p * 2**32))."""
    return dropout_word(i, j, stream, rng_offset, seed_low, seed_high) >= np.uint64(threshold)
