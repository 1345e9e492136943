"""Dropout's keep bits (the contract's Dropout section): the Philox draw in the kernels, and the
values they draw from, packed on the host.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: The kernels' dropout arguments that change from call to call (``dropout_args``): the seed's
#: low and high words, rng_offset's low word and the positions of row 0 and key 0
#: (``dropout_offsets``; a ring's every step draws at its own). Triton must not specialise them
#: (on == 1 and on divisibility by 16), or each seed and step would compile the kernels anew;
#: and each travels as an int32 holding the bits the draw reads, since Triton also compiles an
#: int once per width (i32, i64). The rate, a model's, is ``problem_args``' ``dropout_rate``:
#: (threshold, scale).
DROPOUT_DRAW = ("seed_lo", "seed_hi", "rng_offset", "row0", "key0")


@triton.jit
def dropout_state(seed_lo, seed_hi, rng_offset, row0, key0, dropout_rate):
    """``dropout``, what ``dropout_keep`` and ``kept_scale`` read, from a kernel's arguments
    ``DROPOUT_DRAW`` and ``dropout_rate``: (seed, rng_offset, threshold, row0, key0, scale), the
    seed a uint64 again."""
    threshold, scale = dropout_rate
    seed = seed_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32 | seed_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    return seed, rng_offset, threshold, row0, key0, scale


@triton.jit
def kept_scale(dropout):
    """1 / (1 - p), what a kept value is multiplied by: the last of ``dropout_state``'s values."""
    seed, rng_offset, threshold, row0, key0, scale = dropout
    return scale


@triton.jit
def dropout_keep(i, j, stream, dropout):
    """Z[i, j] of the contract's Dropout section, row i and key j at positions row0 + i and key0 + j
    (the ``dropout_offsets`` option): with y = key0 + j, word y % 4 of
    Philox4x32-10((y // 4, row0 + i, stream, offset), seed) >= threshold. ``dropout`` is
    (seed, rng_offset, threshold, row0, key0, scale) (``dropout_state``). One Philox call an
    element, of which ``dropout_keep_tile`` keeps a quarter."""
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


@triton.jit
def dropout_keep_tile(rows, first_key, BLOCK_N: tl.constexpr, stream, dropout, KEYS_FIRST: tl.constexpr = False):
    """``dropout_keep`` of rows ``rows`` (1-D) and the BLOCK_N keys from ``first_key``: (rows,
    BLOCK_N), or (BLOCK_N, rows) with KEYS_FIRST (the dK/dV kernel's transposed scores). Where
    key0 + first_key is a multiple of 4 (tiles start at multiples of 4, so wherever key0 is one),
    each Philox call serves the four keys of its counter: the words of BLOCK_N / 4 counters a row,
    interleaved along the keys, key 4c + w taking word w of counter c."""
    seed, rng_offset, threshold, row0, key0, _ = dropout
    if (key0 + first_key) % 4 == 0:
        counters = (key0 + first_key) // 4 + tl.arange(0, BLOCK_N // 4)
        zero = rows[:, None] * 0 + counters[None, :] * 0
        r0, r1, r2, r3 = tl.philox(seed, (zero + counters[None, :]).to(tl.uint32), (zero + rows[:, None] + row0).to(tl.uint32),
                                   (zero + stream).to(tl.uint32), (zero + rng_offset).to(tl.uint32))
        k0 = (r0.to(tl.int64) >= threshold).to(tl.int8)
        k1 = (r1.to(tl.int64) >= threshold).to(tl.int8)
        k2 = (r2.to(tl.int64) >= threshold).to(tl.int8)
        k3 = (r3.to(tl.int64) >= threshold).to(tl.int8)
        # join stacks along a new last axis: [.., c, x, y] holds word 2x + y, key 4c + 2x + y. In
        # bytes, so that the layout conversions' scratch is a quarter of the words'.
        kept = tl.reshape(tl.join(tl.join(k0, k2), tl.join(k1, k3)), (rows.shape[0], BLOCK_N))
        if KEYS_FIRST:  # the bytes, not the booleans: a transposed boolean tile fails sm_90's lowering (Triton 3.6)
            kept = tl.trans(kept)
        keep = kept != 0
    elif KEYS_FIRST:
        keep = dropout_keep(rows[None, :], first_key + tl.arange(0, BLOCK_N)[:, None], stream, dropout)
    else:
        keep = dropout_keep(rows[:, None], first_key + tl.arange(0, BLOCK_N)[None, :], stream, dropout)
    return keep


def dropout_args(problem) -> tuple[int, ...]:
    """A call's ``DROPOUT_DRAW``, in its order, each an int32: the bits of its uint32 word, or an
    offset (validation holds them below 2**31). Launches rely on it (``launch.call_args``): Triton
    would compile another width anew."""
    (seed_lo, seed_hi), rng_offset = problem.seed_words, problem.rng_offset_words[0]
    row0, key0 = problem.dropout_offsets
    return _int32(seed_lo), _int32(seed_hi), _int32(rng_offset), row0, key0


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word
