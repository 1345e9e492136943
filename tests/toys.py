"""Dense toy backends, each with one deliberate flaw, to prove the conformance suite catches it.

``Correct`` is plain attention in float64 (the conformance oracle behind the backend protocol);
each subclass breaks it the way a real kernel goes wrong.
"""

from __future__ import annotations

import math

import numpy as np
from flashx_conformance import oracle

import flashx

TAIL_BLOCK = 16  # the key tile of the imaginary kernel whose tail is not masked


class Correct(flashx.Backend):
    """The control: the same dense backend with no flaw."""

    name = "toy-correct"
    array_kind = "numpy"
    devices = frozenset({"cpu"})
    dtypes = frozenset({"float32", "float64"})

    def forward(self, problem, q, k, v):
        o, lse = self.forward64(problem, *_as64(q, k, v))
        return o.astype(q.dtype), lse.astype(problem.lse_dtype)

    def backward(self, problem, q, k, v, o, lse, do):
        grads = self.backward64(problem, *_as64(do, q, k, v))
        return tuple(g.astype(q.dtype) for g in grads)

    def options(self, problem) -> dict:
        """The problem as the oracle's keywords."""
        return {name: getattr(problem, name) for name in oracle.OPTIONS}

    def forward64(self, problem, q, k, v):
        return oracle.forward(q, k, v, **self.options(problem))

    def backward64(self, problem, do, q, k, v):
        return oracle.backward(do, q, k, v, **self.options(problem))


class StoredLse(Correct):
    """The control as a recomputing kernel runs it: the backward rebuilds P = exp(S - lse) from
    the float32 lse the forward returned, exact in every other step.

    Row i's rebuilt weights are its exact ones times r_i = exp(lse_i - stored lse_i), and every
    gradient is linear in each row's weights, dO and delta included: the gradients are the exact
    ones of dO scaled by r."""

    name = "toy-stored-lse"

    def backward(self, problem, q, k, v, o, lse, do):
        exact = self.forward64(problem, *_as64(q, k, v))[1]
        with np.errstate(invalid="ignore"):  # -inf - -inf at empty rows, which read nothing
            weights = np.where(np.isfinite(lse), np.exp(exact - self.rebuilt_from(lse)), 1.0)
        return super().backward(problem, q, k, v, o, lse, do * np.swapaxes(weights, -1, -2)[..., None])

    def rebuilt_from(self, lse):
        """The lse the backward computes its weights with."""
        return np.asarray(lse, dtype=np.float64)


class LossyBackwardLse(StoredLse):
    """The backward loses the 4 lowest bits of the float32 lse it rebuilds P from, as a
    conversion through a narrower intermediate would: 16 times the rounding the contract allows."""

    name = "toy-lossy-backward-lse"

    def rebuilt_from(self, lse):
        lse = np.asarray(lse, dtype=np.float32)
        return (lse.view(np.int32) & ~np.int32(15)).view(np.float32).astype(np.float64)


class UnmaskedTail(Correct):
    """Keys past Nk in the last partial tile are loaded as zeros and never masked: they score 0."""

    name = "toy-unmasked-tail"

    def forward64(self, problem, q, k, v):
        missing = -problem.seqlen_k % TAIL_BLOCK
        pad = [(0, 0)] * k.ndim
        pad[-3] = (0, missing)
        return super().forward64(problem, q, np.pad(k, pad), np.pad(v, pad))


class Base2Lse(Correct):
    """Returns the log-sum-exp in base 2, as kernels working with exp2 keep it internally."""

    name = "toy-base2-lse"

    def forward64(self, problem, q, k, v):
        o, lse = super().forward64(problem, q, k, v)
        return o, lse / math.log(2)


class TopLeftCausal(Correct):
    """Aligns causal masks at the top left (key j allowed for query i iff j <= i), as SDPA's is_causal."""

    name = "toy-top-left-causal"

    def options(self, problem):
        options = super().options(problem)
        if options.pop("causal"):
            top_left = np.tri(problem.seqlen_q, problem.seqlen_k, dtype=bool)
            options["mask"] = top_left if problem.mask is None else top_left & problem.mask
        return options


class UnscaledDropout(Correct):
    """Drops probabilities without rescaling the kept ones by 1 / (1 - p)."""

    name = "toy-unscaled-dropout"

    # Without the rescale the output is (1 - p) times the correct one, so are its gradients.
    def forward64(self, problem, q, k, v):
        o, lse = super().forward64(problem, q, k, v)
        return o * (1 - problem.dropout_p), lse

    def backward64(self, problem, do, q, k, v):
        return tuple(g * (1 - problem.dropout_p) for g in super().backward64(problem, do, q, k, v))


class NanEmptyRows(Correct):
    """Normalises every row by its sum, which is 0 / 0 for a row with no allowed key."""

    name = "toy-nan-empty-rows"

    def forward64(self, problem, q, k, v):
        o, lse = super().forward64(problem, q, k, v)
        empty = np.swapaxes(lse, -1, -2) == -np.inf  # lse (..., H, N) against o (..., N, H, Dv)
        return np.where(empty[..., None], np.nan, o), lse


class GqaFirstHeadOnly(Correct):
    """Writes dK/dV from the first query head of each group instead of summing over the group."""

    name = "toy-gqa-first-head"

    def backward64(self, problem, do, q, k, v):
        group = problem.group
        dq, dk, dv = super().backward64(problem, do, q, np.repeat(k, group, axis=-2), np.repeat(v, group, axis=-2))
        return dq, dk[..., ::group, :], dv[..., ::group, :]


def _as64(*arrays):
    return (np.asarray(x, dtype=np.float64) for x in arrays)
