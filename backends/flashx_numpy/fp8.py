"""FP8 in NumPy, which has no FP8 dtype (the contract's FP8 section).

Inputs arrive as uint8 views of their bits. ``dequantized`` decodes them through a table of the
256 values of their format and multiplies in the descale of their sequence and key/value head;
``round_e4m3`` rounds P onto the e4m3 grid for its product with V, as plain attention in FP8 does.
``quantized`` writes new tokens into an FP8 decoding cache by the contract's rule.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0


def _values(exponent_bits: int, mantissa_bits: int, ieee_specials: bool) -> np.ndarray:
    """The float32 value of each of the 256 bytes of a sign-exponent-mantissa format.

    ``ieee_specials``: the top exponent holds ±inf and NaN (e5m2); otherwise only the byte with
    every exponent and mantissa bit set is NaN, and the rest of the top exponent is finite (e4m3fn).
    """
    bits = np.arange(256)
    exponent = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = bits & ((1 << mantissa_bits) - 1)
    bias = (1 << (exponent_bits - 1)) - 1
    fraction = mantissa / (1 << mantissa_bits)
    magnitude = np.where(exponent == 0, fraction * 2.0 ** (1 - bias), (1 + fraction) * 2.0 ** (exponent - bias))
    top = exponent == (1 << exponent_bits) - 1
    if ieee_specials:
        magnitude = np.where(top, np.where(mantissa == 0, np.inf, np.nan), magnitude)
    else:
        magnitude = np.where(top & (mantissa == (1 << mantissa_bits) - 1), np.nan, magnitude)
    return np.where(bits & 0x80, -magnitude, magnitude).astype(np.float32)


#: dtype name -> the float32 value of each byte.
VALUES = {"float8_e4m3fn": _values(4, 3, ieee_specials=False), "float8_e5m2": _values(5, 2, ieee_specials=True)}
#: The non-negative float8_e4m3fn values in the order of their bytes 0 to 126: 0 up to 448, increasing.
_E4M3_MAGNITUDES = VALUES["float8_e4m3fn"][:127]


def decoded(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values of FP8 data given as its bytes (uint8, or any one-byte view of them)."""
    return VALUES[dtype][bits.view(np.uint8)]


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the nearest float8_e4m3fn value, ties to even; magnitudes past 448
    (infinities too) saturate to ±448, NaN stays NaN.

    Near x the e4m3 values lie 2**(e - 4) apart, x = m * 2**e with 0.5 <= |m| < 1 (three mantissa
    bits under the leading one), and never closer than the subnormals' 2**-9: x scaled to that
    grid is rounded half to even by ``rint``, and scaled back exactly.
    """
    _, exponent = np.frexp(x)
    step = np.maximum(exponent - 4, -9)
    with np.errstate(over="ignore", invalid="ignore"):  # past float32's range, and inf or NaN: saturated below
        rounded = np.ldexp(np.rint(np.ldexp(x, -step)), step)
    return np.clip(rounded, -E4M3_MAX, E4M3_MAX).astype(np.float32)


def quantized(x: np.ndarray, descale) -> np.ndarray:
    """The float8_e4m3fn bytes of new tokens x (N, Hk, D) under ``descale`` (Hk,) (None: 1): the
    float32 quotient x / descale rounded to e4m3, ties to even, saturating at ±448, NaN kept."""
    quotient = x.astype(np.float32)
    if descale is not None:
        quotient = quotient / np.asarray(descale, np.float32)[None, :, None]
    rounded = round_e4m3(quotient)
    magnitude = np.searchsorted(_E4M3_MAGNITUDES, np.abs(rounded)).astype(np.uint8)
    bits = magnitude | (np.signbit(rounded).astype(np.uint8) << 7)
    return np.where(np.isnan(rounded), np.uint8(0x7F), bits)


def dequantized(problem, q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v as float32 arrays in their layouts: each value times the descale of its sequence
    and key/value head (query head h reading that of head h // group)."""
    return (_dequantized(problem, q, problem.q_descale, problem.group, problem.cu_seqlens_q),
            _dequantized(problem, k, problem.k_descale, 1, problem.cu_seqlens_k),
            _dequantized(problem, v, problem.v_descale, 1, problem.cu_seqlens_k))


def _dequantized(problem, x, descale, group: int, cu_seqlens) -> np.ndarray:
    values = decoded(x, problem.dtype)
    if descale is None:
        return values
    factors = np.repeat(np.asarray(descale, np.float32), group, axis=1)  # (B, heads of x)
    if not problem.varlen:
        return values * factors[:, None, :, None]
    # row t of the packed layout belongs to sequence b = the number of sequences ending at or before it;
    # rows past the last sequence (b = B) are padding, never read: they take a factor of 1
    sequence = np.searchsorted(np.asarray(cu_seqlens, np.int64)[1:], np.arange(x.shape[0]), side="right")
    factors = np.concatenate([factors, np.ones((1, factors.shape[1]), np.float32)])[sequence]
    return values * factors[:, :, None]
