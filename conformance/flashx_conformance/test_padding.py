"""NaN safety (the contract's "Scores and masking"): empty rows, poisoned padding, NaN propagation, extreme values.

Garbage (NaN, +-inf) written where no allowed pair reads -- past seqlens, past the last
cu_seqlens row, outside every window, at masked rows and keys -- must change no output;
a NaN that an allowed pair reads must reach exactly the outputs that read it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import flashx
from flashx_conformance.harness import DTYPES, OUTPUTS, conformance_failures, diagonal, full_only, make_case, make_varlen_case

EVERY_FOURTH = np.arange(40)[:, None] % 4 != 0


def _empty_row_cases(rng, dtype):
    blocks = np.ones((1, 1, 3, 2), dtype=bool)
    blocks[0, 0, 1, :] = False
    return {
        "causal-nq-gt-nk": make_case(rng, seqlen_q=17, seqlen_k=5, dtype=dtype, causal=True),
        "every-fourth-row": make_case(rng, seqlen_q=40, seqlen_k=29, dtype=dtype, mask=np.broadcast_to(EVERY_FOURTH, (40, 29))),
        "window-off-grid": make_case(rng, seqlen_q=40, seqlen_k=10, dtype=dtype, window=(0, 0)),
        "zero-seqlens": make_case(
            rng, seqlen_q=23, seqlen_k=31, dtype=dtype, seqlens_q=np.array([0, 5], np.int32), seqlens_k=np.array([7, 0], np.int32)
        ),
        "block-row": make_case(rng, seqlen_q=40, seqlen_k=29, dtype=dtype, block_mask=flashx.BlockMask(blocks, (16, 16))),
        "all-masked": make_case(rng, seqlen_q=19, seqlen_k=21, dtype=dtype, mask=np.zeros((19, 21), dtype=bool)),
    }


@pytest.mark.parametrize("name", list(_empty_row_cases(np.random.default_rng(0), "float32")))
def test_empty_rows(flashx_target, flashx_rng, name):
    """A row with no allowed key: o = 0, lse = -inf, dq = 0 exactly, and no NaN anywhere."""
    case = _empty_row_cases(flashx_rng, flashx_target.dtype)[name]
    got = flashx_target.check(case)
    assert not any(np.isnan(got[n]).any() for n in OUTPUTS), "NaN produced by masking"
    assert np.isneginf(got["lse"]).any(), "the case has no empty row: it tests nothing"


def _rows(lengths, n):
    """(B, n, 1, 1): True at rows i >= lengths[b]."""
    return (np.arange(n)[None, :] >= np.asarray(lengths)[:, None])[:, :, None, None]


def _poisoned_cases(rng, dtype, value):
    cases = {}
    lengths_q, lengths_k = [64, 20, 0], [30, 64, 5]
    case = make_case(
        rng, batch=3, seqlen_q=64, dtype=dtype, seqlens_q=np.array(lengths_q, np.int32), seqlens_k=np.array(lengths_k, np.int32)
    )
    for name, lengths in (("q", lengths_q), ("do", lengths_q), ("k", lengths_k), ("v", lengths_k)):
        case = case.with_poison(name, _rows(lengths, 64), value)
    cases["past-seqlens"] = case

    case = make_varlen_case(rng, lengths_q=[5, 0, 17], lengths_k=[7, 3, 0], spare_rows=4, heads_q=2, dtype=dtype, causal=True)
    for name in ("q", "k", "v", "do"):
        rows = case.inputs[name].shape[0]
        case = case.with_poison(name, (np.arange(rows) >= rows - 4)[:, None, None], value)
    cases["past-cu-seqlens"] = case

    case = make_case(rng, seqlen_q=16, seqlen_k=80, dtype=dtype, window=(4, 0))
    unread = (np.arange(80) < 80 - 16 - 4)[None, :, None, None]
    cases["outside-window"] = case.with_poison("k", unread, value).with_poison("v", unread, value)

    mask = rng.random((37, 53)) < 0.7
    mask[:, [3, 7, 52]] = False
    mask[[2, 5], :] = False
    case = make_case(rng, seqlen_q=37, seqlen_k=53, dtype=dtype, mask=mask)
    keys, rows = (~mask.any(axis=0))[None, :, None, None], (~mask.any(axis=1))[None, :, None, None]
    cases["masked"] = case.with_poison("k", keys, value).with_poison("v", keys, value).with_poison("q", rows, value).with_poison("do", rows, value)

    blocks = np.ones((2, 3), dtype=bool)
    blocks[:, 1] = False
    case = make_case(rng, seqlen_q=30, seqlen_k=40, dtype=dtype, block_mask=flashx.BlockMask(blocks, (16, 16)))
    keys = ((np.arange(40) >= 16) & (np.arange(40) < 32))[None, :, None, None]
    cases["block-masked"] = case.with_poison("k", keys, value).with_poison("v", keys, value)

    case = make_case(rng, seqlen_q=30, seqlen_k=12, dtype=dtype, causal=True)
    rows = (np.arange(30) < 30 - 12)[None, :, None, None]
    cases["causal-empty-rows"] = case.with_poison("q", rows, value).with_poison("do", rows, value)
    return cases


@pytest.mark.parametrize("where, value", diagonal(list(_poisoned_cases(np.random.default_rng(0), "float32", math.nan)), [math.nan, math.inf, -math.inf]), ids=str)
def test_padding_poison(flashx_target, flashx_rng, where, value):
    case = _poisoned_cases(flashx_rng, flashx_target.dtype, value)[where]
    got = flashx_target.check(case)
    assert not any(np.isnan(got[n]).any() for n in OUTPUTS), "poison leaked into an output"


NAN_AT = {"q": (1, 20, 3, 5), "k": (1, 20, 1, 5), "v": (1, 20, 1, 5), "do": (1, 20, 3, 5)}


@pytest.mark.parametrize("name, dtype", [(name, "target") for name in NAN_AT]
                         + diagonal(list(NAN_AT), ["float16", "bfloat16"]), ids=str)
def test_nan_propagation(flashx_target, flashx_rng, name, dtype):
    """One NaN in an attended input: NaN in exactly the outputs that read it (causal, GQA), nowhere
    else. In 16 bits, with more keys than queries: masked tiles then span the band edge, and rows
    and keys that may not read the NaN share its products."""
    seqlen_k, dtype = (45, flashx_target.dtype) if dtype == "target" else (77, dtype)
    case = make_case(flashx_rng, seqlen_q=45, seqlen_k=seqlen_k, heads_q=4, heads_k=2, head_dim=32, dtype=dtype,
                     causal=True)
    where = np.zeros(case.inputs[name].shape, dtype=bool)
    where[NAN_AT[name]] = True
    got = flashx_target.check(case.with_poison(name, where))
    nan_outputs = [n for n in OUTPUTS if np.isnan(got[n]).any()]
    finite_outputs = [n for n in OUTPUTS if (np.isfinite(got[n]) | np.isneginf(got[n])).any()]
    assert nan_outputs and finite_outputs, f"NaN in {nan_outputs}, finite values in {finite_outputs}: the case tests nothing"


# An infinite entry that makes every allowed score of one row -inf: (tensor, index, value, options). The
# entry's column of the other operand is made of one sign (positive for a -inf entry, negative for +inf),
# so that each of the row's scores is -inf and none NaN.
MINUS_INF_ROWS = {
    "q -inf, causal": ("q", (1, 20, 3, 5), -math.inf, {"causal": True}),
    "q +inf, causal": ("q", (0, 33, 1, 9), math.inf, {"causal": True}),
    "k -inf, one key a row": ("k", (1, 20, 1, 5), -math.inf, {"window": (0, 0)}),
}


@pytest.mark.parametrize("name, dtype", diagonal(list(MINUS_INF_ROWS), ["target", "float16", "bfloat16"]), ids=str)
def test_rows_of_minus_inf_scores(flashx_target, flashx_rng, name, dtype):
    """A row whose allowed scores are all -inf has no weight to give: o = 0 and lse = -inf, as an
    empty row, and no gradient flows through its P (recomputed as exp(S - lse) it would be
    exp(-inf + inf) = NaN). Its pairs are allowed all the same: the infinite entry reaches the
    gradients through dS = 0 as plain arithmetic carries it (0 * inf = NaN), and nowhere else."""
    tensor, index, value, options = MINUS_INF_ROWS[name]
    seqlen_k, dtype = (45, flashx_target.dtype) if dtype == "target" else (77, dtype)
    if "window" in options:
        seqlen_k = 45  # one key a row: the diagonal's
    case = make_case(flashx_rng, seqlen_q=45, seqlen_k=seqlen_k, heads_q=4, heads_k=2, head_dim=32, dtype=dtype,
                     **options)
    batch, row, head, column = index
    other = "k" if tensor == "q" else "q"
    one_sign = np.abs(case.inputs[other][batch, :, :, column]) + 0.25
    case.inputs[other][batch, :, :, column] = one_sign if value < 0 else -one_sign
    where = np.zeros(case.inputs[tensor].shape, dtype=bool)
    where[index] = True
    got = flashx_target.check(case.with_poison(tensor, where, value))
    head_q = head if tensor == "q" else head * 2  # a query head of kv head ``head`` (group 2)
    assert got["lse"][batch, head_q, row] == -math.inf and (got["o"][batch, row, head_q] == 0).all(), (
        "the row's scores are not all -inf: the case tests nothing")


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_magnitudes(flashx_target, flashx_rng, dtype):
    """Scores near 1e4 that still differ by O(1): the row max must be subtracted before exp.

    Half of each head dim holds 50 in q and k (a common offset of 1e4 in every score), the
    other half normal noise. The scores then carry an absolute rounding error near
    |S| * eps of the accumulation (1e-3 in float32) in every implementation, naive included,
    so the max-error rule applies but the contract's relative-norm bounds, met by no kernel here, do not.
    """
    case = make_case(flashx_rng, seqlen_q=77, seqlen_k=99, head_dim=64, dtype=dtype, causal=True)
    for name in ("q", "k"):
        case.inputs[name][..., :32] = 50.0
    flashx_target.check(case, relative_norm=False)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_large_magnitudes_constant(flashx_target, flashx_rng, dtype):
    """q = k = 256: q.k = 2**22 overflows 16-bit types, so it must be accumulated in float32.

    The scale puts every score at 1e4: all equal, so o is mean(v). The gradients go through
    P = exp(S - lse) with lse in float32 (the contract's Numerics section), whose rounding at 1e4 no kernel avoids
    while naive autograd never meets it: they are held to finiteness only.
    """
    case = make_case(flashx_rng, seqlen_q=33, seqlen_k=70, head_dim=64, dtype=dtype, softmax_scale=1e4 / 2**22)
    case.inputs["q"][:] = 256.0
    case.inputs["k"][:] = 256.0
    got = flashx_target.outputs(case)
    failures = [f for f in conformance_failures(case, got) if f.startswith(("o:", "lse:"))]
    assert not failures, case.describe() + "\n" + "\n".join(failures)
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(got[name]).all(), f"{name}: not finite at {np.argwhere(~np.isfinite(got[name]))[:3].tolist()}"


@pytest.mark.parametrize("scale", [0.0, -0.3, 2.0, 1e-3], ids=lambda s: f"scale={s}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("seqlens", [(57, 83), pytest.param((257, 390), marks=full_only)], ids=str)
def test_scale(flashx_target, flashx_rng, seqlens, dtype, scale):
    """softmax_scale is used as given: 0 (uniform weights, dq = dk = 0), negative, sharp, flat.
    Causal rows and padded keys put masked pairs beside the allowed ones, where a kernel that
    scales a masked -inf by the scale would make 0 * inf = NaN; the longer sequences give the
    kernels' tiles that need no pair test too."""
    seqlen_q, seqlen_k = seqlens
    case = make_case(flashx_rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=32, dtype=dtype, causal=True,
                     softmax_scale=scale)
    flashx_target.check(case)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape, scale",
    diagonal([(1, 64, 128), (2, 97, 64), (1, 48, 80)], [-1.0, -0.25, -4.0])
    + [pytest.param((1, 256, 256), -1.0, marks=full_only)],
    ids=str,
)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_negative_scale_wide_scores(flashx_target, flashx_rng, dtype, shape, scale, causal):
    """A negative softmax_scale over scores hundreds apart: a row's maximum is that of
    scale * q k^T, the smallest q k^T, and exp of the spread from the wrong end overflows.

    |lse| reaches 400 at scale -1 and 1500 at -4: a backward rebuilds P from the float32 lse,
    whose rounding there is a relative error of P past 1e-5 (the contract's Numerics section)."""
    batch, seqlen_q, seqlen_k = shape
    case = make_case(flashx_rng, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=32, dtype=dtype,
                     causal=causal, softmax_scale=scale)
    for name in ("q", "k"):
        case.inputs[name] *= 4.0  # q.k spread near +-300
    flashx_target.check(case)
