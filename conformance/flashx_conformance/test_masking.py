"""The contract's "Scores and masking": causal (bottom-right), windows, boolean, tree and block masks, seqlens, varlen.

Every case runs the forward and the backward and is held to the oracle element by element;
rows left with no key must give o = 0, lse = -inf and dq = 0 exactly, unread keys dk = dv = 0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import flashx
from flashx_conformance.harness import diagonal, full_only, make_case, make_varlen_case, spans_no_block_reads

SHAPES_NQ_NK = [(1, 239), (3, 799), (5, 2), (97, 97), (113, 64), (1, 1)] + [
    pytest.param(*lengths, marks=full_only) for lengths in ((127, 513), (1025, 1023))
]


@pytest.mark.parametrize("seqlen_q, seqlen_k", SHAPES_NQ_NK, ids=lambda n: str(n))
def test_causal(flashx_target, flashx_rng, seqlen_q, seqlen_k):
    """Bottom-right aligned: key j is allowed for query i iff j <= i + Nk - Nq (rows above it are empty)."""
    case = make_case(flashx_rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=2, head_dim=32, dtype=flashx_target.dtype, causal=True)
    flashx_target.check(case)


@pytest.mark.parametrize("seqlen_q, seqlen_k, head_dim, dtype", [
    (200, 300, 64, "float16"),
    pytest.param(127, 513, 64, "bfloat16", marks=full_only),
    pytest.param(200, 300, 128, "float16", marks=full_only),
], ids=str)
def test_causal_16bit(flashx_target, flashx_rng, seqlen_q, seqlen_k, head_dim, dtype):
    """Causal in 16 bits with more keys than queries, lengths off any tile grid: the masked band
    edge then spans several key tiles per query tile (a Triton backend once got dq and dk wrong
    there on the H100, where float32 was right)."""
    case = make_case(flashx_rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=2, head_dim=head_dim, dtype=dtype,
                     causal=True)
    flashx_target.check(case)


MASKS_16BIT = {
    "window": dict(seqlen_q=150, seqlen_k=260, window=(37, 11)),
    "seqlens": dict(batch=3, seqlen_q=160, seqlen_k=230, causal=True, seqlens_q=np.array([160, 77, 1], np.int32),
                    seqlens_k=np.array([230, 200, 5], np.int32)),
    "gqa": dict(seqlen_q=100, seqlen_k=230, heads_q=4, heads_k=2, causal=True),
}


@pytest.mark.parametrize("name, dtype", [pytest.param(name, dtype, marks=full_only) for name in MASKS_16BIT
                                         for dtype in ("bfloat16", "float16")], ids=str)
def test_masks_16bit(flashx_target, flashx_rng, name, dtype):
    """The other masks whose band edge spans several tiles, in 16 bits, at d128 (see test_causal_16bit)."""
    case = make_case(flashx_rng, head_dim=128, dtype=dtype, **MASKS_16BIT[name])
    flashx_target.check(case)


WINDOWS = {
    "left-only": ((16, -1), False),
    "right-only": ((-1, 16), False),
    "both": ((8, 4), False),
    "size-0": ((0, 0), False),
    "left-0": ((0, -1), False),
    "at-least-N": ((200, 200), False),
    "unbounded": ((-1, -1), False),
    "causal-left": ((8, -1), True),
    "causal-right-5": ((8, 5), True),
}


@pytest.mark.parametrize("name, lengths", diagonal(list(WINDOWS), [(97, 97), (33, 143), (143, 33)]), ids=str)
def test_window(flashx_target, flashx_rng, name, lengths):
    """i + Nk - Nq - left <= j <= i + Nk - Nq + right; -1 is unbounded; causal caps right at 0."""
    (window, causal), (seqlen_q, seqlen_k) = WINDOWS[name], lengths
    case = make_case(
        flashx_rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=32, dtype=flashx_target.dtype, window=window, causal=causal
    )
    flashx_target.check(case)


MASK_SHAPES = {"full": lambda b, h, m, n: (b, h, m, n), "per-batch": lambda b, h, m, n: (b, 1, m, n), "shared": lambda b, h, m, n: (m, n)}


@pytest.mark.parametrize("broadcast, density", diagonal(list(MASK_SHAPES), [0.5, 0.05]), ids=str)
def test_bool_mask(flashx_target, flashx_rng, broadcast, density):
    """True = may attend, broadcast to (B, Hq, Nq, Nk); sparse masks leave rows and keys empty."""
    batch, heads, seqlen_q, seqlen_k = 2, 3, 67, 91
    mask = flashx_rng.random(MASK_SHAPES[broadcast](batch, heads, seqlen_q, seqlen_k)) < density
    case = make_case(
        flashx_rng, batch=batch, heads_q=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=32, dtype=flashx_target.dtype, mask=mask
    )
    flashx_target.check(case)


def tree_mask(rng, prefix: int, drafts: int) -> np.ndarray:
    """Speculative decoding: each draft token sees the prefix, its ancestors in a random tree, and itself."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, drafts)]
    mask = np.zeros((drafts, prefix + drafts), dtype=bool)
    mask[:, :prefix] = True
    for i in range(drafts):
        node = i
        while node != -1:
            mask[i, prefix + node] = True
            node = parent[node]
    return mask


