"""Exactness (the contract's Numerics section): lengths that are not block multiples, head dims, dtypes, GQA."""

from __future__ import annotations

import numpy as np
import pytest

from flashx_conformance.harness import DTYPES, diagonal, full_only, make_case

# (batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v)
LENGTHS = [(2, n, n, 2, 64, 64) for n in (1, 2, 5, 17, 97, 113, 143)]
LONG = [(1, n, n, 2, 64, 64) for n in (1023, 1025)]
# Tile multiples: full tiles only, no masked loop in the kernel (warp-specialized Triton kernels
# gave NaN or left outputs unwritten on the H100 at such shapes and passed the other shapes here).
FULL_TILES = [(2, 1024, 1024, 2, 128, 128), (2, 1024, 1024, 4, 64, 64)]
UNEQUAL = [(2, 17, 143, 2, 64, 64), (2, 143, 17, 2, 64, 64)]
# Long key loops, where a backend may take other tiles than for short ones (CuPy's wgmma forward does).
LONG_KEYS = [(1, 130, 4100, 2, 64, 64), (1, 130, 4100, 2, 128, 128)]
HEAD_DIMS = [(1, 45, 45, 2, d, d) for d in (8, 16, 32, 40, 64, 80, 96, 128, 160, 192, 256)]
# Narrow tiles beside wide ones (D 8 or 32 with Dv 64 or 128, and Dv 32 with D 64) have miscompiled on GPUs.
VALUE_DIMS = [(2, 33, 47, 2, 64, 32), (2, 33, 47, 2, 32, 128), (2, 20, 37, 2, 8, 64), (1, 50, 50, 2, 40, 80),
              (1, 50, 50, 2, 192, 128)]
MANY_HEADS = [(5, 33, 33, 12, 32, 32), (16, 45, 45, 16, 32, 32)]  # an interpreter runs B*H programs in turn


def _id(value):
    return "B{}-Nq{}-Nk{}-H{}-D{}-Dv{}".format(*value) if isinstance(value, tuple) else str(value)


@pytest.mark.parametrize(
    "shape, dtype",
    diagonal(LENGTHS + UNEQUAL + HEAD_DIMS + VALUE_DIMS, list(DTYPES))
    + [pytest.param(shape, dtype, marks=full_only) for shape in LONG + LONG_KEYS + FULL_TILES + MANY_HEADS for dtype in DTYPES],
    ids=_id,
)
def test_exactness(flashx_target, flashx_rng, shape, dtype):
    batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v = shape
    case = make_case(
        flashx_rng,
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_q=heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
    )
    flashx_target.check(case)


#: The widest head dims (class 256, alone and beside 128) under each feature that changes a
#: backward's steps, over lengths that cross the tiles a backend takes there (CuPy's wgmma backward:
#: 128 keys a CTA, steps of 32 query rows, dK and dV in a launch each). (D, Dv) and the options.
WIDE_DIMS = [(256, 256), (256, 128), (128, 256), (192, 256)]
WIDE_FEATURES = {
    "plain": lambda rng: {},
    "causal-gqa": lambda rng: dict(causal=True, heads_q=4, heads_k=2),
    "window": lambda rng: dict(window=(37, 11)),
    "dropout": lambda rng: dict(dropout_p=0.2, seed=11, rng_offset=5, causal=True),
    "mask": lambda rng: dict(mask=rng.random((2, 2, 70, 150)) < 0.3),
    "mods": lambda rng: dict(causal=True, softcap=3.0, alibi_slopes=np.array([0.5, 0.25]), sinks=np.array([0.5, -1.0])),
    "seqlens": lambda rng: dict(seqlens_q=np.array([70, 33], np.int32), seqlens_k=np.array([150, 129], np.int32),
                                causal=True),
}


@pytest.mark.parametrize("feature, dims, dtype", [
    pytest.param(feature, dims, dtype, marks=full_only)
    for (feature, dims), dtype in zip([(f, d) for f in WIDE_FEATURES for d in WIDE_DIMS],
                                      ["bfloat16", "float16"] * len(WIDE_FEATURES) * len(WIDE_DIMS))], ids=str)
def test_widest_head_dims(flashx_target, flashx_rng, feature, dims, dtype):
    """Forward and backward at head dims of class 256 with each feature, 16-bit (the tensor-core paths)."""
    head_dim, head_dim_v = dims
    options = dict(batch=2, seqlen_q=70, seqlen_k=150, heads_q=2) | WIDE_FEATURES[feature](flashx_rng)
    case = make_case(flashx_rng, head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype, **options)
    flashx_target.check(case)


GQA = [(4, 4), (4, 2), (14, 2), (8, 1), (7, 1), (21, 3)]  # ratios 1, 2, 7, MQA, MQA, 7


