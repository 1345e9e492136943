"""Score modifications: how the sink, which belongs to no step, joins the ring.

A softcap acts on each score alone, so every step's call takes it. The sink belongs to no step:
the steps are computed without it, and each rank joins the sink's state (o = 0, lse = σ) into
its rows once, after the last step (``join_sink``), so the lse the backward recomputes from holds
it and dq, dk, dv need nothing more. dsinks is each rank's own rows' terms (``sink_gradient``),
reaching the caller's ``sinks`` through autograd; the ranks' parts add up to the whole
sequence's, as the parts of every parameter's gradient do under context parallelism (the
contract's Ring attention section says why no all-reduce). ALiBi is declined
(``flashx.ring.arguments``).
"""

from __future__ import annotations

import math

import torch


def join_sink(o, lse, sinks):
    """A rank's (o, lse) over every key, with the sink's state (o = 0, lse = σ) merged in once
    (the contract's "Merging partial results"), as the contract's softmax computes it: a NaN or
    +inf sink gives NaN rows, a row without keys keeps o = 0 and gets lse = σ."""
    sink = sinks[None, :, None]
    top = torch.maximum(lse, sink)
    top = torch.where(top == -math.inf, 0.0, top)
    joined = torch.where(lse == -math.inf, sink, top + torch.log(torch.exp(lse - top) + torch.exp(sink - top)))
    share = torch.where(lse == -math.inf, 0.0, torch.exp(lse - joined))  # the keys' part of each row's weight
    return o * share.transpose(1, 2)[..., None], joined


def sink_gradient(o, lse, do, keyless, sinks):
    """dsinks of one rank's rows: -sum over them of exp(σ_h - lse_i) * dot(o_i, do_i), over the
    rows that have a key (``keyless`` marks the others: padding, whatever their do holds)."""
    delta = (o.to(lse.dtype) * do.to(lse.dtype)).sum(-1).transpose(1, 2)  # (B, Hq, N/W)
    return -torch.where(keyless, 0.0, torch.exp(sinks[None, :, None] - lse) * delta).sum((0, 2))
