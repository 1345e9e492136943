"""The contract's FP8 section: 8-bit inputs with descales per sequence and key/value head, forward only.

Each case is quantized as an FP8 caller quantizes: real inputs, spread over sequences and heads
by factors of up to 4 either way, are divided per (sequence, key/value head) by a descale of
their largest magnitude over the format's largest finite value, then rounded to the format. The
backend's o and lse are held to the float64 oracle on the real values the inputs stand for:
twice the error of plain attention in FP8 (``oracle.naive_fp8``), plus the output dtype's floor.
Descales that differ in every (sequence, head) make a descale read at the wrong index, or not at
all, fail; masks, lengths, packed sequences and the score modifications keep their rules, NaN in
positions no allowed pair reads never reaches an output, and rows without a key give o = 0 and
lse = -inf exactly. What FP8 declines (the backward, autograd, dropout) raises with its reason on
every backend, whether or not it implements FP8.

Decoding with an FP8 cache under 16-bit queries: the caches after the call hold the new tokens
quantized by the contract's rule (x / descale clamped to ±448, then torch's conversion, bit for
bit), and o and lse are judged as a call in q's dtype on the values the cache stands for.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashx
from flashx_conformance.harness import Case, diagonal, make_case, make_varlen_case, spans_no_block_reads
from flashx_conformance.test_decode import check as check_decode
from flashx_conformance.test_decode import make_decode_case
from flashx_conformance.tolerance import round_to

#: The largest finite value of each format: a descale maps each block's largest magnitude onto it.
LARGEST = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def quantized(rng: np.random.Generator, case: Case, out_dtype: str | None = "bfloat16") -> Case:
    """``case`` (drawn in an FP8 dtype) as an FP8 caller hands it over: q, k, v spread by a factor
    per (sequence, head), divided by their descales, which join the keywords with ``out_dtype``."""
    inputs, options = {name: x.copy() for name, x in case.inputs.items()}, dict(case.options)
    heads_k = inputs["k"].shape[-2]
    cu = {"q": options.get("cu_seqlens_q"), "k": options.get("cu_seqlens_k"), "v": options.get("cu_seqlens_k")}
    batch = len(cu["q"]) - 1 if case.varlen else inputs["q"].shape[0]
    for name in ("q", "k", "v"):
        x = inputs[name]
        group = x.shape[-2] // heads_k
        blocks = _blocks(x, cu[name], batch)  # (sequence, rows of x) pairs
        spread = 2.0 ** rng.uniform(-2, 2, (batch, x.shape[-2]))
        largest = np.zeros((batch, heads_k))
        for b, rows in blocks:
            x[rows] *= spread[b][:, None]
            largest[b] = np.abs(x[rows]).reshape(-1, heads_k, group * x.shape[-1]).max(axis=(0, 2), initial=0.0)
        descale = (np.maximum(largest, 1e-3) / LARGEST[case.dtype]).astype(np.float32)
        for b, rows in blocks:
            x[rows] /= np.repeat(descale[b].astype(np.float64), group)[:, None]
        options[f"{name}_descale"] = descale
    if out_dtype is not None:
        options["out_dtype"] = out_dtype
    return Case(inputs, case.dtype, options, case.poison, case.layouts)


def _blocks(x, cu, batch):
    """(sequence b, index of its rows in x) for each sequence: x[b] padded, x[cu[b]:cu[b+1]] packed."""
    if cu is None:
        return [(b, (b,)) for b in range(batch)]
    return [(b, (slice(int(cu[b]), int(cu[b + 1])),)) for b in range(batch)]


def _padding(lengths, n):
    """(B, n, 1, 1): True at rows i >= lengths[b]."""
    return (np.arange(n)[None, :] >= np.asarray(lengths)[:, None])[:, :, None, None]


def _seqlens_poisoned(rng, dtype, **options):
    lengths_q, lengths_k = [48, 19, 0], [60, 5, 33]
    case = make_case(rng, batch=3, seqlen_q=48, seqlen_k=60, heads_q=4, heads_k=2, head_dim=32, dtype=dtype,
                     causal=True, seqlens_q=np.array(lengths_q, np.int32), seqlens_k=np.array(lengths_k, np.int32),
                     **options)
    case = quantized(rng, case)
    for name, lengths, n in (("q", lengths_q, 48), ("k", lengths_k, 60), ("v", lengths_k, 60)):
        case = case.with_poison(name, _padding(lengths, n))
    return case


def _causal_tall(rng, dtype, **options):
    """Nq > Nk: the first 31 rows lie above the diagonal and have no key; NaN in their q."""
    case = quantized(rng, make_case(rng, seqlen_q=61, seqlen_k=30, head_dim=32, dtype=dtype, causal=True, **options))
    return case.with_poison("q", (np.arange(61) < 31)[None, :, None, None])


def _sparse_mask(rng, dtype, **options):
    mask = rng.random((2, 1, 40, 70)) < 0.3
    mask[1, :, :, 25] = False  # a key no row reads, NaN in its k and v
    key = np.zeros((2, 70, 1, 1), bool)
    key[1, 25] = True
    case = make_case(rng, seqlen_q=40, seqlen_k=70, head_dim=32, dtype=dtype, mask=mask, **options)
    return quantized(rng, case).with_poison("k", key).with_poison("v", key)


def _long_keys_block_mask(rng, dtype, **options):
    """Whole key tiles that no query block reads (NaN in k and v), skipped between read ones."""
    block_mask, unread = spans_no_block_reads(rng, 2, 2, 130, 448)
    case = make_case(rng, batch=2, heads_q=2, seqlen_q=130, seqlen_k=448, head_dim=64, dtype=dtype,
                     block_mask=block_mask, **options)
    return quantized(rng, case).with_poison("k", unread).with_poison("v", unread)


def _long_keys_seqlens(rng, dtype, head_dim=128, causal=True, ends=(410, 500), **options):
    """Several key tiles of any width the FP8 forwards take, and a sequence that ends inside one
    (key 410: in the second 128 keys of a 192-key tile), NaN past it in k and v."""
    lengths_q, lengths_k = [130, 97], list(ends)
    case = make_case(rng, batch=2, seqlen_q=130, seqlen_k=500, heads_q=2, heads_k=1, head_dim=head_dim, dtype=dtype,
                     causal=causal, seqlens_q=np.array(lengths_q, np.int32), seqlens_k=np.array(lengths_k, np.int32),
                     **options)
    case = quantized(rng, case)
    for name in ("k", "v"):
        case = case.with_poison(name, _padding(lengths_k, 500))
    return case


def _long_keys_nan_v(rng, dtype, **options):
    """NaN in v at key 200, which rows 200 on read, in a tile the diagonal crosses: their o is NaN
    in that column, and no other element is."""
    case = quantized(rng, make_case(rng, seqlen_q=300, seqlen_k=300, head_dim=96, dtype=dtype, causal=True,
                                    **options))
    where = np.zeros(case.inputs["v"].shape, bool)
    where[0, 200, 0, 5] = True
    return case.with_poison("v", where)


#: Contexts of the FP8 forward: name -> build(rng, dtype, **keywords).
CONTEXTS = {
    "plain-gqa": lambda rng, dtype, **options: quantized(rng, make_case(
        rng, heads_q=6, heads_k=2, seqlen_q=50, seqlen_k=70, head_dim=64, dtype=dtype, **options)),
    "causal-tall": _causal_tall,
    "window-dv": lambda rng, dtype, **options: quantized(rng, make_case(
        rng, seqlen_q=70, seqlen_k=55, head_dim=32, head_dim_v=48, dtype=dtype, window=(9, 4), **options)),
    "varlen-gqa": lambda rng, dtype, **options: quantized(rng, make_varlen_case(
        rng, lengths_q=[33, 0, 41, 9], lengths_k=[50, 7, 41, 0], spare_rows=3, heads_q=4, heads_k=2, head_dim=32,
        dtype=dtype, causal=True, **options)),
    "seqlens-poisoned": _seqlens_poisoned,
    "sparse-mask": _sparse_mask,
    "block-mask": lambda rng, dtype, **options: quantized(rng, make_case(
        rng, seqlen_q=64, seqlen_k=96, head_dim=32, dtype=dtype,
        block_mask=flashx.BlockMask(rng.random((2, 2, 4, 6)) < 0.6, 16), **options)),
    "long-keys-block-mask": _long_keys_block_mask,
    "long-keys-seqlens": _long_keys_seqlens,
    "long-keys-nan-v": _long_keys_nan_v,
    "long-keys-d64": lambda rng, dtype, **options: _long_keys_seqlens(
        rng, dtype, head_dim=64, causal=False, ends=(300, 500), **options),
}
#: (input format, output dtype) pairs.
FORMATS = {
    "e4m3fn-bfloat16": ("float8_e4m3fn", "bfloat16"),
    "e4m3fn-float16": ("float8_e4m3fn", "float16"),
    "e5m2-bfloat16": ("float8_e5m2", "bfloat16"),
}


def _with_out_dtype(case: Case, out_dtype: str) -> Case:
    return Case(case.inputs, case.dtype, {**case.options, "out_dtype": out_dtype}, case.poison, case.layouts)


@pytest.mark.parametrize("formats, context", diagonal(list(FORMATS), list(CONTEXTS)), ids=str)
def test_fp8_forward(flashx_target, flashx_rng, formats, context):
    """o and lse within twice plain FP8's error of the oracle on the dequantized inputs."""
    dtype, out_dtype = FORMATS[formats]
    flashx_target.check(_with_out_dtype(CONTEXTS[context](flashx_rng, dtype), out_dtype))


