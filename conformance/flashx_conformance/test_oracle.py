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
    # a copy: the mask is oracle.allowed's read-only broadcast view, and a torch tensor is always writable
    o = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=None if mask is None else torch.tensor(mask), enable_gqa=True)
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
    "sinks-gqa": dict(heads_q=4, heads_k=2, causal=True, sinks=np.array([0.5, -1.0, 2.0, -30.0])),
    # rows with no key (window (0, 0) past Nk, seqlens 0) hold the sink alone and add nothing to dsinks
    "sinks-empty-rows": dict(window=(0, 0), seqlens_q=np.array([9, 4], np.int32), seqlens_k=np.array([6, 0], np.int32),
                             sinks=np.array([1.5, -0.5])),
    "all-three-dropout": dict(softcap=1.5, alibi_slopes=np.array([[0.5, 0.25], [0.125, 1.0]]), sinks=np.array([0.3, 1.2]),
                              dropout_p=0.3, seed=5, causal=True),
}


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_oracle_gradients_are_derivatives(name):
    """<dq, dq_dir> + <dk, dk_dir> + <dv, dv_dir> (+ <dsinks, dsinks_dir>) equals the central
    difference of sum(o * do)."""
    options = dict(GRADIENT_CASES[name])
    shape = {key: options.pop(key) for key in ("heads_q", "heads_k") if key in options}
    case = make_case(np.random.default_rng(2), batch=2, seqlen_q=9, seqlen_k=11, head_dim=4, dtype="float64", **shape, **options)
    x, options = case.inputs, case.options
    grads = oracle.backward(x["do"], x["q"], x["k"], x["v"], **options)
    moving = ("q", "k", "v") + (("sinks",) if "sinks" in options else ())
    point = {**x, **options}
    directions = [np.random.default_rng(3).standard_normal(np.shape(point[n])) for n in moving]
    step = 1e-6

    def loss(sign):
        moved = {n: point[n] + sign * step * d for n, d in zip(moving, directions)}
        return (oracle.forward(moved.pop("q"), moved.pop("k"), moved.pop("v"), **{**options, **moved})[0] * x["do"]).sum()

    numeric = (loss(1) - loss(-1)) / (2 * step)
    analytic = sum((g * d).sum() for g, d in zip(grads, directions))
    assert len(grads) == len(moving)
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (numeric, analytic)


def test_a_sink_is_a_key_whose_value_is_zero():
    """o and lse with sinks equal attention without them over one more key, whose score is the
    head's sink and whose value is 0: an independent reading of the sink's column."""
    rng = np.random.default_rng(9)
    batch, seqlen_q, seqlen_k, heads, dim, scale = 2, 7, 10, 3, 4, 0.5
    sinks = np.array([0.7, -2.0, 3.0])
    case = make_case(rng, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads, head_dim=dim, dtype="float64")
    q, k, v = (case.inputs[n] for n in ("q", "k", "v"))
    mask = rng.random((batch, heads, seqlen_q, seqlen_k)) < 0.6
    mask[0, 1, 2] = False  # a row with the sink alone
    o, lse = oracle.forward(q, k, v, softmax_scale=scale, mask=mask, sinks=sinks)
    # one more head dim: 1 in every query, sink / scale in the extra key, 0 in the real keys
    q_more = np.concatenate([q, np.ones((batch, seqlen_q, heads, 1))], axis=-1)
    sink_key = np.zeros((batch, 1, heads, dim + 1))
    sink_key[..., -1] = sinks / scale
    k_more = np.concatenate([np.concatenate([k, np.zeros((batch, seqlen_k, heads, 1))], axis=-1), sink_key], axis=1)
    v_more = np.concatenate([v, np.zeros((batch, 1, heads, dim))], axis=1)
    mask_more = np.concatenate([mask, np.ones((batch, heads, seqlen_q, 1), bool)], axis=-1)
    want_o, want_lse = oracle.forward(q_more, k_more, v_more, softmax_scale=scale, mask=mask_more)
    np.testing.assert_allclose(o, want_o, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-13)
    assert lse[0, 1, 2] == sinks[1] and (o[0, 2, 1] == 0).all()


def test_a_sink_of_minus_inf_is_no_sink():
    case = make_case(np.random.default_rng(10), heads_q=2, seqlen_q=6, seqlen_k=9, head_dim=4, dtype="float64", causal=True,
                     window=(2, 0), softcap=2.0)
    x = case.inputs
    args = [x[n] for n in ("do", "q", "k", "v")]
    *with_sinks, dsinks = oracle.forward_backward(*args, sinks=np.full(2, -np.inf), **case.options)
    for got, want in zip(with_sinks, oracle.forward_backward(*args, **case.options)):
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-14)
    assert (dsinks == 0).all()


