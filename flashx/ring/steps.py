"""Steps: the backend calls of one rank at each step of the ring, planned once and run forward
and backward.

At a step a rank attends its queries to the K/V shard of one source rank. For each pair of a
query chunk of its shard and a key chunk of the source's, the sequences that join them give the
step's calls (``flashx.ring.sequences``), each a plain flashx backend call on slices of the
shards, validated and dispatched once when the ring call starts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from flashx.api import merge_weights
from flashx.execute import run_backward, run_forward
from flashx.options import complete
from flashx.plan import plan
from flashx.problem import Problem
from flashx.ring.layouts import chunks
from flashx.ring.sequences import Sequences


@dataclass(frozen=True)
class _Call:
    """One backend call of a step: query rows ``rows`` of the shard against keys ``keys`` of the
    K/V shard held (of every batch entry, or of the packed axis), planned once."""

    rows: slice
    keys: slice
    batch: object  # index of the batch axis: every entry (padded) or the one packed axis (then dropped)
    problem: Problem
    impl: object


class Rank:
    """One rank's part of a ring call: for the K/V shard of each source rank, the calls of its step.
    Calls are planned (validated, a backend chosen) once, from this rank's shards, whose shapes
    every source's shard shares."""

    def __init__(self, index: int, world_size: int, layout: str, problem: Problem, sequences: Sequences, backend,
                 q, k, v):
        self.index = index
        length = q.shape[1] * world_size
        mine = chunks(layout, world_size, index, length, sequences.offsets)
        common = {"softmax_scale": problem.softmax_scale, "softcap": problem.softcap, "dropout_p": problem.dropout_p,
                  "seed": problem.seed, "rng_offset": problem.rng_offset}
        batch = 0 if sequences.packed else slice(None)
        self.calls = []
        for source in range(world_size):
            calls = []
            theirs = chunks(layout, world_size, source, length, sequences.offsets)
            for query_chunk, key_chunk in itertools.product(mine, theirs):
                fragments = sequences.fragments(problem.band, query_chunk, key_chunk, problem.dropout_p > 0)
                for rows, keys, window, offsets, lengths in sequences.calls(fragments):
                    lengths = {name: torch.tensor(x, dtype=torch.int32, device=q.device) for name, x in lengths.items()}
                    options = complete("ring_attention", dict(common, window=window, dropout_offsets=offsets, **lengths))
                    calls.append(_Call(rows, keys, batch, *plan(q[batch, rows], k[batch, keys], v[batch, keys],
                                                                 backend, options)))
            self.calls.append(calls)

    def forward_step(self, q, k, v, source: int, o, lse) -> None:
        """Fold the attention of this rank's queries to ``source``'s K/V shard into (o, lse)."""
        for call in self.calls[source]:
            rows, lse_rows = (call.batch, call.rows), (call.batch, slice(None), call.rows)
            o_part, lse_part = run_forward(call.impl, call.problem, q[rows], k[call.batch, call.keys],
                                           v[call.batch, call.keys])
            # merge_states's arithmetic, written into the running sums where they lie: no merged
            # copy of o to allocate and copy back, a pass over the rows' float32 o fewer
            weight, weight_part, lse[lse_rows] = merge_weights(torch, lse[lse_rows], lse_part)
            o[rows].mul_(weight).add_(o_part * weight_part)

    def backward_parts(self, q, k, v, o, lse, do, source: int, dq) -> Iterator[tuple]:
        """Add each call's part of dq to ``dq``, and yield (keys index, its dk part, its dv part)
        for ``source``'s shard, one call at a time."""
        for call in self.calls[source]:
            rows, keys = (call.batch, call.rows), (call.batch, call.keys)
            dq_part, dk_part, dv_part = run_backward(call.impl, call.problem, q[rows], k[keys], v[keys], o[rows],
                                                     lse[call.batch, :, call.rows], do[rows])
            dq[rows] += dq_part
            yield keys, dk_part, dv_part
