"""The contract's "Score modifications": softcap, ALiBi and sinks, alone, together, and with every other feature.

Every case runs the forward and the backward and is held to the float64 oracle element by
element: o, lse, dq, dk, dv, and dsinks when the case has sinks. Rows left with no key must
give o = 0 and dq = 0 exactly, and lse = -inf, or the head's sink with sinks. Each family runs
its values over contexts (causal with more or fewer queries than keys, a window with GQA,
varlen with empty sequences, seqlens with NaN in every padding row, dropout, a sparse bool mask)
in which a backend that gets one rule wrong fails: the order of scale and cap, the alignment
of ALiBi's diagonal, a slope per batch entry, the sink in lse, the sign and the rows of dsinks.
Rows and keys that no allowed pair reads hold NaN in q, k, v and do (past seqlens, above the
causal diagonal, masked out): the modifications must not bring it back, nor dsinks read it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import flashx
from flashx_conformance.harness import (Case, conformance_failures, diagonal, full_only, make_case, make_varlen_case,
                                       merged_failures, outputs_of)


def _padding(lengths, n):
    """(B, n, 1, 1): True at rows i >= lengths[b]."""
    return (np.arange(n)[None, :] >= np.asarray(lengths)[:, None])[:, :, None, None]


def _seqlens_poisoned(rng, dtype, mods):
    lengths_q, lengths_k = [64, 19, 0], [80, 5, 33]
    case = make_case(rng, batch=3, seqlen_q=64, seqlen_k=80, head_dim=32, dtype=dtype, causal=True,
                     seqlens_q=np.array(lengths_q, np.int32), seqlens_k=np.array(lengths_k, np.int32), **mods(3, 2))
    for name, lengths, n in (("q", lengths_q, 64), ("do", lengths_q, 64), ("k", lengths_k, 80), ("v", lengths_k, 80)):
        case = case.with_poison(name, _padding(lengths, n))
    return case


def _causal_tall(rng, dtype, mods):
    """Nq > Nk: the first 43 rows lie above the diagonal and have no key; NaN in their q and do."""
    case = make_case(rng, seqlen_q=83, seqlen_k=40, head_dim=32, dtype=dtype, causal=True, **mods(2, 2))
    above = (np.arange(83) < 43)[None, :, None, None]
    return case.with_poison("q", above).with_poison("do", above)


def _sparse_mask(rng, dtype, mods):
    mask = rng.random((2, 1, 67, 91)) < 0.3
    mask[0, :, 5, :] = False  # a row with no key, NaN in its q and do
    mask[1, :, :, 40] = False  # a key no row reads, NaN in its k and v
    row, key = np.zeros((2, 67, 1, 1), bool), np.zeros((2, 91, 1, 1), bool)
    row[0, 5], key[1, 40] = True, True
    case = make_case(rng, batch=2, heads_q=2, seqlen_q=67, seqlen_k=91, head_dim=32, dtype=dtype, mask=mask, **mods(2, 2))
    return case.with_poison("q", row).with_poison("do", row).with_poison("k", key).with_poison("v", key)


#: Where each modification must hold: name -> build(rng, dtype, mods), ``mods(batch, heads_q)``
#: giving the modification's keywords for that many sequences and query heads.
CONTEXTS = {
    # Nq < Nk: the diagonal is off the top-left one, so a top-left ALiBi or causal shows
    "causal-wide": lambda rng, dtype, mods: make_case(rng, seqlen_q=45, seqlen_k=101, head_dim=32, dtype=dtype,
                                                       causal=True, **mods(2, 2)),
    "causal-tall": _causal_tall,
    "window-gqa": lambda rng, dtype, mods: make_case(rng, heads_q=4, heads_k=2, seqlen_q=90, seqlen_k=70, head_dim=32,
                                                      dtype=dtype, window=(11, 5), **mods(2, 4)),
    "varlen-gqa": lambda rng, dtype, mods: make_varlen_case(rng, lengths_q=[33, 0, 60, 9], lengths_k=[50, 7, 41, 0],
                                                            spare_rows=3, heads_q=4, heads_k=2, head_dim=32, dtype=dtype,
                                                            causal=True, **mods(4, 4)),
    "seqlens-poisoned": _seqlens_poisoned,
    "dropout": lambda rng, dtype, mods: make_case(rng, seqlen_q=70, seqlen_k=90, head_dim=32, dtype=dtype,
                                                  dropout_p=0.25, seed=7, rng_offset=3, **mods(2, 2)),
    "sparse-mask": _sparse_mask,
    # a decoding step that reaches attention, which a backend may compute as decoding (the
    # contract's "Attention as decoding"): a few query rows over many keys, GQA
    "short-query": lambda rng, dtype, mods: make_case(rng, seqlen_q=3, seqlen_k=150, heads_q=8, heads_k=2, head_dim=32,
                                                       dtype=dtype, causal=True, **mods(2, 8)),
}


def _per_head(values, heads: int) -> np.ndarray:
    """``values`` repeated over ``heads`` query heads (every head its own value where they suffice)."""
    return np.resize(np.asarray(values, dtype=np.float64), heads)


#: softcap c: small and large against the scores' spread (about 1 here), and c = 1 with scores
#: scaled to spread about 11, where tanh saturates and the cap's derivative vanishes.
SOFTCAPS = {
    "0.5": lambda batch, heads: {"softcap": 0.5},
    "5": lambda batch, heads: {"softcap": 5.0, "softmax_scale": 0.3},
    "1e4": lambda batch, heads: {"softcap": 1e4},
    "saturated": lambda batch, heads: {"softcap": 1.0, "softmax_scale": 2.0},
}


@pytest.mark.parametrize("cap, context", diagonal(list(SOFTCAPS), list(CONTEXTS)), ids=str)
def test_score_mods_softcap(flashx_target, flashx_rng, cap, context):
    """S = c * tanh(S / c) on the scaled scores, before masks; its derivative 1 - tanh^2 in dq and dk."""
    flashx_target.check(CONTEXTS[context](flashx_rng, flashx_target.dtype, SOFTCAPS[cap]))


#: Slopes (powers of two: exact in float32): the geometric ones of ALiBi's paper, steep ones that
#: leave each row a few keys near the diagonal, and ones per sequence and head.
ALIBI = {
    "per-head": lambda batch, heads: {"alibi_slopes": 2.0 ** -(8.0 * np.arange(1, heads + 1) / heads)},
    "steep": lambda batch, heads: {"alibi_slopes": _per_head([1.0, 4.0, 0.5], heads)},
    "per-batch-head": lambda batch, heads: {"alibi_slopes": 2.0 ** -np.arange(1.0, batch * heads + 1).reshape(batch, heads)[::-1]},
}


@pytest.mark.parametrize("slopes, context", diagonal(list(ALIBI), list(CONTEXTS)), ids=str)
def test_score_mods_alibi(flashx_target, flashx_rng, slopes, context):
    """S -= a * |i + Lk - Lq - j|: bottom-right aligned per sequence, slopes per head or per sequence and head."""
    flashx_target.check(CONTEXTS[context](flashx_rng, flashx_target.dtype, ALIBI[slopes]))


#: Sinks per query head (float32 values): beside the scores, far above them (the sink takes most
#: of each row), far below (no effect but the arithmetic), and -inf (exactly no sink).
SINKS = {
    "positive": lambda batch, heads: {"sinks": _per_head([2.5, 0.75, 1.5, 3.25], heads)},
    "negative": lambda batch, heads: {"sinks": _per_head([-1.25, -0.5, -2.0, -3.0], heads)},
    "dominant": lambda batch, heads: {"sinks": _per_head([8.0, 6.5], heads)},
    "very-negative": lambda batch, heads: {"sinks": _per_head([-60.0, -45.0], heads)},
    "minus-inf": lambda batch, heads: {"sinks": _per_head([-np.inf, 1.0], heads)},
}


@pytest.mark.parametrize("sinks, context", diagonal(list(SINKS), list(CONTEXTS)), ids=str)
def test_score_mods_sinks(flashx_target, flashx_rng, sinks, context):
    """exp(sink) in every row's denominator, never masked nor dropped; lse holds it; a row with no
    key has o = 0 and lse = sink; dsinks = -sum over rows with a key of exp(sink - lse) * delta."""
    flashx_target.check(CONTEXTS[context](flashx_rng, flashx_target.dtype, SINKS[sinks]))


def _all_three(batch, heads):
    return {"softcap": 2.0, "alibi_slopes": 2.0 ** -np.arange(1.0, batch * heads + 1).reshape(batch, heads),
            "sinks": _per_head([1.5, -0.5, 4.0, 0.25], heads)}


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_score_mods_combined(flashx_target, flashx_rng, context):
    """softcap, ALiBi and sinks in one call, in the contract's order."""
    flashx_target.check(CONTEXTS[context](flashx_rng, flashx_target.dtype, _all_three))


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=full_only)])
def test_score_mods_16bit(flashx_target, flashx_rng, dtype):
    """All three in 16 bits, causal GQA over several 64-row tiles, where GPU kernels take their tensor-core paths."""
    case = make_case(flashx_rng, heads_q=4, heads_k=2, seqlen_q=100, seqlen_k=230, head_dim=64, dtype=dtype, causal=True,
                     **_all_three(2, 4))
    flashx_target.check(case)