@pytest.mark.parametrize("context", ["causal-tall", "varlen-gqa"])
def test_fp8_score_mods(flashx_target, flashx_rng, context):
    """softcap, ALiBi (a slope per sequence and head) and sinks on the dequantized scores."""
    heads, batch = (4, 4) if context == "varlen-gqa" else (2, 2)
    mods = {"softcap": 3.0, "alibi_slopes": 2.0 ** -np.arange(1.0, batch * heads + 1).reshape(batch, heads),
            "sinks": np.resize([1.5, -0.5, 4.0, 0.25], heads)}
    flashx_target.check(CONTEXTS[context](flashx_rng, "float8_e4m3fn", **mods))


def test_fp8_default_descales_and_output(flashx_target, flashx_rng):
    """Without descales the inputs are their own values, and o is bfloat16."""
    case = make_case(flashx_rng, heads_q=4, heads_k=2, seqlen_q=40, seqlen_k=40, head_dim=32, dtype="float8_e4m3fn",
                     causal=True)
    flashx_target.check(case)


def test_fp8_nan_propagates(flashx_target, flashx_rng):
    """NaN in q (float8_e4m3fn has NaN but no infinity) makes its row NaN; +inf in k (float8_e5m2
    has both) makes every row that reads it NaN through its softmax, as in plain arithmetic."""
    case = quantized(flashx_rng, make_case(flashx_rng, seqlen_q=20, seqlen_k=30, head_dim=32, dtype="float8_e4m3fn"))
    where = np.zeros(case.inputs["q"].shape, bool)
    where[1, 7, 0, 3] = True
    flashx_target.check(case.with_poison("q", where))
    case = quantized(flashx_rng, make_case(flashx_rng, seqlen_q=20, seqlen_k=30, head_dim=32, dtype="float8_e5m2",
                                           causal=True))
    where = np.zeros(case.inputs["k"].shape, bool)
    where[0, 12, 1, 5] = True
    flashx_target.check(case.with_poison("k", where, np.inf))


