"""FP8 in the kernels (the contract's FP8 section): the conversions they make, natively on the GPU
and emulated under Triton's interpreter, and the host's preparation of FP8 operands.

On the GPU the kernels keep FP8 tiles as they are loaded: a product of two FP8 tiles runs on the
tensor cores (products exact, summed in float32), the weights P are rounded to e4m3 by the
hardware's conversion (round to nearest even, saturating), and V's tile is read with its keys
contiguous, as Hopper's FP8 tensor-core product wants its second operand (``keys_contiguous``),
16 bytes at a time in every tile, masked ones too (``readable_keys``). Tiles are wider and
pipelines deeper than in 16 bits (``flashx_triton.tuning.FORWARD_FP8``; decoding's in
``flashx_triton.decode.config``), as a key takes half the bytes. A decoding cache's FP8 tiles are
widened to the queries' 16-bit dtype instead (``cache_values``), which holds every e4m3 value.

Triton's interpreter (3.9) converts FP8 through a generic bit routine that gets it wrong: e4m3's
NaN reads as 480, e5m2's infinities and NaN as finite numbers, and a float rounded to e4m3 may
lose its carry (0.49 becomes 0.25), rounds ties up and truncates subnormals. Under the interpreter
(``EMULATED``) the kernels therefore work in float32 on the values the bytes stand for: tiles are
widened as they are loaded (``widened``), and P is rounded onto the e4m3 grid by float32
arithmetic (``on_e4m3_grid``). Products of float32 operands holding FP8 values are exact, as the
tensor cores' are, so the interpreter grades the same rounding at the same places; what it does
not exercise is the GPU's choice of instructions.

The FP8 flag the kernels take is "" (no FP8), "native" or "emulated" (``fp8_mode``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)


def fp8_mode(fp8: bool) -> str:
    """The kernels' FP8 flag for a problem with (``fp8``) or without FP8 data."""
    from flashx_triton.tuning import interpreting

    if not fp8:
        return ""
    return "emulated" if interpreting() else "native"


@triton.jit
def widened(x, EMULATED: tl.constexpr):
    """An FP8 tile as the kernels compute with it: as loaded on the GPU; under the interpreter its
    float32 values, the specials the interpreter misreads restored (e4m3fn: NaN at every exponent
    and mantissa bit set; e5m2: infinity and NaN at every exponent bit set)."""
    if EMULATED:
        bits = x.to(tl.uint8, bitcast=True)
        values = x.to(tl.float32)
        if x.dtype == tl.float8e5:
            top = (bits & 0x7C) == 0x7C
            infinity = tl.where((bits & 0x80) != 0, float("-inf"), float("inf"))
            special = tl.where((bits & 0x03) == 0, infinity, float("nan"))
        else:
            top = (bits & 0x7F) == 0x7F
            special = float("nan")
        return tl.where(top, special, values)
    else:
        return x