def test_score_mods_nan_and_inf(flashx_target, flashx_rng):
    """A NaN sink (head 0) and a +inf sink (head 1) make the rows of their head that have a key
    NaN, and their dsinks; rows without a key keep o = 0 and lse = sink. A NaN slope (sequence 1,
    head 2) makes that sequence and head NaN, and dsinks[2]; head 3 is untouched. An infinite key
    entry read by every row of heads 2 and 3 is capped by the softcap: o stays finite, and
    0 * inf reaches dq."""
    sinks = np.array([np.nan, np.inf, 0.5, -1.0])
    slopes = np.full((2, 4), 0.25)
    slopes[1, 2] = np.nan
    case = make_case(flashx_rng, heads_q=4, heads_k=2, seqlen_q=50, seqlen_k=30, head_dim=32, dtype=flashx_target.dtype,
                     causal=True, softcap=3.0, sinks=sinks, alibi_slopes=slopes)
    infinite = np.zeros(case.inputs["k"].shape, bool)
    infinite[0, 0, 1, 7] = True  # key 0 of kv head 1 in sequence 0: every row of heads 2 and 3 with a key reads it
    got = flashx_target.check(case.with_poison("k", infinite, math.inf))
    has_key = np.arange(50) >= 20  # causal, Nq > Nk: the first 20 rows have no key
    assert np.isnan(got["o"][:, has_key, :2]).all() and (got["o"][:, ~has_key] == 0).all()
    assert np.isnan(got["dsinks"][:3]).all() and np.isfinite(got["dsinks"][3])
    assert np.isfinite(got["o"][0, :, 2:]).all(), "the softcap caps an infinite score"
    assert np.isnan(got["dq"][0, has_key, 2:, 7]).all() and np.isfinite(got["dq"][0, :, 2:, :7]).all()
    assert np.isnan(got["o"][1, has_key, 2]).all() and np.isfinite(got["o"][1, :, 3]).all()


