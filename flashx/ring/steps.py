"""Steps: the backend calls of one rank at each step of the ring, planned once and run forward
and backward.

At a step a rank attends its queries to the K/V shard of one source rank. For each pair of a
query chunk of its shard and a key chunk of the source's, the sequences that join them give the
step's calls (``flashx.ring.sequences``), each a flashx backend call on slices of the shards,
validated and dispatched once when the ring call starts (or kept from an earlier ring call of
the same description: ``Rank.planned``), that merges into the running (o, lse) and adds into the
running gradients where they lie (``flashx.accumulate``).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import torch

from flashx import arrays, registry
from flashx.accumulate import run_backward_into, run_forward_into
from flashx.options import complete
from flashx.plan import plan
from flashx.problem import Problem
from flashx.ring.heads import HeadGroup
from flashx.ring.layouts import chunks
from flashx.ring.sequences import Sequences


@dataclass(frozen=True)
class _Call:
    """One backend call of a step: query rows ``rows`` of the shard against keys ``keys`` of the
    K/V shard held (of every batch entry, or of one: the packed axis, or a padded entry served as a
    packed call), planned once."""

    rows: slice
    keys: slice
    batch: object  # index of the batch axis: every entry (a padded call) or one (a packed call: then dropped)
    problem: Problem
    impl: object


def _vouched(lengths: dict, device) -> dict:
    """A call's lengths (``Sequences.calls``: host lists) as the keywords of a call that reads
    none of them back: the device arrays, their longest sequences as the max_seqlen hints, and
    ``validate=False``. The ring made them from offsets it checked; each check would read a device
    array on the host, a synchronisation that leaves the GPU idle while the host plans."""
    vouched = {name: torch.tensor(x, dtype=torch.int32, device=device) for name, x in lengths.items()}
    for side in "qk":
        if f"cu_seqlens_{side}" in lengths:
            offsets = lengths[f"cu_seqlens_{side}"]
            vouched[f"max_seqlen_{side}"] = max(b - a for a, b in itertools.pairwise(offsets))
    return dict(vouched, validate=False)


class Rank:
    """One rank's part of a ring call: for the K/V shard of each source rank, the calls of its step.
    Calls are planned (validated, a backend chosen) once, from this rank's shards, whose shapes
    every source's shard shares; ``Rank.planned`` keeps them for later ring calls of the same
    description, such as every layer's of one training step. ``renumbered``: the head group whose
    sequences the calls renumber for dropout (``flashx.ring.heads``)."""

    KEPT = 16  # ring calls of distinct descriptions whose ranks ``planned`` keeps, the latest ones
    _kept: collections.OrderedDict = collections.OrderedDict()

    @classmethod
    def planned(cls, index: int, world_size: int, layout: str, problem: Problem, sequences: Sequences, backend,
                q, k, v, head_group: HeadGroup | None = None) -> Rank:
        """``Rank(...)``, or the one an earlier call of the same description made: the same rank,
        layout, problem (every field but the arrays' values, which the ring reads into
        ``sequences``, and the dropout seed and offset with them), sequences, backend, registered
        backends, head group, and shards' metadata. Planning a call of many documents takes the
        host milliseconds, while the GPU waits at its start. ``head_group``: the calls of its heads
        of the shards q, k, v; the groups of a call share one plan but where they renumber their
        sequences for dropout."""
        if head_group is not None:
            q, k, v = head_group.queries_of(q), head_group.keys_of(k), head_group.keys_of(v)
            if head_group.count == 1 or problem.dropout_p == 0:
                head_group = None  # the same calls for every group
        key = (index, world_size, layout, problem.static_key, problem.seed, problem.rng_offset, sequences, backend,
               registry.version(), head_group, *map(arrays.metadata, (q, k, v)))
        rank = cls._kept.pop(key, None) or cls(index, world_size, layout, problem, sequences, backend, q, k, v,
                                               renumbered=head_group)
        cls._kept[key] = rank
        while len(cls._kept) > cls.KEPT:
            cls._kept.popitem(last=False)
        return rank

    def __init__(self, index: int, world_size: int, layout: str, problem: Problem, sequences: Sequences, backend,
                 q, k, v, renumbered: HeadGroup | None = None):
        self.index = index
        length = q.shape[1] * world_size
        mine = chunks(layout, world_size, index, length, sequences.offsets)
        common = {"softmax_scale": problem.softmax_scale, "softcap": problem.softcap, "dropout_p": problem.dropout_p,
                  "seed": problem.seed, "rng_offset": problem.rng_offset}
        self.calls = []
        for source in range(world_size):
            calls = []
            theirs = chunks(layout, world_size, source, length, sequences.offsets)
            for query_chunk, key_chunk in itertools.product(mine, theirs):
                fragments = sequences.fragments(problem.band, query_chunk, key_chunk, problem.dropout_p > 0)
                for batch, rows, keys, window, offsets, lengths in sequences.calls(fragments, renumbered):
                    options = complete("ring_attention", dict(common, window=window, dropout_offsets=offsets,
                                                              **_vouched(lengths, q.device)))
                    calls.append(_Call(rows, keys, batch, *plan(q[batch, rows], k[batch, keys], v[batch, keys],
                                                                 backend, options)))
            self.calls.append(calls)

    def forward_step(self, q, k, v, source: int, o, lse) -> None:
        """Fold the attention of this rank's queries to ``source``'s K/V shard into (o, lse)."""
        for call in self.calls[source]:
            run_forward_into(call.impl, call.problem, q[call.batch, call.rows], k[call.batch, call.keys],
                             v[call.batch, call.keys], o[call.batch, call.rows], lse[call.batch, :, call.rows])

    def backward_first(self, q, k, v, o, lse, do, source: int, dq):
        """The step's first call, which runs while the dK/dV sums of ``source``'s shard may still be
        arriving: its dq added into ``dq``, its dk and dv into zeroed sums of its own keys.
        Returns (keys index, dk, dv) for ``backward_rest``, or None for a step without calls."""
        if not self.calls[source]:
            return None
        call = self.calls[source][0]
        keys = (call.batch, call.keys)
        dk, dv = (torch.zeros(x[keys].shape, dtype=dq.dtype, device=dq.device) for x in (k, v))
        self._backward(call, q, k, v, o, lse, do, dq, dk, dv)
        return keys, dk, dv

    def backward_rest(self, q, k, v, o, lse, do, source: int, dq, first, sums: tuple) -> None:
        """Add ``first`` (``backward_first``'s) into the shard's dK/dV ``sums``, then the step's
        other calls: dq into ``dq``, dk and dv into ``sums`` where their keys lie."""
        if first is None:
            return
        keys, dk_first, dv_first = first
        dk, dv = sums
        dk[keys] += dk_first
        dv[keys] += dv_first
        for call in self.calls[source][1:]:
            self._backward(call, q, k, v, o, lse, do, dq, dk[call.batch, call.keys], dv[call.batch, call.keys])

    @staticmethod
    def _backward(call: _Call, q, k, v, o, lse, do, dq, dk, dv) -> None:
        rows, keys = (call.batch, call.rows), (call.batch, call.keys)
        run_backward_into(call.impl, call.problem, q[rows], k[keys], v[keys], o[rows], lse[call.batch, :, call.rows],
                          do[rows], dq[rows], dk, dv)