@pytest.mark.parametrize("prefix, drafts", [(50, 12), (0, 7), (130, 31)], ids=lambda n: str(n))
def test_tree_mask(flashx_target, flashx_rng, prefix, drafts):
    mask = tree_mask(flashx_rng, prefix, drafts)
    case = make_case(flashx_rng, batch=2, heads_q=4, seqlen_q=drafts, seqlen_k=prefix + drafts, head_dim=64, dtype=flashx_target.dtype, mask=mask)
    flashx_target.check(case)


@pytest.mark.parametrize(
    "block_size",
    [(16, 16), (64, 64), (7, 13)] + [pytest.param(size, marks=full_only) for size in ((32, 64), (128, 128))],
    ids=lambda s: f"{s[0]}x{s[1]}",
)
def test_block_mask(flashx_target, flashx_rng, block_size):
    """Tiles of (bq, bk); all-false blocks, an all-false block row and column; lengths not block multiples."""
    batch, heads, seqlen_q, seqlen_k = 2, 2, 143, 131
    bq, bk = block_size
    blocks = flashx_rng.random((batch, heads, -(-seqlen_q // bq), -(-seqlen_k // bk))) < 0.6
    blocks[0, 0, 0, :] = False
    blocks[1, 1, :, -1] = False
    case = make_case(
        flashx_rng,
        batch=batch,
        heads_q=heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        head_dim=32,
        dtype=flashx_target.dtype,
        block_mask=flashx.BlockMask(blocks, block_size),
    )
    flashx_target.check(case)


@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=full_only)])
def test_block_mask_skips_key_tiles(flashx_target, flashx_rng, head_dim):
    """Key tiles that no row of a query tile may read are skipped unread (NaN in their k and v) between
    tiles that are read: a kernel whose warps schedule the key tiles apart (a producer and the
    computing warps, each voting among its own threads) must skip the same ones."""
    block_mask, unread = spans_no_block_reads(flashx_rng, 2, 2, 130, 448)
    case = make_case(flashx_rng, batch=2, heads_q=2, seqlen_q=130, seqlen_k=448, head_dim=head_dim,
                     dtype=flashx_target.dtype, block_mask=block_mask)
    flashx_target.check(case.with_poison("k", unread).with_poison("v", unread))


SEQLENS = {
    "both": ([97, 40, 0, 13], [97, 0, 50, 77]),
    "q-only": ([1, 96, 50, 97], None),
    "k-only": (None, [1, 96, 0, 97]),
}