@pytest.mark.parametrize(
    "heads, variant", diagonal(GQA, [("float16", False), ("float32", True), ("float32", False), ("float16", True)]), ids=str
)
def test_gqa(flashx_target, flashx_rng, heads, variant):
    """Query head h reads kv head h // (Hq / Hk); dk, dv sum over the group (ratios 1, 2, 7, MQA)."""
    (heads_q, heads_k), (dtype, causal) = heads, variant
    case = make_case(flashx_rng, batch=1, seqlen_q=45, seqlen_k=77, heads_q=heads_q, heads_k=heads_k, head_dim=32, dtype=dtype, causal=causal)
    flashx_target.check(case)


#: Decoding steps that reach attention (a transformers generate() step): a few query rows over
#: many keys, which a backend may compute as decoding (the contract's "Attention as decoding"):
#: split-KV, each kv head's keys read once for its group. (Nq, Nk, Hq, Hk, causal, window); the
#: last has more rows than keys, so that its first rows have none.
SHORT_QUERIES = [(1, 300, 8, 2, False, None), (4, 300, 8, 2, True, None), (16, 129, 4, 4, True, (50, 0)),
                 (3, 70, 8, 1, False, (10, 5)), (6, 4, 4, 2, True, None)]


@pytest.mark.parametrize("shape", SHORT_QUERIES, ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=full_only)])
def test_short_query(flashx_target, flashx_rng, shape, dtype):
    seqlen_q, seqlen_k, heads_q, heads_k, causal, window = shape
    case = make_case(flashx_rng, batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_k=heads_k,
                     head_dim=64, dtype=dtype, causal=causal, window=window)
    flashx_target.check(case)


@pytest.mark.parametrize("seed", [8, 41, 48, 194])
def test_one_row_with_large_scores(flashx_target, seed):
    """One query row with scaled scores near 24, in float32 (hypothesis found this shape).

    The rounding of an exponent at that magnitude, and of the float32 lse the backward
    recomputes P from, errs by ~8 ulps. On these inputs plain attention errs by almost nothing,
    since its largest P is exp(0). The tolerance's floor covers both (tolerance.py).
    """
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=1, seqlen_q=1, seqlen_k=7, heads_q=1, head_dim=32, dtype="float32", softmax_scale=-2.0)
    flashx_target.check(case)


@pytest.mark.parametrize("head_dim, seqlen_q, seed", [(40, 1, 24), (40, 1, 69), (40, 2, 1), (256, 1, 49), (256, 2, 22),
                                                      (256, 2, 85)], ids=str)
def test_one_key_with_cancelling_scores(flashx_target, head_dim, seqlen_q, seed):
    """One key, float32: each row's lse is its one score, a dot product whose terms cancel to
    a few times less than their magnitude (hypothesis found this shape).

    The score's float32 rounding is at the magnitude of its terms, which a different order of
    summation moves; on these inputs plain attention happens to sum nearly exactly. The floor of
    lse's tolerance counts the scores' terms (oracle.term_magnitudes), not their cancelled sum.
    """
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=1, seqlen_q=seqlen_q, seqlen_k=1, heads_q=1, head_dim=head_dim, dtype="float32")
    flashx_target.check(case)


@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True)], ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=full_only)])
def test_rising_row_max(flashx_target, flashx_rng, head_dim, causal, dtype):
    """Scores that climb along the keys, 1.7 to 4.7 units (base e) a tile of 64 to 176 keys, then
    a key 5 units above the climb's top (a weight of 2^7.2 against it), a plateau, and a key 48
    units above that; each row at its own rate, 0.5 to 1.5 times that, so that the rows of a
    tile move their maxima at different tiles.

    An online softmax may take its weights against a reference that lags behind the maximum
    (FlashAttention-4 moves it only once a tile's maximum passes it by 2^8 in weight), so that
    weights above 1 reach the 16-bit product with V, and the reference moves every few tiles
    rather than at each. Standard normal inputs put a row's maximum in its first tiles and
    leave that path nearly unvisited; here every tile visits it, on both sides of the move.
    Coordinate 0 of q is sqrt(D) times the row's rate and of k the climb, so that a score is the
    climb times the rate plus a standard normal term."""
    seqlen_k, seqlen_q = 600, 130
    climb = np.full(seqlen_k, 12.0)
    climb[:450] = np.linspace(0.0, 12.0, 450)
    climb[450], climb[520] = 17.0, 60.0
    case = make_case(flashx_rng, batch=1, heads_q=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
                     dtype=dtype, causal=causal)
    case.inputs["q"][..., 0] = np.sqrt(head_dim) * (0.5 + np.arange(seqlen_q) % 16 / 15)[None, :, None]
    case.inputs["k"][..., 0] = climb[None, :, None]
    flashx_target.check(case)
