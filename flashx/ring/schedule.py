"""The ring schedule: every rank's steps in order, the K/V exchange between them, and the
torch.autograd Function that runs them forward and backward.

At step s rank r attends its queries to the K/V shard of rank r - s (``flashx.ring.steps``) and
folds the partial result into its running one, as the contract's "Merging partial results"
says. With ``exchange="ring"`` the K/V shards travel once around the ring of ranks, the next
shard already on its way while a step computes. The backward recomputes each step from the
global LSE; the dK/dV of a shard travel around the ring with it, each rank adding its part. The
backward starts each rank one shard back (the previous rank's, one hop it waits for) so that its
own shard comes last: a shard's sums then end their turn at its owner, which adds its part last.
So the one hop no step overlaps comes before the first step and carries K/V in the input dtype,
where a hop after the last would carry float32 sums, twice the bytes. ``exchange="all_gather"``
gathers every K/V shard at once instead (the step on the rank's own shard runs while the gather
is under way) and sums the dK/dV of every shard over the group at the end (a reduce-scatter):
the same steps, fewer and larger messages, memory for the whole sequence's K/V. The sink joins
each rank's rows once, after the last step (``flashx.ring.sinks``).

Memory. Partial results, dq and the travelling dK/dV are summed in the LSE's precision
(float32 for 16-bit inputs): each is a sum of W parts, and rounding the running sum to 16 bits
at every step would add an error that grows with W, which the contract's exactness rule does
not allow. What travels unchanged, the K/V shards, travels in the input dtype. The backward
holds two sets of dK/dV per rank, not three: a step's first call runs while the dK/dV of the
shard it reads are still arriving, its parts are then added into the arrived buffer, the step's
other calls add straight into it, and that buffer is sent on. In head groups
(``flashx.ring.heads``) the backward traverses the ring once per group of KV heads, its sums and
shards a group's, each group's sums written into the whole gradients once complete: 1/G of those
buffers for G traversals. ``peak_bytes_per_token`` (``flashx.ring.memory``) counts every buffer
of both exchanges.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch

from flashx.errors import OptionError
from flashx.ring.sinks import join_sink, sink_gradient
from flashx.ring.steps import Rank

#: how the K/V shards reach every rank
EXCHANGES = ("ring", "all_gather")


def check_exchange(exchange) -> None:
    """Raise ``OptionError`` unless ``exchange`` is one of ``EXCHANGES``."""
    if exchange not in EXCHANGES:
        raise OptionError(f"exchange: expected one of {', '.join(map(repr, EXCHANGES))}, got {exchange!r}")


class RingAttention(torch.autograd.Function):
    """Inputs: the ring, the caller's sinks (or None: their values are the ring's), then the q
    shards of its ranks, their k shards, their v shards. Outputs: the o shards, then the lse
    shards (not differentiable)."""

    @staticmethod
    def forward(ctx, ring: Ring, sinks, *tensors):
        count = len(ring.ranks)
        qs, ks, vs = tensors[:count], tensors[count : 2 * count], tensors[2 * count :]
        os, lses, keyless = ring.forward(qs, ks, vs)
        ctx.ring, ctx.sinks_dtype = ring, None if sinks is None else sinks.dtype
        ctx.save_for_backward(*tensors, *os, *lses, *keyless)
        ctx.mark_non_differentiable(*lses)
        ctx.set_materialize_grads(False)  # no zero tensor made for the lse's gradient
        return (*os, *lses)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        count = len(ctx.ring.ranks)
        saved = ctx.saved_tensors
        qs, ks, vs, os, lses, keyless = (saved[i * count : (i + 1) * count] for i in range(6))
        dos = [torch.zeros_like(o) if do is None else do for do, o in zip(grads[:count], os)]
        dqs, dks, dvs, dsinks = ctx.ring.backward(qs, ks, vs, os, lses, dos, keyless)
        dsinks = dsinks.to(ctx.sinks_dtype) if ctx.needs_input_grad[1] else None
        return (None, dsinks, *dqs, *dks, *dvs)


class Ring:
    """The ranks this process runs (one, or all of them in a simulation), the messages between
    them, the exchange of K/V ("ring" or "all_gather"), the sinks every row joins once (None:
    none), in the lse's dtype, and the backward's head groups (``flashx.ring.heads``): each
    ``HeadGroup`` with the ranks planned on its heads, one group of every head with ``ranks``."""

    def __init__(self, ranks: list[Rank], messages, exchange: str, sinks, head_groups: list[tuple]):
        self.ranks, self.messages, self.exchange, self.sinks = ranks, messages, exchange, sinks
        self.head_groups = head_groups
        self.world_size = len(ranks[0].calls)

    def source(self, rank: Rank, step: int, backward: bool) -> int:
        """The rank whose K/V shard ``rank`` reads at ``step`` (``key_values``)."""
        back = backward and self.exchange == "ring"
        return (rank.index - step - back) % self.world_size

    def key_values(self, shards: list, backward: bool = False) -> Iterator[list]:
        """Each step's K/V shard of every rank (``source``), the next one's already on its way. Two
        shards per rank are held, the one read and the one arriving, if the caller drops each
        step's shards before asking for the next (``_step``). The ring's backward starts from the
        previous rank's shard and ends with the rank's own, read where it is rather than received."""
        if self.exchange == "all_gather":
            gathered = self.messages.all_gather(shards)
            yield shards  # every rank's own shard while the others are gathered
            everything = gathered()
            for step in range(1, self.world_size):
                yield [theirs[self.source(rank, step, backward)] for rank, theirs in zip(self.ranks, everything)]
            return
        own, sent = shards, self.world_size - 1  # shifts: each rank's shard reaches the next W - 1 ranks
        if backward and self.world_size > 1:
            shards = self.messages.shift(list(own))()  # the hop before the first step, waited for
            sent -= 1
        for step in range(self.world_size):
            arriving = self.messages.shift(shards) if step < sent else None
            yield shards
            if arriving is not None:
                shards, arriving = arriving(), None  # the wait done, nothing holds the shards sent
            elif backward and step + 2 == self.world_size:
                shards = list(own)

    def forward(self, qs, ks, vs):
        accumulate = accumulation_dtype(qs[0])
        os = [torch.zeros(*q.shape[:-1], v.shape[-1], dtype=accumulate, device=q.device) for q, v in zip(qs, vs)]
        lses = [torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=accumulate, device=q.device)
                for q in qs]
        for step, shards in _step(self.key_values([(k.contiguous(), v.contiguous()) for k, v in zip(ks, vs)])):
            for rank, q, kv, o, lse in zip(self.ranks, qs, shards, os, lses):
                rank.forward_step(q, *kv, self.source(rank, step, False), o, lse)
            kv = None
        keyless = [lse == -math.inf for lse in lses]
        if self.sinks is not None:
            os, lses = zip(*(join_sink(o, lse, self.sinks) for o, lse in zip(os, lses)))
        return [o.to(q.dtype) for o, q in zip(os, qs)], list(lses), keyless

    def backward(self, qs, ks, vs, os, lses, dos, keyless):
        """dq, dk, dv of every rank in the inputs' dtype, and dsinks (None without sinks). One head
        group's sums are the gradients, converted; more groups' are written into gradients made
        first, each group's once summed, and dropped before the next group's are made."""
        if len(self.head_groups) == 1:
            ((_, ranks),) = self.head_groups
            sums = self._backward_heads(ranks, qs, ks, vs, os, lses, dos)
            grads = [[x.to(like.dtype) for x, like in zip(xs, likes)] for xs, likes in zip(sums, (qs, ks, vs))]
        else:
            grads = [[torch.empty_like(x) for x in xs] for xs in (qs, ks, vs)]
            for group, ranks in self.head_groups:
                heads = [[of(x) for x in xs] for of, xs in ((group.queries_of, qs), (group.keys_of, ks),
                                                            (group.keys_of, vs), (group.queries_of, os),
                                                            (group.lse_of, lses), (group.queries_of, dos))]
                _write_heads(group, self._backward_heads(ranks, *heads), grads)
        dsinks = None
        if self.sinks is not None:
            dsinks = sum(map(sink_gradient, os, lses, dos, keyless, itertools.repeat(self.sinks)))
        return (*grads, dsinks)

    def _backward_heads(self, ranks: list[Rank], qs, ks, vs, os, lses, dos) -> tuple[list, list, list]:
        """The ring's backward on the heads of q, k, v, o, lse and do given (every rank's), by
        ``ranks``, planned on them: each rank's dq, dk and dv sums, in the LSE's precision. A
        rank's own K/V shard is read in place (the messages send copies where they must)."""
        accumulate = accumulation_dtype(qs[0])
        dqs = [torch.zeros(q.shape, dtype=accumulate, device=q.device) for q in qs]
        gradients = _RingGradients(self, ks, vs) if self.exchange == "ring" else _GatheredGradients(self, ks, vs)
        for step, shards in _step(self.key_values(list(zip(ks, vs)), backward=True)):
            inputs = [(q, *kv, o, lse, do, self.source(rank, step, True), dq)
                      for rank, q, kv, o, lse, do, dq in zip(ranks, qs, shards, os, lses, dos, dqs)]
            # the first calls run while the step's dK/dV still arrive
            firsts = [rank.backward_first(*args) for rank, args in zip(ranks, inputs)]
            sums = gradients.arrived(step)
            for index, rank in enumerate(ranks):  # no loop variable keeps a shard past its step
                rank.backward_rest(*inputs[index], firsts[index], sums[index])
            inputs = firsts = None
            gradients.pass_on(sums, last=step + 1 == self.world_size)
        dkvs = gradients.finish()
        return dqs, [dk for dk, _ in dkvs], [dv for _, dv in dkvs]


