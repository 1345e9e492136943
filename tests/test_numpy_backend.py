"""The NumPy reference backend against the conformance suite's float64 oracle, feature by feature.

The backend runs through the public API under the name "numpy-small-tiles" with tiles of
16 query rows x 24 keys, so every case crosses many tiles (diagonal, boundary, skipped).
The full case catalogue lives in the conformance suite; its oracle and its Philox, both
independent of every backend, are the references here.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from flashx_conformance import oracle, philox

import flashx
from flashx_numpy import NumpyBackend
from flashx_numpy.philox import dropout_keep, philox4x32

SMALL = "numpy-small-tiles"
# Relative Frobenius error against float64 (the contract's Numerics section; float64 runs in float64).
RELATIVE_TOLERANCE = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def small_tiles():
    flashx.registry.register(NumpyBackend(block_q=16, block_k=24, name=SMALL), replace=True)
    yield
    flashx.registry.unregister(SMALL)


# ---------------------------------------------------------------- Philox against the suite's


@pytest.mark.parametrize("key", [(0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (0xA4093822, 0x299F31D0), (1, 0x80000000)])
def test_philox_matches_the_suites(key):
    counters = np.random.default_rng(key[0]).integers(0, 2**32, size=(4, 500), dtype=np.uint64)
    counters[:, :2] = [0, 0xFFFFFFFF]  # the all-zero and all-one counters
    for got, want in zip(philox4x32(*counters, *key), philox.philox4x32(counters, key)):
        np.testing.assert_array_equal(got, want)


# Seeds with the high word set, an offset past 2**32 (only its low word is drawn).
DROPOUT_DRAWS = [(0, 0), (0x2A, 0), (0x1234567890ABCDEF, 7), (0x7FFFFFFFFFFFFFFF, 2**32 + 3)]


@pytest.mark.parametrize("seed, rng_offset", DROPOUT_DRAWS)
def test_dropout_mask_matches_the_suites(seed, rng_offset):
    batch, heads_q, seqlen_q, seqlen_k, p = 2, 3, 9, 23, 0.4
    want = philox.keep_mask(seed, rng_offset, p, batch, heads_q, seqlen_q, seqlen_k)
    got = [dropout_keep(p, seed, rng_offset, b, np.arange(heads_q), heads_q, 0, seqlen_q, 0, seqlen_k) for b in range(batch)]
    np.testing.assert_array_equal(np.stack(got).transpose(0, 3, 2, 1), want)


@pytest.mark.parametrize("seed, rng_offset", DROPOUT_DRAWS)
def test_dropout_keeps_a_draw_equal_to_its_threshold(seed, rng_offset):
    """Kept iff r >= floor(p * 2**32): p = r / 2**32 keeps the element whose draw is r, (r + 1) / 2**32 drops it."""
    b, h, heads_q, i, j = 1, 2, 4, 3, 5
    counter = (j // 4, i, b * heads_q + h, rng_offset & 0xFFFFFFFF)  # the contract's Dropout section
    r = int(philox.philox4x32(counter, (seed & 0xFFFFFFFF, seed >> 32))[j % 4])
    for p, kept in ((r / 2**32, True), ((r + 1) / 2**32, False)):
        keep = dropout_keep(p, seed, rng_offset, b, np.array([h]), heads_q, i, i + 1, j, j + 1)
        assert keep.shape == (1, 1, 1) and bool(keep[0, 0, 0]) == kept


def test_dropout_tiles_agree_with_one_big_tile():
    whole = dropout_keep(0.4, 99, 3, 2, np.arange(6), 6, 0, 9, 0, 23)
    part = dropout_keep(0.4, 99, 3, 2, np.arange(2, 5), 6, 3, 8, 5, 18)
    np.testing.assert_array_equal(part, whole[5:18, 3:8, 2:5])
    assert 0.45 < whole.mean() < 0.75


# ---------------------------------------------------------------- cases


def arrays(rng, q_rows, k_rows, heads_q, heads_k, dim, dim_v, dtype):
    """Random normal q, k, v, do with leading row shapes q_rows, k_rows."""
    normal = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    return (normal(*q_rows, heads_q, dim), normal(*k_rows, heads_k, dim),
            normal(*k_rows, heads_k, dim_v), normal(*q_rows, heads_q, dim_v))


def padded(rng, batch, nq, nk, heads_q=2, heads_k=2, dim=16, dim_v=16, dtype=np.float32):
    return arrays(rng, (batch, nq), (batch, nk), heads_q, heads_k, dim, dim_v, dtype)


def case(name):
    """(q, k, v, do, keywords) of a named case; lengths are never tile multiples."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # the same inputs on every run
    if name == "plain":
        return (*padded(rng, 2, 37, 53), {})
    if name == "causal, Nq < Nk":
        return (*padded(rng, 2, 29, 70), dict(causal=True))
    if name == "causal, Nq > Nk":  # the first 41 rows have no key
        return (*padded(rng, 1, 70, 29), dict(causal=True))
    if name == "window":
        return (*padded(rng, 1, 50, 61), dict(window=(9, 5)))
    if name == "window, causal":
        return (*padded(rng, 1, 66, 45), dict(window=(13, -1), causal=True))
    if name == "mask":
        mask = rng.random((2, 1, 41, 50)) < 0.3
        mask[0, 0, 7] = False  # a row with no allowed key
        mask[1, 0, :, 30:] = True  # fully allowed tiles
        return (*padded(rng, 2, 41, 50), dict(mask=mask))
    if name == "block_mask":
        blocks = rng.random((1, 2, 6, 4)) < 0.5
        blocks[..., 0, :] = False  # rows 0:8 have no key
        return (*padded(rng, 1, 45, 60), dict(block_mask=flashx.BlockMask(blocks, (8, 16)), causal=True))
    if name == "seqlens":
        return (*padded(rng, 3, 40, 52),
                dict(seqlens_q=np.array([40, 3, 0]), seqlens_k=np.array([11, 52, 30]), causal=True))
    if name == "varlen":  # sequences: 13x20, 0x11, 27x0, 3x5; 4 rows of q and 2 of k past the end
        return (*arrays(rng, (47,), (38,), 4, 2, 16, 16, np.float32),
                dict(cu_seqlens_q=np.array([0, 13, 13, 40, 43], np.int32),
                     cu_seqlens_k=np.array([0, 20, 31, 31, 36], np.int32), causal=True))
    if name == "gqa 7:1":
        return (*padded(rng, 1, 33, 47, heads_q=14, heads_k=2), dict(causal=True))
    if name == "mqa":
        return (*padded(rng, 2, 35, 35, heads_q=4, heads_k=1), dict(window=(4, 4)))
    if name == "dv != d, scale":
        return (*padded(rng, 1, 30, 40, dim=16, dim_v=24), dict(softmax_scale=0.3))
    if name == "dropout":
        return (*padded(rng, 2, 38, 51, heads_q=4, heads_k=2), dict(dropout_p=0.3, seed=1234, rng_offset=5, causal=True))
    if name == "dropout, varlen":
        return (*arrays(rng, (30,), (40,), 2, 1, 16, 8, np.float32),
                dict(cu_seqlens_q=np.array([0, 9, 30], np.int32), cu_seqlens_k=np.array([0, 25, 40], np.int32),
                     dropout_p=0.6, seed=2**40 + 3, rng_offset=2**32 + 1))
    if name == "growing scores":  # later key tiles beat the running max by far: rescaling
        q, k, v, do = padded(rng, 1, 20, 90)
        return q * 3, k * np.linspace(0.2, 4, 90, dtype=np.float32)[None, :, None, None], v, do, {}
    raise KeyError(name)