@triton.jit
def on_e4m3_grid(x):
    """float32 ``x`` rounded to the nearest float8_e4m3fn value, ties to even, kept in float32;
    past ±448 (infinities too) ±448, NaN kept.

    The e4m3 values near |x| in [2^e, 2^(e+1)) lie 2^(e-3) apart, and never closer than the
    subnormals' 2^-9. Adding and taking away 1.5 * 2^(step + 23) rounds x to a multiple of 2^step in
    float32's own round-to-nearest-even: |x| < 2^(step + 4) is far inside that constant's ulp range."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = tl.maximum(tl.minimum(exponent, 8) - 3, -9)  # capped at 448's exponent: inf and NaN saturate below
    shifter = ((step + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    rounded = (x + shifter) - shifter
    return tl.where(tl.abs(x) > E4M3_MAX, tl.where(x < 0, -E4M3_MAX, E4M3_MAX), rounded)


@triton.jit
def e4m3_weights(p, EMULATED: tl.constexpr):
    """The weights P (float32, in [0, 1]) rounded to e4m3 for their product with V: the GPU's
    conversion, or ``on_e4m3_grid`` in float32 under the interpreter."""
    if EMULATED:
        return on_e4m3_grid(p)
    else:
        return p.to(tl.float8e4nv)


@triton.jit
def quantized_e4m3(x, EMULATED: tl.constexpr):
    """float32 ``x`` as float8_e4m3fn by the contract's rule for new cache tokens: to the nearest
    value, ties to even, magnitudes past 448 (infinities too) saturated to ±448, NaN kept.

    The saturation is explicit rather than left to the conversion (sm_90's is saturating, but a
    conversion without it turns an overflow into NaN). Under the interpreter the value is rounded
    by ``on_e4m3_grid`` first, which the interpreter's conversion then carries over exactly; NaN,
    which that conversion makes finite, is written as the canonical NaN byte."""
    if EMULATED:
        rounded = on_e4m3_grid(x)
        bits = rounded.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(x != x, 0x7F, bits).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        return tl.where(tl.abs(x) > E4M3_MAX, tl.where(x < 0, -E4M3_MAX, E4M3_MAX), x).to(tl.float8e4nv)


@triton.jit
def cache_values(x, dtype: tl.constexpr, FP8: tl.constexpr, KEEP_LAYOUT: tl.constexpr):
    """A tile of a decoding cache in the queries' 16-bit ``dtype``: an FP8 cache's widened (exact:
    bfloat16 and float16 hold every e4m3 value), any other as loaded.

    On the GPU an e4m3 tile is widened four bytes at a time by ``_e4m3_widened``. KEEP_LAYOUT
    widens it in the layout it is loaded in, so that a tile whose keys the tensor cores want
    paired (V's, features contiguous) reaches its product as 16-bit values, through
    ldmatrix.trans, rather than as bytes read one at a time from shared memory."""
    if FP8 == "native":
        return _e4m3_widened(x, dtype, KEEP_LAYOUT)
    elif FP8 == "emulated":
        return widened(x, True).to(dtype)
    else:
        return x


@triton.jit
def _e4m3_widened(x, dtype: tl.constexpr, KEEP_LAYOUT: tl.constexpr):
    """An e4m3 tile in float16 or bfloat16, by sm_89+'s pair conversion to float16 (NaN kept) and,
    for bfloat16, through float32: float16 to float32 on the FMA pipe and a pair rounding to
    bfloat16, exact, where Triton's own conversion takes one F2F per element (16 a clock per SM
    on sm_90 in the CUDA guide's table, a quarter of the integer ALU's rate).

    Triton moves a dot operand's layout change up through pure one-operand inline asm, to the
    tile's load; a tile that must keep its loaded layout (KEEP_LAYOUT) is widened by asm marked
    impure, which it leaves in place."""
    bits = x.to(tl.uint8, bitcast=True)
    if dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("""{
        .reg .b16 pair<2>, half<4>;
        .reg .b32 halves<2>;
        .reg .f32 single<4>;
        mov.b32 {pair0, pair1}, $2;
        cvt.rn.f16x2.e4m3x2 halves0, pair0;
        cvt.rn.f16x2.e4m3x2 halves1, pair1;
        mov.b32 {half0, half1}, halves0;
        mov.b32 {half2, half3}, halves1;
        cvt.f32.f16 single0, half0;
        cvt.f32.f16 single1, half1;
        cvt.f32.f16 single2, half2;
        cvt.f32.f16 single3, half3;
        cvt.rn.bf16x2.f32 $0, single1, single0;
        cvt.rn.bf16x2.f32 $1, single3, single2;
        }""", "=r,=r,r", [bits], dtype=tl.bfloat16, is_pure=not KEEP_LAYOUT, pack=4)
    else:
        return tl.inline_asm_elementwise("""{
        .reg .b16 pair<2>;
        mov.b32 {pair0, pair1}, $2;
        cvt.rn.f16x2.e4m3x2 $0, pair0;
        cvt.rn.f16x2.e4m3x2 $1, pair1;
        }""", "=r,=r,r", [bits], dtype=tl.float16, is_pure=not KEEP_LAYOUT, pack=4)


@triton.jit
def descale_factors(Q_DESCALE, K_DESCALE, V_DESCALE, index):
    """(the factor of a raw score q8 . k8, the factor of o) for the sequence and key/value head at
    ``index`` (b * Hk + h_k) of the (B, Hk) descales; a descale that is None is 1."""
    scores = 1.0
    out = 1.0
    if Q_DESCALE is not None:
        scores = tl.load(Q_DESCALE + index)
    if K_DESCALE is not None:
        scores = scores * tl.load(K_DESCALE + index)
    if V_DESCALE is not None:
        out = tl.load(V_DESCALE + index)
    return scores, out


#: Keys a masked tile of V may read past the last key it uses (``readable_keys``): its mask is
#: constant over groups of this many keys, the 16 bytes of one vector load.
KEY_GROUP = tl.constexpr(16)


@triton.jit
def readable_keys(cols, end):
    """The rows of a tile of V (keys contiguous) that a masked tile loads: every 16-key group
    that starts before ``end``, the end of the keys any row of the tile uses.

    A mask that changes inside a 16-byte group of keys splits V's copy into single bytes, outside
    the software pipeline (Triton for sm_90: ld.global.b8 through registers where cp.async copies
    16 bytes). Up to 15 keys past ``end`` are read instead, which ``keys_contiguous`` keeps inside
    V's memory; no weight reaches them (exp2(-inf) = 0), so a finite value there adds 0, and a
    non-finite one (a neighbouring sequence's, or seqlens' padding) makes the plain launch's acc
    non-finite, which its exact relaunch, whose products mask V themselves (``masked_dot``),
    computes again. Tile starts must be multiples of 16 that the compiler sees as such."""
    return cols < tl.cdiv(end, KEY_GROUP) * KEY_GROUP


def keys_contiguous(v: torch.Tensor, varlen: bool) -> torch.Tensor:
    """V of a (B, N, H, Dv) or varlen (T, H, Dv) layout as a view of the same shape whose key (row)
    axis has stride 1, copied there unless it already is and has ``KEY_GROUP`` - 1 keys of memory
    after its last element.

    Hopper's FP8 tensor-core product takes its second operand K-major, and in P @ V the reduced
    axis is the keys': V's tile must reach shared memory with its keys contiguous. A row-major
    tile is transposed through registers instead, and its loads leave the software pipeline
    (Triton 3.9 for sm_90: byte-wide shared stores, no cp.async for V). The copy is one pass over
    V, 2 bytes an element, against the forward's 2 * D multiply-adds for each. Each (head,
    feature) row of keys is followed by at least 16 zero keys and starts 16-byte aligned, for
    vector loads and for masked tiles' reads past a sequence's end (``readable_keys``)."""
    rows = 0 if varlen else 1
    if v.stride(rows) == 1 and _memory_after(v) >= KEY_GROUP.value - 1:
        return v
    order = (1, 2, 0) if varlen else (0, 2, 3, 1)  # keys last
    keys = v.shape[rows]
    group = KEY_GROUP.value
    padded = torch.empty((*(v.shape[axis] for axis in order[:-1]), (-(-keys // group) + 1) * group), dtype=v.dtype,
                         device=v.device)
    padded[..., keys:].view(torch.uint8).zero_()  # a NaN there would send tiles to the exact relaunch
    padded[..., :keys].copy_(v.permute(order))
    back = (2, 0, 1) if varlen else (0, 3, 1, 2)
    return padded[..., :keys].permute(back)


def _memory_after(x: torch.Tensor) -> int:
    """Elements of x's storage after its last element."""
    last = x.storage_offset() + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    return x.untyped_storage().nbytes() // x.element_size() - 1 - last


def negated(x: torch.Tensor) -> torch.Tensor:
    """-x for an FP8 tensor, which torch cannot negate: its sign bits flipped, exact (NaN stays NaN)."""
    return (x.view(torch.uint8) ^ 0x80).view(x.dtype)
