"""Which (query, key) pairs a call allows, and which tiles of a band of rows a program meets.

Device side: where a sequence lives (its start and length, padded, seqlens or varlen), the tiles
of a row block's band split into the masked ones at its edges and the full ones inside it, and the
pair rule of the contract's "Scores and masking" section (band, lengths, bool mask, block mask).
Host side: which of those parts a kernel compiles (``band_parts``). Masking happens only in
masked tiles: the tiles fully inside the band run without a single compare.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sequence_bounds(b, CU, SEQLENS, padded_length, IS_VARLEN: tl.constexpr, HAS_SEQLENS: tl.constexpr):
    """(first row in the tensor, length) of sequence b."""
    if IS_VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
    elif HAS_SEQLENS:
        start = 0
        length = tl.load(SEQLENS + b).to(tl.int32)
    else:
        start = 0
        length = padded_length
    return start, length


@triton.jit
def query_tile(pid, CU_Q, CU_K, SEQLENS_Q, SEQLENS_K, padded_q, padded_k, heads_q, BLOCK_M: tl.constexpr,
               IS_VARLEN: tl.constexpr, HAS_SEQLENS_Q: tl.constexpr, HAS_SEQLENS_K: tl.constexpr):
    """(m0, b, h, q_start, q_len, k_start, k_len) of program ``pid``'s query tile.

    One axis (no 65535 limit); a head's tiles are adjacent so they share K/V in L2, and the
    last query tiles, which see the most keys under a causal band, start first. (Interleaving
    the tiles of several heads, so that no heavy tile starts last, measured no faster:
    docs/triton-design.md, "The forward".)
    """
    num_tiles = tl.cdiv(padded_q, BLOCK_M)
    head = pid // num_tiles
    m0 = (num_tiles - 1 - pid % num_tiles) * BLOCK_M
    b = head // heads_q
    h = head % heads_q
    q_start, q_len = sequence_bounds(b, CU_Q, SEQLENS_Q, padded_q, IS_VARLEN, HAS_SEQLENS_Q)
    k_start, k_len = sequence_bounds(b, CU_K, SEQLENS_K, padded_k, IS_VARLEN, HAS_SEQLENS_K)
    return m0, b, h, q_start, q_len, k_start, k_len


@triton.jit
def band_tiles(first_row, length, other_length, left, right, ROWS: tl.constexpr, TILE: tl.constexpr,
               ALL_MASKED: tl.constexpr):
    """The tiles of the other axis that rows [first_row, first_row + ROWS) meet.

    Row r may use columns r + diag - left ..= r + diag + right (diag = other_length - length;
    for keys looking at queries, pass left and right swapped). Returns (first, full_lo, full_hi,
    end): columns [first, end) are used by some row; tiles in [full_lo, full_hi) are used by
    every valid row and lie inside the other sequence, so they need no mask.
    """
    diag = other_length - length
    last_row = tl.minimum(first_row + ROWS, length) - 1
    first = tl.maximum(first_row + diag - left, 0)
    end = tl.minimum(last_row + diag + right + 1, other_length)
    # No row, or no column any row may use: every range is empty.
    empty = (last_row < first_row) | (end <= first)
    first = tl.where(empty, 0, first)
    end = tl.where(empty, 0, end)
    if ALL_MASKED:
        full_lo = end
        full_hi = end
    else:
        full_lo = tl.cdiv(tl.maximum(last_row + diag - left, 0), TILE) * TILE
        full_lo = tl.minimum(tl.maximum(full_lo, first // TILE * TILE), end)
        full_hi = tl.maximum(tl.minimum(first_row + diag + right + 1, other_length), 0) // TILE * TILE
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
    return first, full_lo, full_hi, end


@triton.jit
def band_part(part: tl.constexpr, first_tile, full_lo, full_hi, end):
    """Tiles [lo, hi) of part 0 (the masked tiles before the full ones), 1 (the full tiles, which
    need no mask) or 2 (the masked tiles after them) of band_tiles' range."""
    if part == 0:
        return first_tile, full_lo
    elif part == 1:
        return full_lo, full_hi
    else:
        return full_hi, end