def test_a_nan_sink_reaches_its_head_and_no_other():
    case = make_case(np.random.default_rng(11), batch=1, heads_q=2, seqlen_q=6, seqlen_k=4, head_dim=4, dtype="float64",
                     causal=True)
    x = case.inputs
    o, lse, dq, dk, dv, dsinks = oracle.forward_backward(*(x[n] for n in ("do", "q", "k", "v")), sinks=np.array([np.nan, 1.0]),
                                                         **case.options)
    reads = np.arange(6) >= 2  # rows 0 and 1 lie above the diagonal: no key
    assert np.isnan(o[0, reads, 0]).all() and (o[0, ~reads, 0] == 0).all() and np.isnan(lse[0, 0]).all()
    assert np.isfinite(o[0, :, 1]).all() and np.isfinite(lse[0, 1]).all() and (lse[0, 1, ~reads] == 1.0).all()
    assert np.isnan(dsinks[0]) and np.isfinite(dsinks[1])
    assert np.isnan(dq[0, reads, 0]).all() and np.isfinite(dq[0, :, 1]).all() and (dq[0, ~reads] == 0).all()


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
@pytest.mark.parametrize("sinks", [None, np.array([0.5, -1.0, 2.5, -40.0])], ids=["no-sinks", "sinks"])
def test_naive_in_float64_is_the_oracle(backward, sinks):
    case = make_case(np.random.default_rng(7), heads_q=4, heads_k=2, seqlen_q=11, seqlen_k=14, dtype="float64", causal=True,
                     dropout_p=0.2, seed=3, softcap=3.0, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]),
                     mask=np.arange(14) % 5 != 1, sinks=sinks)
    x = case.inputs
    args = [x[n] for n in ("do", "q", "k", "v")]
    got, want = oracle.naive(*args, "float64", backward=backward, **case.options), oracle.forward_backward(*args, **case.options)
    assert len(got) == len(want) == (5 if sinks is None else 6)
    for got, want in zip(got, want):
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


def test_summary_merges_reports(tmp_path, capsys):
    def report(name, outcomes):
        results = [{"nodeid": f"x::{case}", "case": case, "outcome": o, "reason": r, "duration": 0.5} for case, (o, r) in outcomes.items()]
        return {"backend": name, "version": "1", "device": "cpu", "tier": "small", "results": results}

    paths = []
    for name, outcomes in (("a", {"t1": ("passed", None), "t2": ("skipped", "no fp64")}), ("b", {"t1": ("failed", None)})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(report(name, outcomes)))
        paths.append(str(path))
    assert summary.main([*paths, "--markdown", str(tmp_path / "s.md"), "--json", str(tmp_path / "s.json")]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "a  1 passed, 0 failed, 1 skipped  (cpu, tier small)",
        "b  0 passed, 1 failed, 0 skipped  (cpu, tier small)",
        "   FAILED t1",
        f"the case x backend table: {tmp_path / 's.md'}",
        f"the table as JSON: {tmp_path / 's.json'}",
    ]
    text = (tmp_path / "s.md").read_text()
    assert "| `t1` | pass | FAIL |" in text and "| `t2` | skip [1] | - |" in text and "1. no fp64" in text
    assert json.loads((tmp_path / "s.json").read_text())["cases"]["t2"]["a"]["reason"] == "no fp64"


def test_summary_names_the_first_failures_and_why_a_backend_did_not_run(tmp_path, capsys):
    def report(name, outcome, skip_reason, **header):
        results = [{"nodeid": f"x::t{n:02}", "case": f"t{n:02}", "outcome": outcome, "reason": skip_reason, "duration": 0.1}
                   for n in range(12)]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"backend": name, "version": "1", "device": "cpu", "results": results, **header}))
        return str(path)

    paths = [report("cpu", "failed", None, tier="full", available=True, reason=None),
             report("gpu", "skipped", "no CUDA device", tier="small", available=False, reason="no CUDA device", simulators=["TRITON_INTERPRET"])]
    assert summary.main(paths) == 1
    assert capsys.readouterr().out.splitlines() == [
        "cpu  0 passed, 12 failed, 0 skipped  (cpu, tier full)",
        *(f"     FAILED t{n:02}" for n in range(summary.NAMED_FAILURES)),
        "     ... and 2 more failed",
        "gpu  0 passed, 0 failed, 12 skipped  (cpu under TRITON_INTERPRET=1, tier small)",
        "     not available here: no CUDA device",
    ]


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
