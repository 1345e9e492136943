"""Dropout's keep bits (the contract's Dropout section): the Philox draw in the kernels, and the
values they draw from, packed on the host.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kept_scale(dropout):
    """1 / (1 - p), what a kept value is multiplied by: the last of ``dropout_args``' values."""
    seed, rng_offset, threshold, row0, key0, scale = dropout
    return scale


@triton.jit
def dropout_keep(i, j, stream, dropout):
    """Z[i, j] of the contract's Dropout section, row i and key j at positions row0 + i and key0 + j
    (the ``dropout_offsets`` option): with y = key0 + j, word y % 4 of
    Philox4x32-10((y // 4, row0 + i, stream, offset), seed) >= threshold. ``dropout`` is
    (seed, rng_offset, threshold, row0, key0, scale) (``dropout_args``)."""
    seed, rng_offset, threshold, row0, key0, _ = dropout
    zero = i * 0 + j * 0
    j = j + key0
    c0 = (zero + j // 4).to(tl.uint32)
    c1 = (zero + i + row0).to(tl.uint32)
    c2 = (zero + stream).to(tl.uint32)
    c3 = (zero + rng_offset).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    word = zero + j % 4
    r = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
    return r.to(tl.int64) >= threshold


def dropout_args(problem) -> tuple:
    """(seed, rng_offset, threshold, row0, key0, scale): what ``dropout_keep`` draws from and the
    kept values' scale."""
    seed = problem.seed
    # The seed is passed as a signed 64-bit value with the same bits; tl.philox reads it as uint64.
    return (seed - (1 << 64) if seed >= 1 << 63 else seed, problem.rng_offset_words[0], problem.dropout_threshold,
            *problem.dropout_offsets, problem.dropout_scale)