CASES = ["plain", "causal, Nq < Nk", "causal, Nq > Nk", "window", "window, causal", "mask", "block_mask",
         "seqlens", "varlen", "gqa 7:1", "mqa", "dv != d, scale", "dropout", "dropout, varlen", "growing scores"]


def padding_rows(keywords, q_shape, k_shape):
    """Boolean row masks (over q rows, over k rows) of the padding, in the array layout."""
    if "cu_seqlens_q" in keywords:
        rows_q, rows_k = np.ones(q_shape[0], bool), np.ones(k_shape[0], bool)
        rows_q[: keywords["cu_seqlens_q"][-1]] = False
        rows_k[: keywords["cu_seqlens_k"][-1]] = False
        return rows_q, rows_k
    rows_q, rows_k = np.zeros(q_shape[:2], bool), np.zeros(k_shape[:2], bool)
    for b, n in enumerate(keywords.get("seqlens_q", [])):
        rows_q[b, n:] = True
    for b, n in enumerate(keywords.get("seqlens_k", [])):
        rows_k[b, n:] = True
    return rows_q, rows_k


def run(q, k, v, do, backend=SMALL, **keywords):
    o, res = flashx.attention_forward(q, k, v, backend=backend, **keywords)
    return (o, res.lse, *flashx.attention_backward(do, q, k, v, o, res, backend=backend, **keywords))