@triton.jit
def diagonal_part(side: tl.constexpr, lo, hi, first_row, diag, ROWS: tl.constexpr, TILE: tl.constexpr):
    """Tiles [lo, hi) (at multiples of TILE) of the other axis, as met by rows [first_row,
    first_row + ROWS) whose diagonal is column row + diag, split by side: 0, the tiles wholly
    before it (column <= row + diag at every pair of the tile); 1, those across it; 2, those
    wholly after it (column >= row + diag). ALiBi's distance keeps one sign in the first and
    last (``alibi_split``)."""
    before = tl.minimum(tl.maximum(tl.maximum(first_row + diag + 1, 0) // TILE * TILE, lo), hi)
    after = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(first_row + ROWS - 1 + diag, 0), TILE) * TILE, before), hi)
    if side == 0:
        return lo, before
    elif side == 1:
        return before, after
    else:
        return after, hi


@triton.jit
def pair_rule(b, h, q_len, k_len, left, right, MASK, BLOCKS, masks, HAS_MASK: tl.constexpr,
              HAS_BLOCK_MASK: tl.constexpr):
    """What decides which pairs of sequence b, query head h are allowed, packed for allowed_pairs
    (an absent mask is 0: Triton 3.6 takes no None into a tuple): the band's reaches, and
    ``masks``, the strides of MASK and BLOCKS and the block mask's block sizes (``mask_layout``)."""
    stride_mb, stride_mh, stride_mi, stride_mj, stride_bb, stride_bh, stride_bi, stride_bj, block_q, block_k = masks
    mask_base = MASK + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh if HAS_MASK else 0
    blocks_base = BLOCKS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh if HAS_BLOCK_MASK else 0
    return (q_len, k_len, left, right, mask_base, stride_mi, stride_mj, blocks_base, stride_bi, stride_bj, block_q,
            block_k)


@triton.jit
def allowed_pairs(i, j, pairs, HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr):
    """The contract's "Scores and masking" rules for query rows i and key columns j
    (broadcastable index tensors) of the sequence and head that ``pairs`` (``pair_rule``) describes."""
    q_len, k_len, left, right, mask_base, stride_mi, stride_mj, blocks_base, stride_bi, stride_bj, block_q, block_k = (
        pairs)
    diag = k_len - q_len
    ok = (i < q_len) & (j < k_len) & (j >= i + diag - left) & (j <= i + diag + right)
    if HAS_MASK:
        ok &= tl.load(mask_base + i.to(tl.int64) * stride_mi + j.to(tl.int64) * stride_mj, mask=ok, other=0) != 0
    if HAS_BLOCK_MASK:
        ok &= tl.load(blocks_base + (i // block_q) * stride_bi + (j // block_k) * stride_bj, mask=ok, other=0) != 0
    return ok


def band_parts(problem, keys: bool, tile: int) -> int:
    """Which of ``band_part``'s three parts can hold tiles, bit ``1 << part`` each, for programs
    that hold query rows (``keys`` False) or keys and stream the other axis ``tile`` rows at a time.

    The kernels compile only these parts' loops: a masked loop holds registers and shared memory
    even where it never runs (masked_dot's NaN path above all), and makes the full tiles' loop
    spill (docs/triton-design.md, "Tiles of a band"). By ``band_tiles``, masked tiles come before the
    full ones only under a mask (then every used tile is masked) or where the near edge of the
    band is bounded, and after them only where its far edge is, or where the other axis can end
    inside a tile.
    """
    if problem.mask is not None or problem.block_mask is not None:
        return 0b001
    near, far = problem.band or (-1, -1)
    if keys:  # seen from the keys, the band is mirrored
        near, far = far, near
    other_length = problem.seqlen_q if keys else problem.seqlen_k
    ragged = (problem.varlen or (problem.seqlens_q if keys else problem.seqlens_k) is not None
              or other_length % tile != 0)
    return 0b010 | (near != -1) | (far != -1 or ragged) << 2


MASKED_PARTS = 0b101  # band_parts' bits for the masked tiles
