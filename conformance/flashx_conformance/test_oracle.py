"""The suite checks itself: the oracle against torch and finite differences, the Philox vectors,
the tolerance rule on planted errors, and the summary. These need no backend."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flashx_conformance import oracle, philox, summary
from flashx_conformance.harness import Case, conformance_failures, make_case, make_varlen_case
from flashx_conformance.tolerance import judge

torch = pytest.importorskip("torch")

RANDOM123 = [  # counter, key, output (Salmon et al. 2011, Random123 known-answer tests)
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
FLASHX_VECTORS = [  # seed, rng_offset, Hq, b, h, i, j, r (shared/reference/philox.md)
    (0x0, 0, 1, 0, 0, 0, 0, 0x6627E8D5),
    (0x2A, 0, 4, 1, 2, 3, 5, 0x19D98DC7),
    (0x1234567890ABCDEF, 7, 8, 0, 7, 100, 1023, 0x808F8A5C),
    (0x7FFFFFFFFFFFFFFF, 4294967299, 16, 3, 15, 4095, 4094, 0x9B3AEA65),
]


@pytest.mark.parametrize("counter, key, expected", RANDOM123)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox.philox4x32(counter, key)) == expected


@pytest.mark.parametrize("seed, offset, heads, b, h, i, j, r", FLASHX_VECTORS)
def test_dropout_words(seed, offset, heads, b, h, i, j, r):
    counter = (j // 4, i, b * heads + h, offset & 0xFFFFFFFF)
    assert int(philox.philox4x32(counter, (seed & 0xFFFFFFFF, seed >> 32))[j % 4]) == r


@pytest.mark.parametrize("seed, offset, heads, b, h, i, j, r", FLASHX_VECTORS[:3])
def test_keep_mask_vectors(seed, offset, heads, b, h, i, j, r):
    for p in (0.1, 0.5):
        keep = philox.keep_mask(seed, offset, p, b + 1, heads, i + 1, j + 1)[b, h, i, j]
        assert keep == (r >= int(p * 2**32)), (p, hex(r))


def _sdpa(q, k, v, do, mask):
    """torch's math SDPA in float64 on BSHD arrays: (o, dq, dk, dv)."""
    q_, k_, v_ = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=None if mask is None else torch.from_numpy(mask), enable_gqa=True)
    grads = torch.autograd.grad(o, (q_, k_, v_), torch.from_numpy(do).transpose(1, 2))
    return [x.transpose(1, 2).detach().numpy() for x in (o, *grads)]


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"mask": True}, {"window": (5, 2)}], ids=["full", "causal", "mask", "window"])
def test_oracle_matches_torch(options):
    rng = np.random.default_rng(1)
    case = make_case(rng, batch=2, seqlen_q=13, seqlen_k=21, heads_q=4, heads_k=2, head_dim=8, head_dim_v=6, dtype="float64")
    if options.get("mask"):
        options = {"mask": rng.random((2, 4, 13, 21)) < 0.8}
    x = case.inputs
    allowed = oracle.allowed(x["q"], x["k"], x["v"], **options)
    o, _, dq, dk, dv = oracle.forward_backward(x["do"], x["q"], x["k"], x["v"], **options)
    mask = allowed if options else None
    rows = allowed.any(axis=-1).swapaxes(1, 2)[..., None]  # torch gives NaN for empty rows
    expected = _sdpa(x["q"], x["k"], x["v"], np.where(rows, x["do"], 0), mask)
    for got, want in zip((o, dq, dk, dv), expected):
        assert np.allclose(np.where(np.isnan(want), 0, want), got, rtol=0, atol=1e-12)