def _fp8_tensors(flashx_target, rng):
    """q, k, v as the torch FP8 tensors (B = 2, Nq = 9, Hq = 4) of a small case, and its keywords
    as arrays like them."""
    case = quantized(rng, make_case(rng, heads_q=4, heads_k=2, seqlen_q=9, seqlen_k=11, head_dim=16,
                                    dtype="float8_e4m3fn"))
    inputs = flashx_target.inputs(case)
    return inputs["q"], inputs["k"], inputs["v"], flashx_target.auxiliary(case.options, case.dtype)


def test_fp8_declines_the_backward(flashx_target, flashx_rng):
    """attention_backward of FP8 inputs, and attention on FP8 tensors that require grad, raise
    UnsupportedError saying that FP8 is forward only; explain describes the problem so."""
    import torch

    q, k, v, options = _fp8_tensors(flashx_target, flashx_rng)
    assert "forward only" in str(flashx.explain(q, k, v, backend=flashx_target.name, **options))
    o = torch.zeros(q.shape, dtype=torch.bfloat16, device=q.device)
    res = flashx.Residuals(torch.zeros((2, 4, 9), device=q.device), 0, 0)
    with pytest.raises(flashx.UnsupportedError, match="forward only"):
        flashx.attention_backward(o, q, k, v, o, res, backend=flashx_target.name, **options)
    with pytest.raises(flashx.UnsupportedError, match="forward only"):
        flashx.attention(q.requires_grad_(), k, v, backend=flashx_target.name, **options)