def check(results, expected, dtype):
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), results, expected):
        assert got.shape == want.shape, name
        assert got.dtype == (np.float64 if dtype == np.float64 else (np.float32 if name == "lse" else dtype)), name
        got = got.astype(np.float64)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=name)  # lse of empty rows
        assert np.isfinite(got[~np.isneginf(want)]).all(), f"{name}: NaN or inf where the reference is finite"
        finite = np.isfinite(want)
        error = np.linalg.norm(got[finite] - want[finite]) / max(np.linalg.norm(want[finite]), 1e-30)
        assert error <= RELATIVE_TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("name", CASES)
def test_feature_matches_the_oracle(name):
    q, k, v, do, keywords = case(name)
    rows_q, rows_k = padding_rows(keywords, q.shape, k.shape)
    expected = oracle.forward_backward(do, q, k, v, **keywords)
    # Padding holds poison: it must reach no output and no gradient.
    for x, rows in ((q, rows_q), (do, rows_q), (k, rows_k), (v, rows_k)):
        x[rows] = np.nan
    results = run(q, k, v, do, **keywords)
    check(results, expected, np.float32)
    o, lse, dq, dk, dv = results
    assert not np.any(o[rows_q]) and not np.any(dq[rows_q]) and not np.any(dk[rows_k]) and not np.any(dv[rows_k])
    empty = np.isneginf(expected[1])  # rows with no allowed key (padding included)
    heads_first = (lambda x: np.moveaxis(x, -2, 0)) if "cu_seqlens_q" in keywords else (lambda x: np.moveaxis(x, -2, 1))
    assert not np.any(heads_first(o)[empty]) and not np.any(heads_first(dq)[empty])


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("name", ["dropout", "varlen", "gqa 7:1"])
def test_dtypes(name, dtype):
    q, k, v, do, keywords = case(name)
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    check(run(q, k, v, do, **keywords), oracle.forward_backward(do, q, k, v, **keywords), dtype)


def test_bfloat16_through_torch():
    q, k, v, do = (torch.tensor(x).to(torch.bfloat16) for x in padded(np.random.default_rng(5), 2, 33, 41)[:4])
    q.requires_grad_(True)
    o = flashx.attention(q, k, v, causal=True, backend=SMALL)
    (dq,) = torch.autograd.grad(o, q, do)
    assert o.dtype == dq.dtype == torch.bfloat16
    want_o, _, want_dq, _, _ = oracle.forward_backward(*(x.detach().float().numpy() for x in (do, q, k, v)), causal=True)
    for got, want in ((o, want_o), (dq, want_dq)):
        assert np.linalg.norm(got.detach().double().numpy() - want) / np.linalg.norm(want) < 1e-2


def test_default_tiles():
    """The shipped tile sizes: several query and key tiles, GQA, causal."""
    rng = np.random.default_rng(7)
    q, k, v, do = padded(rng, 1, 700, 1100, heads_q=4, heads_k=2, dim=32, dim_v=32)
    check(run(q, k, v, do, backend="numpy", causal=True), oracle.forward_backward(do, q, k, v, causal=True), np.float32)