GRADIENT_CASES = {
    "dropout-gqa": dict(heads_q=4, heads_k=2, dropout_p=0.3, seed=5, rng_offset=2, causal=True),
    "softcap": dict(softcap=2.0, softmax_scale=0.9),
    "alibi": dict(alibi_slopes=np.array([0.5, 0.25])),
    "window-seqlens": dict(window=(3, 1), seqlens_q=np.array([9, 4], np.int32), seqlens_k=np.array([6, 11], np.int32)),
}


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_oracle_gradients_are_derivatives(name):
    """<dq, dq_dir> + <dk, dk_dir> + <dv, dv_dir> equals the central difference of sum(o * do)."""
    options = dict(GRADIENT_CASES[name])
    shape = {key: options.pop(key) for key in ("heads_q", "heads_k") if key in options}
    case = make_case(np.random.default_rng(2), batch=2, seqlen_q=9, seqlen_k=11, head_dim=4, dtype="float64", **shape, **options)
    x, options = case.inputs, case.options
    grads = oracle.backward(x["do"], x["q"], x["k"], x["v"], **options)
    directions = [np.random.default_rng(3).standard_normal(x[n].shape) for n in ("q", "k", "v")]
    step = 1e-6

    def loss(sign):
        moved = [x[n] + sign * step * d for n, d in zip(("q", "k", "v"), directions)]
        return (oracle.forward(*moved, **options)[0] * x["do"]).sum()

    numeric = (loss(1) - loss(-1)) / (2 * step)
    analytic = sum((g * d).sum() for g, d in zip(grads, directions))
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (numeric, analytic)


def test_varlen_is_per_sequence_attention():
    lengths_q, lengths_k = [3, 0, 7], [5, 2, 0]
    case = make_varlen_case(np.random.default_rng(4), lengths_q=lengths_q, lengths_k=lengths_k, spare_rows=2, head_dim=8, dtype="float64", causal=True)
    x = case.inputs
    o, lse, dq, dk, dv = oracle.forward_backward(x["do"], x["q"], x["k"], x["v"], **case.options)
    cu_q, cu_k = case.options["cu_seqlens_q"], case.options["cu_seqlens_k"]
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = oracle.forward_backward(*(x[n][rows if n in ("q", "do") else keys][None] for n in ("do", "q", "k", "v")), causal=True)
        for got, want in zip((o[rows], lse[:, rows], dq[rows], dk[keys], dv[keys]), one):
            # equal up to the last bits: BLAS may block a (B, H, N, N) product unlike a (1, H, n, n) one
            np.testing.assert_allclose(got, want[0], rtol=1e-14, atol=1e-14)
    assert (o[-2:] == 0).all() and (lse[:, -2:] == -np.inf).all() and (dk[-2:] == 0).all()


def test_padding_poison_does_not_reach_the_oracle():
    clean = make_case(np.random.default_rng(5), batch=2, seqlen_q=12, seqlen_k=10, dtype="float64", causal=True,
                      seqlens_q=np.array([12, 5], np.int32), seqlens_k=np.array([3, 10], np.int32))
    case = clean
    for name, lengths in (("q", [12, 5]), ("do", [12, 5]), ("k", [3, 10]), ("v", [3, 10])):
        n = case.inputs[name].shape[1]
        case = case.with_poison(name, (np.arange(n)[None, :] >= np.array(lengths)[:, None])[:, :, None, None])
    got = oracle.forward_backward(*(case.rounded()[n] for n in ("do", "q", "k", "v")), **case.options)
    want = oracle.forward_backward(*(clean.rounded()[n] for n in ("do", "q", "k", "v")), **clean.options)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


def test_nan_reaches_exactly_the_rows_that_read_it():
    case = make_case(np.random.default_rng(6), batch=1, seqlen_q=6, heads_q=1, head_dim=4, dtype="float64", causal=True)
    where = np.zeros(case.inputs["v"].shape, bool)
    where[0, 3, 0, 1] = True  # v of key 3, read by rows 3, 4, 5
    x = case.with_poison("v", where).rounded()
    o, lse, dq, dk, dv = oracle.forward_backward(x["do"], x["q"], x["k"], x["v"], causal=True)
    rows = [False, False, False, True, True, True]
    assert np.isnan(o[0, :, 0, 1]).tolist() == rows and not np.isnan(o[0, :, 0, 0]).any()  # only column 1 of v
    assert np.isnan(dq[0, :, 0, :]).any(axis=-1).tolist() == rows  # dS of rows 3-5 (delta is NaN)
    assert np.isnan(dk[0, :, 0, :]).all(axis=-1).all()  # every key is read by row 5
    assert not np.isnan(dv).any() and not np.isnan(lse).any()