@pytest.mark.parametrize("mod, dtype", diagonal(["softcap", "sinks"], ["target", "float16", "bfloat16"]), ids=str)
def test_score_mods_infinite_query(flashx_target, flashx_rng, mod, dtype):
    """A -inf entry of q whose row keeps a finite lse: the softcap caps the row's infinite scores,
    and a sink is the lse of a row whose scores are all -inf. dk is NaN at that column for exactly
    the keys the row may read: the keys past its causal edge share its tiles' products, not its
    pairs. A kernel that trusts a finite lse to mean a finite q fails here."""
    seqlen_k, dtype = (45, flashx_target.dtype) if dtype == "target" else (77, dtype)
    mods = {"softcap": 2.0} if mod == "softcap" else {"sinks": np.array([0.5, -1.0, 1.5, 0.25])}
    case = make_case(flashx_rng, seqlen_q=45, seqlen_k=seqlen_k, heads_q=4, heads_k=2, head_dim=32, dtype=dtype,
                     causal=True, **mods)
    case.inputs["k"][1, :, 1, 5] = np.abs(case.inputs["k"][1, :, 1, 5]) + 0.25  # each score of the row -inf, none NaN
    where = np.zeros(case.inputs["q"].shape, dtype=bool)
    where[1, 20, 3, 5] = True  # query head 3 reads kv head 1
    got = flashx_target.check(case.with_poison("q", where, -math.inf))
    allowed = np.arange(seqlen_k) <= 20 + seqlen_k - 45
    assert np.isfinite(got["lse"][1, 3, 20]), "the row's lse is not finite: the case tests nothing"
    assert np.isnan(got["dk"][1, allowed, 1, 5]).all() and np.isfinite(got["dk"][1, ~allowed, 1, 5]).all()


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
def test_score_mods_sinks_merge_once(flashx_target, flashx_rng, softcap):
    """Keys split in two parts, the sink given to one of them only, or to neither and merged as
    its own state (o = 0, lse = sink): flashx.merge_states gives attention with sinks over all keys.
    Rows empty in one part, or in both, are where lse = sink of an empty row matters."""
    dtype, seqlen_q, seqlen_k, split = flashx_target.dtype, 29, 50, 21
    mask = flashx_rng.random((seqlen_q, seqlen_k)) < 0.7
    mask[3, :] = False  # empty in both parts
    mask[5, :split] = False  # empty in the part with the sink
    mask[7, split:] = False  # empty in the other
    sinks = np.array([1.5, -0.5, 3.0, 0.25])
    case = make_case(flashx_rng, batch=2, heads_q=4, heads_k=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=32,
                     dtype=dtype, mask=mask, sinks=sinks, softcap=softcap)

    def part(keys, with_sinks):
        options = {**case.options, "mask": mask[:, keys], "sinks": sinks if with_sinks else None}
        inputs = {n: x[:, keys] if n in ("k", "v") else x for n, x in case.inputs.items()}
        o, res, *_ = flashx_target.call(Case(inputs, dtype, options))
        return o, res.lse

    keys_a, keys_b = slice(0, split), slice(split, seqlen_k)
    second = part(keys_b, False)
    o, lse = flashx.merge_states(*part(keys_a, False), *second)
    lse_dtype = "float64" if dtype == "float64" else "float32"
    sink_lse = np.broadcast_to(sinks[None, :, None], np.shape(lse))
    sink_state = (flashx_target.array(np.zeros(np.shape(o)), dtype), flashx_target.array(sink_lse, dtype, element=lse_dtype))
    merged = {"the sink in the first part": flashx.merge_states(*part(keys_a, True), *second),
              "the sink's state merged": flashx.merge_states(o, lse, *sink_state)}
    failures = [f"{how}: {failure}" for how, (o, lse) in merged.items()
                for failure in merged_failures(case, flashx_target.numpy(o), flashx_target.numpy(lse))]
    assert not failures, case.describe() + "\n" + "\n".join(failures)