@pytest.mark.parametrize("lengths, causal", diagonal(list(SEQLENS), [False, True]), ids=str)
def test_seqlens(flashx_target, flashx_rng, lengths, causal):
    """Rows i >= seqlens_q[b] and keys j >= seqlens_k[b] are padding; causal aligns to each sequence's end."""
    seqlens_q, seqlens_k = (None if n is None else np.array(n, dtype=np.int32) for n in SEQLENS[lengths])
    case = make_case(
        flashx_rng, batch=4, seqlen_q=97, head_dim=32, dtype=flashx_target.dtype, seqlens_q=seqlens_q, seqlens_k=seqlens_k, causal=causal
    )
    flashx_target.check(case)


VARLEN = {
    "zero-length": ([5, 0, 17, 33, 1], [7, 3, 0, 40, 1]),
    "one": ([97], [143]),
    "long": ([130, 3, 64], [128, 150, 64]),
}
OPTIONS = {"full": {}, "causal": {"causal": True}, "window": {"window": (9, 3)}}


@pytest.mark.parametrize("lengths, options", diagonal(list(VARLEN), list(OPTIONS)), ids=str)
def test_varlen(flashx_target, flashx_rng, lengths, options):
    """Packed sequences by cu_seqlens, zero-length ones included, and rows past the last sequence."""
    (lengths_q, lengths_k), options = VARLEN[lengths], OPTIONS[options]
    case = make_varlen_case(
        flashx_rng, lengths_q=lengths_q, lengths_k=lengths_k, spare_rows=3, heads_q=4, heads_k=2, head_dim=32, dtype=flashx_target.dtype, **options
    )
    flashx_target.check(case)


def _features_16bit(rng, dtype: str, deterministic: bool) -> dict:
    """Each feature over several tiles of 64 rows in 16 bits, where GPU kernels run on tensor cores
    and may take another backward than float32 does (by deterministic, and by band, too)."""
    common = dict(dtype=dtype, deterministic=deterministic, head_dim=64)
    blocks = rng.random((2, 2, 3, 3)) < 0.6
    blocks[0, 0, 0, :] = False
    mask = rng.random((90, 150)) < 0.6
    mask[:, [3, 70, 149]] = False
    unread = (~mask.any(axis=0))[None, :, None, None]
    outside = (np.arange(150) < 150 - 90 - 4)[None, :, None, None]
    return {
        "causal-gqa": make_case(rng, seqlen_q=100, seqlen_k=230, heads_q=4, heads_k=2, causal=True, **common),
        "bool-mask": make_case(rng, seqlen_q=90, seqlen_k=150, mask=rng.random((90, 150)) < 0.6, **common),
        "block-mask": make_case(rng, seqlen_q=143, seqlen_k=131, block_mask=flashx.BlockMask(blocks, (64, 48)), **common),
        "dropout": make_case(rng, seqlen_q=97, seqlen_k=143, dropout_p=0.25, seed=3, **common),
        "varlen-gqa": make_varlen_case(rng, lengths_q=[130, 3, 64], lengths_k=[128, 150, 64], spare_rows=3, heads_q=4,
                                       heads_k=2, **common),
        # keys no query may read hold inf, in tiles that also hold keys that are read
        "masked-keys-inf": make_case(rng, seqlen_q=90, seqlen_k=150, mask=mask, **common).with_poison(
            "k", unread, math.inf).with_poison("v", unread, -math.inf),
        "window-unread-inf": make_case(rng, seqlen_q=90, seqlen_k=150, window=(4, 0), **common).with_poison(
            "k", outside, math.inf).with_poison("v", outside, math.inf),
    }


@pytest.mark.parametrize("name, deterministic", diagonal(list(_features_16bit(np.random.default_rng(0), "bfloat16", False)),
                                                         [False, True]), ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=full_only)])
def test_features_16bit(flashx_target, flashx_rng, name, deterministic, dtype):
    """The masks, dropout, varlen and GQA in 16 bits, with and without deterministic=True: a
    backend may add dQ across key tiles by unordered float32 reductions unless determinism is
    asked for, and both backwards are held to the oracle."""
    flashx_target.check(_features_16bit(flashx_rng, dtype, deterministic)[name])
