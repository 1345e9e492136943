"""The contract's score modifications (softcap, ALiBi, sinks) on the device, and their arguments.

Scores stay in base 2, as everywhere in the kernels: a modified score is
``log2(e) * (c * tanh(scale * s / c) - a * |i + Lk - Lq - j|)`` for the raw product s = q . k,
which the softmax then treats like any scaled score. In a tile wholly on one side of ALiBi's
diagonal the bias splits into a term per key and one per query row (``alibi_split``). The sink
joins a row once, after its last key tile (``with_sink``), so a row's tiles never see it.
Without modifications none of this is compiled: each is a constexpr, and the plain kernels keep
their own fast paths.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from flashx_triton import tuning

LOG2E = tl.constexpr(1.4426950408889634)
#: Where a row's running max starts: the lowest finite float, not -inf. A row whose max were still
#: -inf (no key allowed yet, or only -inf scores from an infinity in q or k, which full tiles do not
#: mask) would take p = exp2(-inf - -inf) = NaN where p must be 0 and its sum stay 0. Every finite
#: score is at least this, so the max is the row's as before, and no tile pays for a guard.
ROW_MAX_START = tl.constexpr(-3.4028234663852886e38)


def score_mod_args(problem, scale: float) -> dict:
    """``mods`` (softcap's factors in and out, base 2; ALiBi's stride between sequences) and the
    constexprs SOFTCAP, ALIBI and SINKS, for kernels whose raw products are scaled by ``scale``
    (the forward runs a negative scale as a positive one on -q)."""
    softcap, slopes = problem.softcap, problem.alibi_slopes
    cap = (scale / softcap, softcap * math.log2(math.e)) if softcap is not None else (1.0, 1.0)
    slope_stride = problem.heads_q if slopes is not None and slopes.ndim == 2 else 0
    return dict(mods=(*cap, slope_stride), SOFTCAP=softcap is not None,
                FAST_TANH=problem.dtype != "float32" and not tuning.interpreting(), ALIBI=slopes is not None,
                HAS_SINKS=problem.sinks is not None)


@triton.jit
def tanh(x, FAST: tl.constexpr):
    """tanh in fp32. FAST: the GPU's tanh.approx (one special-function op, relative error under
    2^-10.9), for 16-bit inputs, whose own rounding of a score (2^-9 for bfloat16, 2^-11 for
    float16, relative) is no smaller. Otherwise to a few ulp, on the GPU and in Triton's
    interpreter alike (libdevice runs in neither form there): a Taylor polynomial near 0, where
    (e - 1) / (e + 1) with e = exp(2|x|) would lose the digits of a small x, and that quotient
    further out; NaN stays NaN and +-inf gives +-1."""
    if FAST:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        y = tl.abs(x)
        y2 = x * x
        near = x * (1.0 + y2 * (-1.0 / 3 + y2 * (2.0 / 15 + y2 * (-17.0 / 315 + y2 * (62.0 / 2835
                                                                                     + y2 * (-1382.0 / 155925))))))
        e = tl.exp2(tl.minimum(y, 20.0) * (2 * LOG2E))  # past 20, tanh is 1 in fp32 (and inf / inf would be NaN)
        far = (e - 1.0) / (e + 1.0)
        far = tl.where(x < 0, -far, far)
        return tl.where(y < 0.25, near, tl.where(x != x, x, far))


@triton.jit
def score_rule(SLOPES, b, h, q_len, k_len, mods, ALIBI: tl.constexpr):
    """What modifies the scores of sequence b, query head h, packed for ``modified_scores``:
    softcap's factors, and ALiBi's slope in base 2 with its diagonal (Lk - Lq)."""
    cap_in, cap_out, slope_stride = mods
    if ALIBI:
        slope = tl.load(SLOPES + b * slope_stride + h) * LOG2E
    else:
        slope = 0.0
    return cap_in, cap_out, slope, k_len - q_len


@triton.jit
def descaled_scores(scale_log2, rule, factor):
    """The scale of raw products and ``score_rule``'s rule for products of FP8 values that stand
    for ``factor`` times as much (q_descale * k_descale): both factors that take the raw product,
    the softmax's and softcap's, take it too, once per program rather than once per score."""
    cap_in, cap_out, slope, diag = rule
    return scale_log2 * factor, (cap_in * factor, cap_out, slope, diag)


@triton.jit
def modified_scores(s, i, j, scale_log2, rule, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, FAST_TANH: tl.constexpr):
    """Steps 1-3 of the contract's order, in base 2, on raw products ``s`` of query rows i and key
    columns j (broadcastable index tensors). Returns (scores, tanh of the scaled scores over c),
    the second only meaningful under SOFTCAP (its derivative, 1 - tanh^2, is the backward's).

    ALiBi's distance is taken in fp32 (exact below 2^24) from the positions converted per row
    and per column: one subtraction per score, where integer ones need a conversion each, which
    runs at the special-function units' rate."""
    cap_in, cap_out, slope, diag = rule
    if SOFTCAP:
        capped = tanh(s * cap_in, FAST_TANH)
        s = capped * cap_out
    else:
        capped = s
        s = s * scale_log2
    if ALIBI:
        s = s - slope * tl.abs((i + diag).to(tl.float32) - j.to(tl.float32))
    return s, capped


@triton.jit
def alibi_split(queries, keys, start, rule, SIDE: tl.constexpr):
    """ALiBi's bias on a tile of query rows ``queries`` and key columns ``keys`` (from ``start``)
    in which d = i + Lk - Lq - j has the sign SIDE (1 or -1) at every pair (``diagonal_part``), as
    (a term per key, a term per query) that add up to it: with j0 the tile's key nearest the
    diagonal (its last for SIDE 1, its first for -1),
    -a * |d| = -a * |j - j0| - a * |i + Lk - Lq - j0|.

    Neither term is larger than the bias: the key's, under a * the tile's width, joins the
    scaling of the products, one FMA per score instead of a distance, its absolute value and a
    multiply-add; the row's, up to a * the sequence's length, joins that row's max or LSE, per row
    and not per score. Each rounds an exact distance (fp32, exact below 2^24) once, as the bias
    taken per pair does."""
    _, _, slope, diag = rule
    j0 = start + keys.shape[0] - 1 if SIDE == 1 else start
    return (SIDE * slope) * (keys - j0).to(tl.float32), (-SIDE * slope) * (queries + diag - j0).to(tl.float32)


@triton.jit
def with_sink(m, l, sink2):
    """A row's running (max, sum) in base 2 with the sink's column (logit ``sink2``, base 2) added,
    and the factor its accumulator takes: exp2 is taken only of differences to the new max, so a
    sink far above the row's scores cannot overflow. A NaN or +inf sink makes the sum NaN."""
    m_new = tl.maximum(m, sink2)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    return m_new, l * alpha + tl.exp2(sink2 - m_ref), alpha