def test_fp8_declines_dropout(flashx_target, flashx_rng):
    """Dropout is declined with FP8 inputs by every backend, with the reason."""
    q, k, v, options = _fp8_tensors(flashx_target, flashx_rng)
    with pytest.raises(flashx.UnsupportedError, match="no dropout with FP8"):
        flashx.attention(q, k, v, dropout_p=0.1, seed=1, backend=flashx_target.name, **options)


def test_fp8_needs_one_dtype(flashx_target, flashx_rng):
    """FP8 q with a k of another dtype is a DTypeError naming k; descales without FP8 inputs name
    the descale."""
    q, k, v, options = _fp8_tensors(flashx_target, flashx_rng)
    with pytest.raises(flashx.DTypeError, match="^k: expected the dtype of q"):
        flashx.attention(q, k.bfloat16(), v, backend=flashx_target.name, **options)
    with pytest.raises(flashx.DTypeError, match="^q_descale: only for FP8 inputs"):
        flashx.attention(*(x.float() for x in (q, k, v)), backend=flashx_target.name, q_descale=options["q_descale"])


def _cache_descales(rng, batch: int, heads_k: int = 2) -> dict:
    return {name: (2.0 ** rng.uniform(-2, 2, (batch, heads_k))).astype(np.float32)
            for name in ("k_descale", "v_descale")}


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_decode(flashx_target, flashx_rng, dtype, page_size):
    """Three new tokens per sequence quantized into an FP8 cache (one sequence empty before them),
    three query rows, causal, two splits, GQA 2:1."""
    case = make_decode_case(flashx_rng, lengths=[37, 0, 12], new=3, seqlen_q=3, page_size=page_size, dtype=dtype,
                            cache_dtype="float8_e4m3fn", causal=True, num_splits=2, **_cache_descales(flashx_rng, 3))
    check_decode(flashx_target, case)


def test_fp8_decode_saturates_and_keeps_nan(flashx_target, flashx_rng):
    """A new key past 448 x its descale, and -inf, saturate to ±448; NaN in a new value stays NaN
    and reaches exactly the rows that read it; no descales (1), with softcap and sinks."""
    case = make_decode_case(flashx_rng, lengths=[20, 9], new=2, seqlen_q=2, dtype="bfloat16",
                            cache_dtype="float8_e4m3fn", softcap=5.0, sinks=np.array([0.5, -1.0, 2.0, 0.0]))
    case.k_new[0, 1, 0, 3] = round_to(3e4, "bfloat16")
    case.k_new[1, 0, 1, 5] = -np.inf
    case.v_new[1, 1, 0, 2] = np.nan
    got = check_decode(flashx_target, case)
    assert got["k_cache"][0, 21, 0, 3] == 448 and got["k_cache"][1, 9, 1, 5] == -448
    assert np.isnan(got["o"][1, 1, :2, 2]).all() and np.isfinite(got["o"][1, 0]).all()


def test_fp8_decode_errors(flashx_target, flashx_rng):
    """An FP8 cache needs bfloat16 or float16 queries; descales need an FP8 cache."""
    import torch

    q = torch.zeros((2, 1, 4, 8), dtype=torch.float32)
    cache = torch.zeros((2, 6, 2, 8), dtype=torch.float8_e4m3fn)
    lengths = torch.tensor([1, 2])
    with pytest.raises(flashx.DTypeError, match=r"^k_cache: expected the dtype of q \(float32\), got float8_e4m3fn"):
        flashx.attention_with_kvcache(q, cache, cache, cache_seqlens=lengths, backend=flashx_target.name)
    with pytest.raises(flashx.DTypeError, match="^k_descale: only for an FP8 cache"):
        flashx.attention_with_kvcache(q.bfloat16(), cache.bfloat16(), cache.bfloat16(), cache_seqlens=lengths,
                                      k_descale=torch.ones(2, 2), backend=flashx_target.name)