def test_nan_reaches_exactly_the_pairs_that_read_it():
    """Causal, Nq=30, Nk=40: query i sees keys j <= i + 10. Head 1: key 25 is NaN (seen by
    queries 15..29). Head 0: query 3 and its dO are NaN (it sees keys 0..13)."""
    q, k, v, do = padded(np.random.default_rng(3), 1, 30, 40)
    k[0, 25, 1] = v[0, 25, 1] = np.nan
    q[0, 3, 0] = do[0, 3, 0] = np.nan
    o, lse, dq, dk, dv = run(q, k, v, do, causal=True)
    sees_25 = np.arange(30) >= 15
    for x in (o, dq):
        assert np.isnan(x[0, sees_25, 1]).all() and np.isfinite(x[0, ~sees_25, 1]).all()
        assert np.isnan(x[0, 3, 0]).all() and np.isfinite(np.delete(x[0, :, 0], 3, axis=0)).all()
    assert np.isnan(lse[0, 1, sees_25]).all() and np.isfinite(lse[0, 1, ~sees_25]).all()
    for x in (dk, dv):
        assert np.isnan(x[0, :14, 0]).all() and np.isfinite(x[0, 14:, 0]).all()


def test_bitwise_deterministic():
    q, k, v, do, keywords = case("dropout")
    first, second = run(q, k, v, do, **keywords), run(q, k, v, do, **keywords)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_registered_through_the_entry_point():
    info = {b.name: b for b in flashx.backends()}["numpy"]
    assert info.available and info.plugin == "numpy"


@pytest.mark.parametrize("backend", [SMALL, "numpy"])
@pytest.mark.parametrize("nq, nk", [(33, 143), (143, 33), (5, 2)])
def test_one_key_per_row_is_exact(nq, nk, backend):
    """window (0, 0): every row reads at most one key, with P = 1, so o = v and dv = dO exactly;
    that needs the backward to recompute S bitwise as the forward did."""
    q, k, v, do = padded(np.random.default_rng(11), 2, nq, nk, dim=32, dim_v=32)
    o, lse, dq, dk, dv = run(q, k, v, do, window=(0, 0), backend=backend)
    rows, keys = np.arange(max(0, nq - nk), nq), np.arange(max(0, nk - nq), nk)  # the diagonal
    np.testing.assert_array_equal(o[:, rows], v[:, keys])
    np.testing.assert_array_equal(dv[:, keys], do[:, rows])


def test_blas_threads_are_restored_after_parallel_tiles():
    from threadpoolctl import threadpool_info

    from flashx_numpy.parallel import workers

    def blas_threads():
        return [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]

    if workers.count == 1:
        pytest.skip("tiles run in the caller's thread here: NumPy's BLAS has one thread")
    before = blas_threads()
    q, k, v, do = padded(np.random.default_rng(2), 2, 64, 64, heads_q=4)
    run(q, k, v, do)
    assert blas_threads() == before and max(before) > 1


@pytest.mark.parametrize("block_q, block_k", [(2, 3), (3, 5), (7, 13)])
@pytest.mark.parametrize("name", ["dropout", "block_mask", "varlen", "gqa 7:1"])
def test_odd_tile_sizes(name, block_q, block_k):
    """Tiles smaller than a GQA group, key tiles that split Philox's groups of four keys."""
    flashx.registry.register(NumpyBackend(block_q=block_q, block_k=block_k, name="numpy-odd-tiles"), replace=True)
    try:
        *inputs, keywords = case(name)
        q, k, v, do = (x.astype(np.float64) for x in inputs)
        check(run(q, k, v, do, backend="numpy-odd-tiles", **keywords), oracle.forward_backward(do, q, k, v, **keywords), np.float64)
    finally:
        flashx.registry.unregister("numpy-odd-tiles")


