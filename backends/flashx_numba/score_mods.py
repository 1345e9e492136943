"""The contract's score modifications as device functions: softcap and ALiBi on one scaled score,
the softcap's derivative, and a row's sink joined to its keys' softmax.

softcap and ALiBi change a score before the masks select it, so each kernel applies ``modify``
where it scales a score, the backward to the same scores it recomputes; the kernels are compiled
with and without them (``kernels``), so plain calls run the code they ran before. A sink is no
score: it joins a row's running maximum and sum once, after its last key tile (``with_sink``), and
its gradient needs only lse and delta, per row (``sink_term``).

A softcap of 0 stands for none (the contract's softcaps are positive), a slope of 0 for no ALiBi
(``- 0 * distance`` leaves every score as it was), a sink of -inf for no sink (exactly, as the
contract says: ``with_sink`` then gives the keys' lse and weights bit for bit).
"""

from __future__ import annotations

import math

import numpy as np

from flashx_numba.primitives import device_function, max_nan


@device_function
def modify(score, softcap, slope, distance):
    """(S, tanh(S_scaled / c)): the scaled score ``score`` after softcap and ALiBi, for a query
    ``distance`` (i + Lk - Lq - j) from the key; tanh is 0 without a softcap."""
    capped = np.float32(0)
    if softcap != 0:
        capped = math.tanh(score / softcap)
        score = softcap * capped
    return score - slope * np.float32(abs(distance)), capped


@device_function
def through_softcap(ds, capped, softcap):
    """dS of a modified score -> dS of the scaled score: times 1 - tanh^2. Where tanh saturates
    the result is +0, never -0 (the weight SKIP): the pair still multiplies its operands, and an
    infinite entry of q or k gives NaN there, as the contract's arithmetic does."""
    if softcap == 0:
        return ds
    return ds * (np.float32(1) - capped * capped) + np.float32(0)


@device_function
def with_sink(row_max, row_sum, sink, drop_scale):
    """(lse, factor) of a row with keys: its logsumexp with the sink, and what turns its keys'
    accumulator (in units of exp(row_max), as ``row_sum``) into o. The sink joins at the larger
    of row_max and itself, so that no exp overflows; a NaN or +inf sink gives NaN."""
    top = max_nan(row_max, sink)
    keys = math.exp(row_max - top)
    total = row_sum * keys + math.exp(sink - top)
    return top + math.log(total), drop_scale * keys / total


@device_function
def sink_term(sink, lse, delta):
    """A row's term of dsinks: -exp(sink - lse) * delta (the sink's probability, times the
    row's d o . o)."""
    return -math.exp(sink - lse) * delta
