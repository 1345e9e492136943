"""The contract's exactness rule (Numerics section), with failures that say where and by how much.

For each output X of a backend in input dtype t:
    max|X - X_ref| <= k * max|X_naive_t - X_ref| + floor_t       k = 2 for o and lse, 3 for dq, dk, dv
    ||X - X_ref|| / ||X_ref|| <= r_t + e_X      r_t = 1e-5 (float32), 1e-2 (bfloat16), 2e-3 (float16)
X_ref is the float64 oracle; for float64 backends, whose error the float64 oracle cannot
measure, it is the oracle in extended precision (``np.longdouble``). X_naive_t is plain
attention in dtype t (``oracle.naive``, the larger error of its two formulations) and floor_t
is this suite's reading of "the rounding noise of dtype t at the magnitude of X":
    floor_t = (eps_t / 2 + ACCUMULATION_ULPS * eps_acc) * max T_X
T_X (``oracle.term_magnitudes``) sums the absolute values of the terms summed into X, so
T_X >= |X| and the floor is at least the contract's max|round_t(X_ref) - X_ref|. For lse it is
|lse| plus the P-weighted magnitude of the scores' dot-product terms: a score rounds at the
magnitude of its terms, and a row of one key has the lse of its one score, however it cancels.
eps_acc is the epsilon of the accumulation dtype (float32 for 16-bit and float32 inputs, float64
for float64).
Without these two refinements a gradient that cancels to 0 (one key per row: dS = P (dP -
delta) = 0) or an output the naive computation gets exact by its structure (P = 1, dv = dO)
would have to be bit-exact in every kernel, and a float32 kernel, which accumulates in the
input precision, would be held to 2x a naive computation in that same precision, a ratio
that tiling alone can exceed. For the same reason the relative-norm bound of dq, dk, dv
divides by ||T_X|| rather than ||X_ref||: on a small problem a gradient that nearly cancels
has a norm at the level of its own rounding noise.
o, dq, dk and dv have one more term: eps_acc / 2 * max|lse| * max T_X, the rounding of an
exponent at the scores' magnitude (|lse| >= the largest scaled score of a row).
- P = exp(scale * s - m) errs relatively by the absolute error of its argument. That error
  grows with |scale * s|, and summation order moves it: on a one-row problem plain attention
  can happen to get it nearly right.
- The backward recomputes P from an lse the contract stores in float32 (float64 for float64
  inputs): up to half an ulp of |lse|, an error plain attention never makes (its largest P
  is exp(0) exactly).
At one query row and |lse| ~ 24, either errs by ~8 float32 ulps, past the floor above.
The relative-norm bound of these outputs grows by the same relative error of P, e_X =
eps_acc / 2 * max|lse| (the contract's Numerics section). The lse's rounding is one number per
row, shared by all its weights, so it does not average out over a row's keys: on rows that one
key dominates, dv's error is the rounding itself. Over scores hundreds apart (|lse| ~ 1000) a
backward exact in every step but the float32 lse it is handed errs by 1.4e-5 in dv's relative
norm, past r_t alone; an lse carried with fewer bits than float32's still fails.
Below the smallest normal number of a dtype, rounding is absolute, not relative: a value there
rounds to a multiple of the dtype's subnormal spacing s_t (eps_t times its smallest normal: 2^-24
for float16), off by up to s_t / 2 however small it is (the standard model with underflow:
round(x) = x (1 + d) + e, |d| <= eps_t / 2, |e| <= s_t / 2, d e = 0). eps_t / 2 * T_X holds d;
no multiple of T_X holds e. So the floor (at its largest element) and the relative-norm bound (by
its norm) take e as an error of its own, element by element:
- s_out / 2 where X_ref lies below its storage's normal range: X's own rounding (s_out of the
  output's storage dtype: float32 for the lse and dsinks of 16-bit inputs). Without it the floor
  would not reach the contract's max|round_t(X_ref) - X_ref| for a subnormal X.
- s_t / 2 * U_X (``oracle.subnormal_magnitudes``): the rounding of the values of dtype t that X
  is computed from. The contract stores o in t, and the backward reads it back for delta_i =
  dot(o_i, do_i): a subnormal o_ie moves delta_i by up to s_t / 2 |do_ie|, and so every
  dS_ij = P_ij (dP_ij - delta_i) of the row by P_ij times that. A kernel on 16-bit tensor cores
  also rounds P (for o and dv) and dS (for dq and dk) to t as operands. U_X sums, over the terms
  of X, the factors that multiply such a value where the oracle's value is subnormal; for dq_i:
  |scale| sum_j (P_ij sum_e |do_ie| [o_ie subnormal] + [dS_ij subnormal]) |k_j|. The sums of
  absolute values are worst cases, as T_X is.
This is what float16 rows that dropout leaves with a tiny output make of dq and dk: where the
dominant key is dropped, o is the other key's weight (1e-11 to 1e-7) times v, and the rounding
of o alone moves dq and dk by as much as their own size (test_dropout_leaves_tiny_outputs). Wherever
values are normal the terms are negligible: per unit, s_t / 2 = 3e-8 for float16 against eps_t /
2 = 5e-4 of T_X (on ordinary float16 cases 1e-8 to 1e-5 against floors of 1e-3 to 1); for the
other dtypes they are nil.
Non-finite values must match exactly: NaN where the reference has NaN, the same infinities.
FP8 inputs (the contract's FP8 section) are judged on o and lse against X_naive = plain attention
in FP8 (``oracle.naive_fp8``), with the floor of the output dtype and no relative-norm bound.
"""