@pytest.mark.parametrize("backward", ["autograd", "rowsum"])
def test_naive_in_float64_is_the_oracle(backward):
    case = make_case(np.random.default_rng(7), heads_q=4, heads_k=2, seqlen_q=11, seqlen_k=14, dtype="float64", causal=True,
                     dropout_p=0.2, seed=3, softcap=3.0)
    x = case.inputs
    args = [x[n] for n in ("do", "q", "k", "v")]
    for got, want in zip(oracle.naive(*args, "float64", backward=backward, **case.options), oracle.forward_backward(*args, **case.options)):
        assert np.allclose(got, want, rtol=0, atol=1e-12)


def test_rule_catches_one_wrong_element_and_says_where():
    case = make_case(np.random.default_rng(8), batch=2, seqlen_q=9, seqlen_k=12, dtype="float16")
    x = case.rounded()
    exact = oracle.forward_backward(*(x[n] for n in ("do", "q", "k", "v")))
    good = {name: np.asarray(torch.from_numpy(value).half().double()) for name, value in zip(("o", "lse", "dq", "dk", "dv"), exact)}
    good["lse"] = exact[1].astype(np.float32).astype(np.float64)
    assert conformance_failures(case, good) == []
    bad = {**good, "dk": good["dk"].copy()}
    bad["dk"][1, 7, 0, 3] += 0.05
    (failure,) = conformance_failures(case, bad)
    assert failure.startswith("dk: max |error|") and "(b=1, j=7, h=0, d=3)" in failure


def test_rule_requires_nan_where_the_oracle_has_it():
    expected = np.array([1.0, np.nan, -np.inf])
    assert judge("o", np.array([1.0, 0.0, -np.inf]), expected, [expected], np.ones(3), "float32", "i") is not None
    assert judge("o", np.array([1.0, np.nan, -np.inf]), expected, [expected], np.ones(3), "float32", "i") is None


def test_summary_merges_reports(tmp_path):
    def report(name, outcomes):
        results = [{"nodeid": f"x::{case}", "case": case, "outcome": o, "reason": r, "duration": 0.5} for case, (o, r) in outcomes.items()]
        return {"backend": name, "version": "1", "device": "cpu", "tier": "small", "results": results}

    paths = []
    for name, outcomes in (("a", {"t1": ("passed", None), "t2": ("skipped", "no fp64")}), ("b", {"t1": ("failed", None)})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(report(name, outcomes)))
        paths.append(str(path))
    assert summary.main([*paths, "--markdown", str(tmp_path / "s.md"), "--json", str(tmp_path / "s.json")]) == 1
    text = (tmp_path / "s.md").read_text()
    assert "| `t1` | pass | FAIL |" in text and "| `t2` | skip [1] | - |" in text and "1. no fp64" in text
    assert json.loads((tmp_path / "s.json").read_text())["cases"]["t2"]["a"]["reason"] == "no fp64"


def test_summary_joins_the_parts_of_one_backends_run(tmp_path):
    paths = []
    for part, case in (("fast", "t1"), ("slow", "t2")):
        results = [{"nodeid": f"x::{case}", "case": case, "outcome": "passed", "reason": None, "duration": 1.5}]
        path = tmp_path / f"{part}.json"
        path.write_text(json.dumps({"backend": "a", "version": "1", "device": "cuda", "tier": "full", "results": results}))
        paths.append(str(path))
    assert summary.main([*paths, "--markdown", str(tmp_path / "s.md")]) == 0
    text = (tmp_path / "s.md").read_text()
    assert "| a | 1 | cuda | full | 2 | 0 | 0 | 3.0 |" in text
    assert "| `t1` | pass |" in text and "| `t2` | pass |" in text


def test_case_poison_is_in_the_description():
    case = Case({"q": np.ones((1, 2, 1, 4))}, "float32").with_poison("q", np.array([True, False])[None, :, None, None])
    assert "q: 4 elements set to nan" in case.describe()