SCORE_MODS = {
    "softcap": lambda batch, heads: dict(softcap=1.5),
    "alibi per sequence": lambda batch, heads: dict(alibi_slopes=2.0 ** -np.arange(1.0, batch * heads + 1).reshape(batch, heads)),
    "sinks": lambda batch, heads: dict(sinks=np.linspace(-2.0, 3.0, heads)),
    "all three": lambda batch, heads: dict(softcap=3.0, alibi_slopes=np.linspace(0.05, 0.5, heads),
                                           sinks=np.linspace(4.0, -1.0, heads)),
}


@pytest.mark.parametrize("mods", list(SCORE_MODS))
@pytest.mark.parametrize("name", ["causal, Nq > Nk", "mask", "block_mask", "seqlens", "varlen", "gqa 7:1", "dropout",
                                  "growing scores"])
def test_score_modifications_across_tiles(name, mods):
    """softcap, ALiBi and sinks over 16 x 24 tiles, in float64: skipped, partial and full tiles, the
    running maximum moved by later tiles, rows without keys; dsinks summed over sequences."""
    *inputs, keywords = case(name)
    q, k, v, do = (x.astype(np.float64) for x in inputs)
    batch = len(keywords["cu_seqlens_q"]) - 1 if "cu_seqlens_q" in keywords else q.shape[0]
    keywords = {**keywords, **SCORE_MODS[mods](batch, q.shape[-2])}
    got, want = run(q, k, v, do, **keywords), oracle.forward_backward(do, q, k, v, **keywords)
    assert len(got) == len(want) == (6 if "sinks" in keywords else 5)
    for output, x, expected in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        finite = np.isfinite(expected)
        np.testing.assert_array_equal(x[~finite], expected[~finite], err_msg=output)  # -inf lse without sinks
        error = np.linalg.norm(x[finite] - expected[finite]) / max(np.linalg.norm(expected[finite]), 1e-30)
        assert error <= RELATIVE_TOLERANCE[np.float64], f"{output}: relative error {error:.2e}"


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_values_are_torchs(name):
    from flashx_numpy.fp8 import VALUES

    values = torch.arange(256, dtype=torch.uint8).view(getattr(torch, name)).float().numpy()
    np.testing.assert_array_equal(VALUES[name], values)  # NaN where NaN


def test_round_e4m3_is_torchs():
    """Round to nearest even, subnormals, saturation at ±448 (infinities too), NaN kept: random
    float32 bit patterns, every midpoint between e4m3 values and a float32 step either side of it."""
    from flashx_numpy.fp8 import VALUES, round_e4m3

    grid = np.unique(VALUES["float8_e4m3fn"][np.isfinite(VALUES["float8_e4m3fn"])]).astype(np.float64)
    midpoints = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    x = np.concatenate([
        np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        midpoints, np.nextafter(midpoints, np.float32(np.inf)), np.nextafter(midpoints, np.float32(-np.inf)),
        np.float32([464, -464, 480, 3e38, np.inf, -np.inf, np.nan, 0.0, -0.0, 2**-10, 3 * 2**-10, 2**-149]),
    ])
    # clamped first: torch's cast saturates only from 2.12 on (pytorch#178817), before it made NaN past 464
    want = torch.from_numpy(x).clamp(-448, 448).to(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(round_e4m3(x), want)


@pytest.mark.parametrize("block_q, block_k", [(16, 24), (5, 7)])
@pytest.mark.parametrize("context", ["plain-gqa", "causal-tall", "varlen-gqa", "sparse-mask"])
def test_fp8_across_tiles(context, block_q, block_k):
    """The conformance suite's FP8 cases over small tiles, where a row's maximum moves from tile to
    tile: the weight of each new maximum is 1 exactly, so the rule of plain attention in FP8 holds."""
    from flashx_conformance.harness import Target
    from flashx_conformance.test_fp8 import CONTEXTS

    flashx.registry.register(NumpyBackend(block_q=block_q, block_k=block_k, name="numpy-fp8-tiles"), replace=True)
    try:
        rng = np.random.default_rng(zlib.crc32(context.encode()))
        Target("numpy-fp8-tiles", "cpu", "full").check(CONTEXTS[context](rng, "float8_e4m3fn"))
    finally:
        flashx.registry.unregister("numpy-fp8-tiles")
