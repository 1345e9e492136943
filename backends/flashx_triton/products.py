"""Tile products: plain ones at the dtype's precision, and the NaN-safe one of masked tiles.

A disallowed pair must add exactly 0 to a product even where the value it multiplies is NaN or
infinite (the contract's NaN rules); ``masked_dot`` pays for that only in tiles holding such data.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashx_triton.fp8 import e4m3_weights


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in fp32 (acc None: a fresh product). Accumulating inside tl.dot keeps one
    register accumulator instead of a product plus a sum. PRECISION "upcast" multiplies bf16
    tiles as fp32 (exact: bf16 products fit fp32) for Triton's CPU interpreter, whose bf16
    tl.dot is wrong (3.9)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def pv_operand(p, v, FP8: tl.constexpr):
    """The weights P (float32) as the operand of their product with V: in V's dtype, or for FP8
    inputs rounded to e4m3 whatever V's format, as plain attention in FP8 rounds them (the
    contract's FP8 section; ``FP8`` is ``flashx_triton.fp8.fp8_mode``'s flag)."""
    if FP8 != "":
        return e4m3_weights(p, FP8 == "emulated")
    else:
        return p.to(v.dtype)


@triton.jit
def masked_dot(a, b, allowed, acc, b_suspect, PRECISION: tl.constexpr):
    """acc + the sum over allowed j of a[i, j] * b[j, :], for masked tiles; ``a`` must already
    be 0 at every disallowed pair (P is: exp2(-inf) = 0).

    A plain dot adds 0 * NaN = NaN where a disallowed pair meets a NaN or inf in b, so NaN
    would reach outputs that never read it. Unless b is known finite (``b_suspect`` False),
    the finite part of b goes through the dot; an output whose allowed terms meet a non-finite
    entry of b becomes NaN (the contract's "Real NaN" rule), found by one 0/1 indicator product that
    runs only in tiles holding non-finite data. Unmasked tiles need none of this: every pair
    there is allowed.
    """
    if b_suspect:
        finite = _finite(b)
        out = dot(a, tl.where(finite, b, 0.0), acc, PRECISION)
        if tl.min(finite.to(tl.int32)) == 0:
            # 0/1 in b's dtype are exact and their counts accumulate exactly in fp32. Built from
            # floats: the interpreter turns a bool into bf16 as raw bits (a denormal).
            ones = tl.where(allowed, 1.0, 0.0).to(b.dtype)
            hits = dot(ones, tl.where(finite, 0.0, 1.0).to(b.dtype), None, PRECISION)
            out = tl.where(hits > 0, float("nan"), out)
    else:
        out = dot(a, b, acc, PRECISION)
    return out


@triton.jit
def _finite(x):
    """Whether each element is finite (False for NaN too); FP8 is widened first, having no
    arithmetic of its own."""
    if x.dtype.is_fp8():
        x = x.to(tl.float32)
    return tl.abs(x) < float("inf")


@triton.jit
def any_nonfinite(x):
    """Whether a tile holds a NaN or an infinity (a scalar).

    The backward asks it of its score products: a non-finite row of Q, K, V or dO makes a whole
    row or column of them non-finite, so finite products clear the tile's operands for
    masked_dot's fast path without loading the operands into registers.
    """
    return tl.min((tl.abs(x) < float("inf")).to(tl.int32)) == 0
