"""The contract's Dropout section: the keep mask is bit-exact Philox4x32-10, the same in every backend.

The mask is read back exactly: with v[j] = e_j (one-hot rows, Dv = Nk) the output is
o[i, j] = P[i, j] Z[i, j] / (1 - p), and P > 0 on every allowed pair, so Z = (o != 0).
"""

from __future__ import annotations

import numpy as np
import pytest

import flashx
from flashx_conformance import oracle
from flashx_conformance.harness import Case, full_only, make_case, make_varlen_case

SEED = 0x1234567890ABCDEF
OFFSET = 2**32 + 7  # only the low 32 bits enter the counter


def one_hot_values(case: Case) -> Case:
    """The case with v[..., j, h, :] = e_j (j within its sequence), so that o reveals the keep mask."""
    v = case.inputs["v"]
    if case.varlen:
        cu = case.options["cu_seqlens_k"]
        position = np.zeros(v.shape[0], dtype=int)
        for start, end in zip(cu[:-1], cu[1:]):
            position[start:end] = np.arange(end - start)
        one_hot = np.eye(v.shape[-1])[position][:, None, :]
    else:
        one_hot = np.eye(v.shape[-1])[: v.shape[1]][None, :, None, :]
    return Case({**case.inputs, "v": np.broadcast_to(one_hot, v.shape).copy()}, case.dtype, case.options)


def keep_masks(target, case: Case):
    """(the backend's keep mask read from o, the oracle's), both in o's layout with j last."""
    case = one_hot_values(case)
    o = target.numpy(target.call(case)[0])
    rounded = case.rounded()
    inputs = (rounded["q"], rounded["k"], rounded["v"])
    expected = oracle.keep_mask(*inputs, **case.options) & oracle.allowed(*inputs, **case.options)
    expected = expected.swapaxes(1, 2)  # (B, Nq, Hq, Nk) like o
    if case.varlen:
        cu = case.options["cu_seqlens_q"]
        expected = np.concatenate([expected[b, : end - start] for b, (start, end) in enumerate(zip(cu[:-1], cu[1:]))])
    return o != 0, expected[..., : o.shape[-1]]


def assert_same_mask(got, expected, case):
    differ = got != expected
    if differ.any():
        first = tuple(int(i) for i in np.argwhere(differ)[0])
        raise AssertionError(
            f"{case.describe()}\nkeep mask differs from the oracle's Philox at {int(differ.sum())} of {differ.size} "
            f"(row, head, key) positions; first at {first}: backend {'keeps' if got[first] else 'drops'}, oracle {'keeps' if expected[first] else 'drops'}"
        )


def _dropout_cases(rng, dtype):
    return {
        "padded-p0.17": make_case(rng, batch=2, heads_q=3, seqlen_q=33, seqlen_k=64, dtype=dtype, dropout_p=0.17, seed=SEED, rng_offset=OFFSET),
        "padded-p0.5": make_case(rng, batch=2, heads_q=3, seqlen_q=33, seqlen_k=64, dtype=dtype, dropout_p=0.5, seed=2**64 - 1, rng_offset=0),
        "gqa-seqlens-p0.25": make_case(
            rng, batch=3, heads_q=4, heads_k=2, seqlen_q=21, seqlen_k=64, dtype=dtype, dropout_p=0.25, seed=42, rng_offset=3,
            seqlens_k=np.array([64, 17, 40], np.int32),
        ),
        "offsets-p0.3": make_case(
            rng, batch=2, heads_q=4, heads_k=2, seqlen_q=33, seqlen_k=64, dtype=dtype, dropout_p=0.3, seed=SEED,
            rng_offset=OFFSET, causal=True, dropout_offsets=(4097, 1022),
        ),
        "varlen-p0.3": make_varlen_case(
            rng, lengths_q=[9, 0, 30], lengths_k=[64, 5, 33], heads_q=2, dtype=dtype, dropout_p=0.3, seed=SEED >> 3, rng_offset=11
        ),
    }


@pytest.mark.parametrize("name", list(_dropout_cases(np.random.default_rng(0), "float32")))
def test_dropout_matches_oracle(flashx_target, flashx_rng, name):
    """Forward and backward with dropout agree with the oracle, and the keep mask is bit-exact."""
    case = _dropout_cases(flashx_rng, flashx_target.dtype)[name]
    flashx_target.check(case)
    assert_same_mask(*keep_masks(flashx_target, case), case)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=full_only)])
def test_dropout_wide_key_tiles(flashx_target, flashx_rng, head_dim, causal, dtype):
    """Forward and backward with dropout in 16 bits (where GPU kernels take tensor cores and their
    widest tiles) over more keys than any backend's key tile holds (400 against tiles of up to
    176), so that every column of a wide tile draws its own keep bits, and a tile ends inside the
    sequence."""
    case = make_case(flashx_rng, batch=1, heads_q=1, seqlen_q=136, seqlen_k=400, head_dim=head_dim, dtype=dtype,
                     dropout_p=0.3, seed=SEED, rng_offset=OFFSET, causal=causal)
    flashx_target.check(case)