from __future__ import annotations

import numpy as np

FACTOR = {"o": 2, "lse": 2, "dq": 3, "dk": 3, "dv": 3, "dsinks": 3}
#: The gradients: they cancel, so their relative-norm bound divides by the norm of their terms.
GRADIENTS = ("dq", "dk", "dv", "dsinks")
RELATIVE_NORM_BOUND = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
ACCUMULATION_ULPS = 4
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
ACCUMULATION_EPS = {"float16": EPS["float32"], "bfloat16": EPS["float32"], "float32": EPS["float32"], "float64": EPS["float64"]}
SMALLEST_NORMAL = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126, "float64": 2.0**-1022}
#: The spacing of subnormal numbers, s_t: below SMALLEST_NORMAL a value rounds to a multiple of it.
SUBNORMAL_SPACING = {dtype: EPS[dtype] * SMALLEST_NORMAL[dtype] for dtype in EPS}

#: The names of the axes of each output, to say where an element is.
AXES = {
    "padded": {"o": "bihd", "lse": "bhi", "dq": "bihd", "dk": "bjhd", "dv": "bjhd", "dsinks": "h"},
    "varlen": {"o": "thd", "lse": "ht", "dq": "thd", "dk": "thd", "dv": "thd", "dsinks": "h"},
}


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to ``dtype`` (round to nearest even), returned as float64."""
    x = np.asarray(x)
    if dtype == "bfloat16" or dtype.startswith("float8"):  # dtypes NumPy lacks
        import torch

        return torch.from_numpy(x.astype(np.float64)).to(getattr(torch, dtype)).double().numpy()
    return x.astype(dtype).astype(np.float64)


def reference_precision(dtype: str):
    """The NumPy type the oracle computes in to judge a backend running in ``dtype``."""
    if dtype == "float64" and np.finfo(np.longdouble).eps < np.finfo(np.float64).eps:
        return np.longdouble
    return np.float64


def where(index, axes: str) -> str:
    return "(" + ", ".join(f"{axis}={i}" for axis, i in zip(axes, index)) + ")"


def storage(name: str, dtype: str) -> str:
    """The dtype output ``name`` is stored in for inputs in ``dtype`` (the contract's Shapes section)."""
    if name in ("lse", "dsinks"):
        return "float64" if dtype == "float64" else "float32"
    return dtype


def judge(name: str, actual, expected, naive: list, terms, dtype: str, axes: str, relative_norm: bool = True,
          lse_magnitude: float = 0.0, subnormal=None) -> str | None:
    """None if ``actual`` meets the rule for output ``name``, else a readable account of why not.

    ``naive`` lists plain computations in ``dtype`` (formulations); the largest error counts.
    ``terms``: T_X of the floor. ``relative_norm=False`` drops the relative-norm bound, for
    cases where no kernel can meet it. ``lse_magnitude``: max |lse| of the oracle, for the
    floor and the relative-norm bound of every output but lse. ``subnormal``: U_X, the
    magnitudes of the 16-bit intermediates' subnormal rounding (None: only X's own rounding).
    """
    with np.errstate(invalid="ignore"):  # inf - inf where both are infinite: compared exactly below
        actual, expected, terms = np.asarray(actual), np.asarray(expected), np.asarray(terms)
        subnormal = np.zeros(expected.shape) if subnormal is None else np.asarray(subnormal)
        return _judge(name, actual, expected, [np.asarray(x) for x in naive], terms, dtype, axes, relative_norm,
                      lse_magnitude, subnormal)


def _judge(name, actual, expected, naive, terms, dtype, axes, relative_norm, lse_magnitude, subnormal):
    if actual.shape != expected.shape:
        return f"{name}: shape {actual.shape}, expected {expected.shape}"
    finite = np.isfinite(expected)
    mismatch = np.isfinite(actual) != finite
    mismatch |= ~finite & ~((actual == expected) | (np.isnan(actual) & np.isnan(expected)))
    if mismatch.any():
        index = tuple(int(i) for i in np.argwhere(mismatch)[0])
        return (
            f"{name}: {int(mismatch.sum())} of {mismatch.size} elements differ in finiteness from the oracle, "
            f"first at {where(index, axes)}: got {actual[index]}, oracle {expected[index]}"
        )
    if not finite.any():
        return None
    error = np.where(finite, np.abs(actual - expected), 0)
    index = np.unravel_index(int(np.argmax(error)), error.shape)
    max_error = error[index]
    naive_error = max(np.where(finite & np.isfinite(x), np.abs(x - expected), 0).max() for x in naive)
    exact = np.where(finite, expected, 0)
    magnitude = np.where(np.isfinite(terms), terms, 0).max()
    # exponents rounded at the scores' magnitude (module docstring): a relative error of P
    weights = 0.0 if name == "lse" else ACCUMULATION_EPS[dtype] / 2 * lse_magnitude
    # rounding below the normal range is absolute (module docstring): per element, X's own and
    # that of the 16-bit values carried into it
    out = storage(name, dtype)
    below = SUBNORMAL_SPACING[out] / 2 * (finite & (np.abs(exact) < SMALLEST_NORMAL[out]))
    absolute = below + SUBNORMAL_SPACING[dtype] / 2 * np.where(finite & np.isfinite(subnormal), subnormal, 0)
    floor = (EPS[dtype] / 2 + ACCUMULATION_ULPS * ACCUMULATION_EPS[dtype] + weights) * magnitude + absolute.max()
    allowed = FACTOR[name] * naive_error + floor
    problems = []
    if max_error > allowed:
        problems.append(
            f"max |error| {float(max_error):.3e} > allowed {float(allowed):.3e} "
            f"= {FACTOR[name]} x naive {dtype} error {float(naive_error):.3e} + {dtype} rounding floor {float(floor):.3e}; "
            f"worst at {where(index, axes)}: got {float(actual[index])!r}, oracle {float(expected[index])!r}"
        )
    bound = RELATIVE_NORM_BOUND[dtype] + weights if relative_norm and dtype in RELATIVE_NORM_BOUND else None
    # gradients cancel (the terms of dS sum to 0 over a row): their noise scales with their terms
    scale = np.where(np.isfinite(terms), terms, 0) if name in GRADIENTS else exact
    norm = np.sqrt((scale * scale).sum())
    # Below the smallest normal number of the output's storage (float16's for float16 o and
    # gradients, float32's otherwise: bfloat16 has its range) an output has no relative precision.
    cutoff = np.float16 if storage(name, dtype) == "float16" else np.float32
    if bound is not None and norm > np.finfo(cutoff).tiny:
        relative = np.sqrt((error * error).sum()) / norm
        bound += np.sqrt((absolute * absolute).sum()) / norm  # absolute errors: a share of no norm
        if relative > bound:
            problems.append(f"relative norm error {float(relative):.3e} > {bound:.3g} (max |error| {float(max_error):.3e} at {where(index, axes)})")
    return f"{name}: " + "; ".join(problems) if problems else None


def judge_exact(name: str, actual, value, selected, axes: str, why: str) -> str | None:
    """None if ``actual`` equals ``value`` (a number or an array, broadcast; NaN equals NaN)
    exactly wherever ``selected`` (broadcast) holds."""
    actual = np.asarray(actual)
    selected = np.broadcast_to(selected, actual.shape)
    value = np.broadcast_to(value, actual.shape)
    wrong = selected & ~((actual == value) | (np.isnan(actual) & np.isnan(value)))
    if not wrong.any():
        return None
    index = tuple(int(i) for i in np.argwhere(wrong)[0])
    return (f"{name}: {int(wrong.sum())} elements are not exactly {value[index]} ({why}), first at "
            f"{where(index, axes)}: got {actual[index]}")