def test_score_mods_sinks_autograd(flashx_target, flashx_rng):
    """flashx.attention on torch tensors: sinks that require grad receive dsinks, as do q, k, v theirs."""
    torch = pytest.importorskip("torch")
    dtype = flashx_target.dtype
    case = make_case(flashx_rng, heads_q=4, heads_k=2, seqlen_q=37, seqlen_k=53, head_dim=32, dtype=dtype, causal=True,
                     sinks=np.array([0.5, 2.0, -1.0, 1.25]))

    def tensor(x, dtype):
        return torch.from_numpy(np.asarray(x)).to(device=flashx_target.device, dtype=getattr(torch, dtype))

    rounded = case.rounded()
    q, k, v, do = (tensor(rounded[n], dtype).requires_grad_(n != "do") for n in ("q", "k", "v", "do"))
    sinks = tensor(case.options["sinks"], "float32").requires_grad_()
    flashx_target.skip_unless_supported(q, k, v, causal=True, sinks=sinks)
    out, lse = flashx.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, backend=flashx_target.name)
    out.backward(do)
    got = dict(zip(outputs_of(case), (flashx_target.numpy(x) for x in (out, lse, q.grad, k.grad, v.grad, sinks.grad))))
    failures = conformance_failures(case, got)
    assert not failures, case.describe() + "\n" + "\n".join(failures)