@full_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_after_a_call_without_it(flashx_target, flashx_rng, head_dim, causal):
    """A shape first called without dropout, then with it: a backend that keeps choices by shape
    (tiles, launches) must not carry one made without dropout's draws to a call that makes them.
    2048 keys, where GPU backends take their widest tiles."""
    case = make_case(flashx_rng, batch=1, heads_q=1, seqlen_q=2048, seqlen_k=2048, head_dim=head_dim,
                     dtype=flashx_target.dtype, causal=causal)
    flashx_target.check(case)
    flashx_target.check(Case(case.inputs, case.dtype, {**case.options, "dropout_p": 0.1, "seed": SEED}))


@pytest.mark.parametrize("seqlen_q", [64, pytest.param(512, marks=full_only)])
@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_dropout_keep_fraction(flashx_target, flashx_rng, seqlen_q, dropout_p):
    """The kept fraction of a large tile is within 0.01 of 1 - p (3.6 standard deviations at 32768 draws)."""
    case = make_case(flashx_rng, batch=1, heads_q=4, seqlen_q=seqlen_q, seqlen_k=128, head_dim=128, dtype=flashx_target.dtype,
                     dropout_p=dropout_p, seed=7, rng_offset=0)
    got, expected = keep_masks(flashx_target, case)
    assert abs(got.mean() - (1 - dropout_p)) <= 0.01, f"kept {got.mean():.4f}, expected {1 - dropout_p} +- 0.01"
    assert_same_mask(got, expected, case)


def test_dropout_rng_offset(flashx_target, flashx_rng):
    """Another rng_offset draws another mask; the same (seed, offset) the same bits; seed=None is recorded in res."""
    base = make_case(flashx_rng, batch=1, heads_q=2, seqlen_q=40, seqlen_k=64, dtype=flashx_target.dtype, dropout_p=0.4, seed=99)
    masks = {}
    for offset in (0, 1, 2**32):
        case = Case(base.inputs, base.dtype, {**base.options, "rng_offset": offset})
        got, expected = keep_masks(flashx_target, case)
        assert_same_mask(got, expected, case)
        masks[offset] = got
    differ = (masks[0] != masks[1]).mean()
    assert differ > 0.3, f"rng_offset 0 and 1 drew masks differing at only {differ:.1%} of positions"
    assert (masks[0] == masks[2**32]).all(), "rng_offset enters the counter modulo 2**32"

    unseeded = Case(base.inputs, base.dtype, {**base.options, "seed": None})
    o, res, *_ = flashx_target.call(unseeded)
    assert isinstance(res.seed, int) and 0 <= res.seed < 2**64, f"res.seed: {res.seed!r}"
    replay = flashx_target.call(Case(base.inputs, base.dtype, {**base.options, "seed": res.seed}))[0]
    assert np.array_equal(flashx_target.numpy(o), flashx_target.numpy(replay)), "the drawn seed does not replay the forward"
    again = flashx_target.call(unseeded)[1]
    assert again.seed != res.seed, "seed=None drew the same seed twice"
    assert flashx.Residuals is type(res)


@pytest.mark.parametrize("name", ["v", "do"])
def test_dropped_pairs_contribute_nothing(flashx_target, flashx_rng, name):
    """NaN in one key's v (or one row's do) reaches o (or dv) only through pairs dropout kept: a
    dropped pair contributes exactly 0, as a disallowed one does, never 0 * NaN."""
    case = make_case(flashx_rng, batch=1, heads_q=2, seqlen_q=24, seqlen_k=40, head_dim=16, dtype=flashx_target.dtype,
                     dropout_p=0.5, seed=SEED, rng_offset=OFFSET)
    where = np.zeros(case.inputs[name].shape, dtype=bool)
    where[0, 5, 1, 3] = True
    got = flashx_target.check(case.with_poison(name, where))
    reached = got["o"] if name == "v" else got["dv"]
    assert np.isnan(reached).any() and np.isfinite(reached).any(), "the case tests nothing: the NaN reached all or none"


@pytest.mark.parametrize("seed", [16, 18, 28, 48, 50, 0, 14, 37, 138, 183, 225, 275, 291])
def test_dropout_leaves_tiny_outputs(flashx_target, seed):
    """float16, one row of two keys whose scores lie about 24 apart: where dropout drops the
    dominant key, the row's output is its other key's weight (1e-11 to 1e-7) times v, below
    float16's normal range and often below its subnormals (hypothesis found this shape).

    Such an output has no relative precision in float16 storage, so the tolerance's relative-norm
    bound does not apply below float16's smallest normal number (tolerance.py); the max-error bound
    still does. And o, stored on float16's subnormal grid (spacing 2**-24), is read back by the
    backward for delta = dot(o, do): its rounding, absolute rather than relative, moves dS = P (dP -
    delta) of the dominant key, and so dq and dk, by as much as their own size (a kernel that
    multiplies dS as a float16 operand rounds it, subnormal too, once more). The tolerance takes
    such roundings as a term of their own (``oracle.subnormal_magnitudes``). Seeds 16-50 failed the
    relative-norm bound on o; 0-291 failed dq and dk without that term, on numpy (37, 138, 183,
    225, 275, 291) and under the Triton interpreter (0, 14, 37, 138).
    """
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=1, seqlen_q=1, seqlen_k=2, heads_q=1, head_dim=40, dtype="float16",
                     softmax_scale=-2.0, dropout_p=0.5, seed=seed)
    flashx_target.check(case)