def _write_heads(group, sums: tuple[list, list, list], grads: list[list]) -> None:
    """Every rank's dq, dk, dv sums of ``group``'s heads written into its heads of the gradients
    ``grads``, converted (a function: nothing holds the sums once it returns)."""
    for summed, whole, of in zip(sums, grads, (group.queries_of, group.keys_of, group.keys_of)):
        for part, grad in zip(summed, whole):
            of(grad).copy_(part)


def _step(key_values: Iterator[list]) -> Iterator[tuple[int, list]]:
    """(step, shards) of ``key_values``, the list of shards emptied once its step is done: the
    caller's loop variable would otherwise hold them while the next shards arrive (a third set)."""
    for step, shards in enumerate(key_values):
        yield step, shards
        shards.clear()


class _RingGradients:
    """dK/dV of the ring exchange: the buffers of a step's shards arrive from the previous rank,
    take this rank's parts and are sent on; the last step's are the rank's own shard's, whole
    (``Ring.key_values``), and stay. Two sets per rank: the one sent on and the one arriving (the
    sent set is freed once received)."""

    def __init__(self, ring: Ring, ks, vs):
        self.ring, self.ks, self.vs, self.travelling = ring, ks, vs, None

    def arrived(self, step: int) -> list:
        if self.travelling is None:  # the first step: this rank's shard, no part yet
            wide = accumulation_dtype(self.ks[0])
            return [(torch.zeros(k.shape, dtype=wide, device=k.device), torch.zeros(v.shape, dtype=wide, device=v.device))
                    for k, v in zip(self.ks, self.vs)]
        sums, self.travelling = self.travelling(), None  # the wait done: the sent set is freed
        return sums

    def pass_on(self, sums: list, last: bool) -> None:
        self.travelling = (lambda: sums) if last else self.ring.messages.shift(sums)

    def finish(self) -> list:
        return self.travelling()


class _GatheredGradients:
    """dK/dV of the all-gather exchange: each rank sums its parts for every shard, then the group
    sums every shard's over its ranks (a reduce-scatter), each rank receiving its own shard's."""

    def __init__(self, ring: Ring, ks, vs):
        wide = accumulation_dtype(ks[0])
        self.ring = ring
        self.sums = [tuple(torch.zeros((ring.world_size, *x.shape), dtype=wide, device=x.device) for x in (k, v))
                     for k, v in zip(ks, vs)]  # per rank: dK and dV of every shard, by source

    def arrived(self, step: int) -> list:
        return [(dk[source], dv[source]) for rank, (dk, dv) in zip(self.ring.ranks, self.sums)
                for source in [self.ring.source(rank, step, True)]]

    def pass_on(self, sums: list, last: bool) -> None:
        """Nothing moves until every shard's parts are summed."""

    def finish(self) -> list:
        return self.ring.messages.reduce_scatter(self.sums)


def accumulation_dtype(q) -> torch.dtype:
    """Partial results are merged, and gradients summed, in the LSE's precision."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32
