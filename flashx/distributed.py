"""Context-parallel (ring) attention on torch.distributed: the contract's "Ring attention" section.

Each of the W ranks of a process group holds one shard of the sequence axis of q, k and v.
The K/V shards travel once around the ring of ranks: at each step a rank attends its queries
to the shard it holds, through any flashx backend, and folds the partial result into its
running one as the contract's "Merging partial results" says, while the next shard is already
on its way. The backward recomputes each step from the global LSE; the dK/dV computed for a
shard travel around the ring with it and reach its owner after a full turn.

Positions. A shard is one chunk of the sequence (layout "contiguous") or two (layout "zigzag":
of 2W equal chunks rank r holds r and 2W - 1 - r, which balances the causal work). Each pair
of a query chunk and a key chunk is one backend call on just the rows and keys that the causal
or window band lets meet, the band becoming a window in the call's own coordinates (``_pair``);
a pair the band keeps apart is skipped, and with it whole steps of a causal contiguous ring.
Dropout is drawn at sequence positions (the ``dropout_offsets`` option), so the mask is the one
``flashx.attention`` draws on the whole sequence, bit for bit.

Score modifications. A softcap acts on each score alone, so every step's call takes it. The sink
belongs to no step: the steps are computed without it, and each rank joins the sink's state
(o = 0, lse = σ) into its rows once, after the last step (``_join_sink``), so the lse the
backward recomputes from holds it and dq, dk, dv need nothing more. dsinks is each rank's own
rows' terms (``_sink_gradient``), reaching the caller's ``sinks`` through autograd; the ranks'
parts add up to the whole sequence's, as the parts of every parameter's gradient do under
context parallelism (the contract's Ring attention section says why no all-reduce). ALiBi is
declined: a step's call measures its distance from the call's own diagonal, not the sequence's.

``simulate_ring_attention`` runs the steps of all W ranks in one process, without a process
group, to check the kernels and the merging on one device.

Importing this module imports torch; ``import flashx`` does not import this module.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from flashx import arrays
from flashx.api import merge_states
from flashx.errors import DTypeError, ShapeError, UnsupportedError
from flashx.execute import run_backward, run_forward
from flashx.options import complete
from flashx.plan import plan
from flashx.problem import Problem
from flashx.validation import build_problem

#: layout -> chunks of the sequence per rank
LAYOUTS = {"contiguous": 1, "zigzag": 2}


def ring_attention(q, k, v, *, group=None, layout="zigzag", causal=False, window=None, softmax_scale=None,
                   softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None, rng_offset=0,
                   return_lse=False, backend="auto"):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the whole world).

    q (B, N/W, Hq, D), k (B, N/W, Hk, D), v (B, N/W, Hk, Dv): this rank's shard in ``layout``
    ("zigzag" or "contiguous"; ``shard`` cuts a whole sequence so). Returns this rank's rows of
    ``flashx.attention`` on the whole sequence with the same keywords: o (B, N/W, Hq, Dv), and
    with ``return_lse`` lse (B, Hq, N/W). Differentiable through torch autograd; every rank of
    the group must make the call, with equal shapes and keywords, and run its backward. With
    ``seed=None`` and dropout, rank 0 draws the seed and sends it to the others. ``sinks`` (Hq,),
    equal on every rank, receives the dsinks terms of this rank's rows: the ranks' sum is the
    whole sequence's. ``alibi_slopes`` is declined (``UnsupportedError``, with the reason).
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ShapeError("group: expected a process group this process belongs to")
    options = dict(causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, seed=seed, rng_offset=rng_offset)
    problem = _shard_problem(q, k, v, layout, options)
    if seed is None and problem.dropout_p > 0:
        problem = dataclasses.replace(problem, seed=_broadcast_seed(problem.seed, group, q.device))
    ring = _Ring([_Rank(rank, world_size, layout, problem, backend)], _p2p_shift(group, world_size, rank),
                 problem.sinks)
    o, lse = _RingAttention.apply(ring, _caller_sinks(sinks), q, k, v)
    return (o, lse) if return_lse else o


def simulate_ring_attention(q, k, v, world_size, *, layout="zigzag", causal=False, window=None, softmax_scale=None,
                            softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None, rng_offset=0,
                            return_lse=False, backend="auto"):
    """``ring_attention`` of ``world_size`` ranks in one process, without a process group.

    q, k, v hold the whole sequence, (B, N, H, D); each rank's shard is cut by ``shard``, the
    ranks run the very steps and merges of ``ring_attention`` in turn, and "sending" a shard
    hands it to the next rank's step. Returns the whole-sequence o (and lse), differentiable;
    ``sinks``, one tensor for every rank, receives the sum of their dsinks.
    """
    options = dict(causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, seed=seed, rng_offset=rng_offset)
    _require_torch(q)
    shards = [[shard(x, world_size, rank, layout) for rank in range(world_size)] for x in (q, k, v)]
    problem = _shard_problem(shards[0][0], shards[1][0], shards[2][0], layout, options)
    ranks = [_Rank(rank, world_size, layout, problem, backend) for rank in range(world_size)]
    outputs = _RingAttention.apply(_Ring(ranks, _rotate, problem.sinks), _caller_sinks(sinks), *shards[0],
                                   *shards[1], *shards[2])
    o = unshard(outputs[:world_size], layout)
    lse = unshard(outputs[world_size:], layout, dim=2)
    return (o, lse) if return_lse else o


def shard(x, world_size: int, rank: int, layout: str = "zigzag", dim: int = 1):
    """Rank ``rank``'s shard of the whole-sequence tensor ``x`` in ``layout``; ``dim`` is the
    sequence axis (1 for q, k, v and o, 2 for lse)."""
    chunks = _chunks_per_rank(layout)
    if not 0 <= rank < world_size:
        raise ShapeError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    length = x.shape[dim]
    if length % (chunks * world_size):
        raise ShapeError(f"x: layout {layout!r} over {world_size} ranks cuts the sequence into {chunks * world_size} "
                         f"equal chunks: expected a length divisible by that, got {length} (axis {dim})")
    size = length // (chunks * world_size)
    parts = [x.narrow(dim, start, size) for start in _chunk_starts(layout, world_size, rank, size)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(shards: Sequence, layout: str = "zigzag", dim: int = 1):
    """The whole-sequence tensor from every rank's shard, in rank order: ``shard`` undone."""
    if _chunks_per_rank(layout) == 1:
        return torch.cat(list(shards), dim)
    halves = [x.chunk(2, dim) for x in shards]
    return torch.cat([first for first, _ in halves] + [second for _, second in reversed(halves)], dim)


def _chunks_per_rank(layout) -> int:
    if layout not in LAYOUTS:
        raise ShapeError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return LAYOUTS[layout]


def _chunk_starts(layout: str, world_size: int, rank: int, size: int) -> tuple[int, ...]:
    """The sequence position of each chunk of ``rank``'s shard, in shard order."""
    if layout == "contiguous":
        return (rank * size,)
    return (rank * size, (2 * world_size - 1 - rank) * size)


def _chunks(layout: str, world_size: int, rank: int, size: int) -> list[tuple[int, int]]:
    """(first row in the shard, sequence position) of each chunk of ``rank``'s shard."""
    return [(chunk * size, start) for chunk, start in enumerate(_chunk_starts(layout, world_size, rank, size))]


def _shard_problem(q, k, v, layout: str, options: dict) -> Problem:
    """One shard's keywords and shapes checked, as a ``Problem`` (band, scale and seed drawn)."""
    _require_torch(q)
    if options["alibi_slopes"] is not None:
        raise UnsupportedError(
            "alibi_slopes: ring attention does not take ALiBi. Each ring step is a backend call on a pair of "
            "chunks, which measures ALiBi's distance from its own bottom-right diagonal, not the whole "
            "sequence's, and no backend takes ALiBi at offset positions (as dropout_offsets does for dropout)")
    chunks = _chunks_per_rank(layout)
    problem = build_problem(q, k, v, **complete("ring_attention", options))
    if problem.seqlen_k != problem.seqlen_q:
        raise ShapeError(f"k: expected a shard as long as q's ({problem.seqlen_q} positions), "
                         f"got shape {tuple(k.shape)}")
    if problem.seqlen_q % chunks:
        raise ShapeError(f"q: layout {layout!r} holds {chunks} equal chunks per rank: expected a shard length "
                         f"divisible by {chunks}, got shape {tuple(q.shape)}")
    return problem


def _caller_sinks(sinks):
    """The caller's sinks as autograd's input (the problem holds a detached copy for the steps)."""
    return None if sinks is None else arrays.resolved(sinks)


def _require_torch(q) -> None:
    if arrays.kind_of(q) != "torch":
        raise DTypeError(f"q: expected a torch tensor (ring attention runs on torch.distributed), "
                         f"got {type(q).__name__}")


def _broadcast_seed(seed: int, group, device) -> int:
    """Rank 0's seed on every rank (a drawn seed differs between processes)."""
    signed = torch.tensor([seed - (1 << 64) if seed >= 1 << 63 else seed], dtype=torch.int64, device=device)
    dist.broadcast(signed, group=group, group_src=0)
    return int(signed.item()) % (1 << 64)


@dataclass(frozen=True)
class _Call:
    """One backend call of a step: query rows ``rows`` of the shard against keys ``keys`` of the
    K/V shard held, with the keywords that give exactly the whole sequence's pairs."""

    rows: slice
    keys: slice
    options: dict


def _pair(band, size: int, query_start: int, key_start: int):
    """(rows, keys, window, offsets) of the call for a query chunk and a key chunk of ``size``
    positions starting at these sequence positions; None where the band allows no pair.

    The key at sequence position y is allowed for the query at x iff -left <= y - x <= right (the
    whole sequence's band; its query and key lengths are equal, so the diagonal is y = x; -1 is
    unbounded). For row i and key j of the chunks, y - x = j - i + key_start - query_start, so
    j - i must lie in [lo, hi]. Row i meets a key iff i + hi >= 0 and i + lo < size, key j a row
    iff j - hi < size and j >= lo: the call takes rows [a, e) and keys [s, f). Its own band is
    centred on j' - i' = (f - s) - (e - a) (bottom-right), and j - i = j' - i' + s - a, so its
    window is (f - e - lo, hi - f + e): both sides >= 0 by the choice of e and f, and -1 where no
    pair of the call reaches that side.
    """
    left, right = band or (-1, -1)
    shift = key_start - query_start
    lo = -math.inf if left == -1 else -left - shift
    hi = math.inf if right == -1 else right - shift
    a, e = max(0, -hi), min(size, size - lo)
    s, f = max(0, lo), min(size, size + hi)
    if a >= e or s >= f:
        return None
    a, e, s, f = int(a), int(e), int(s), int(f)
    near = -1 if lo <= 1 - (f - s) + (f - e) else f - e - lo
    far = -1 if hi >= e - a - 1 + (f - e) else hi - f + e
    window = None if near == far == -1 else (int(near), int(far))
    return slice(a, e), slice(s, f), window, (query_start + a, key_start + s)


class _Rank:
    """One rank's part of a ring call: for the K/V shard of each source rank, the calls of its step."""

    def __init__(self, index: int, world_size: int, layout: str, problem: Problem, backend):
        self.index, self.backend = index, backend
        size = problem.seqlen_q // LAYOUTS[layout]
        mine = _chunks(layout, world_size, index, size)
        common = dict(softmax_scale=problem.softmax_scale, softcap=problem.softcap, dropout_p=problem.dropout_p,
                      seed=problem.seed, rng_offset=problem.rng_offset)
        self.calls = []
        for source in range(world_size):
            theirs = _chunks(layout, world_size, source, size)
            calls = []
            for (row0, query_start), (key0, key_start) in itertools.product(mine, theirs):
                found = _pair(problem.band, size, query_start, key_start)
                if found is None:
                    continue
                rows, keys, window, offsets = found
                options = dict(common, window=window, dropout_offsets=offsets if problem.dropout_p else None)
                rows = slice(row0 + rows.start, row0 + rows.stop)
                keys = slice(key0 + keys.start, key0 + keys.stop)
                calls.append(_Call(rows, keys, complete("ring_attention", options)))
            self.calls.append(calls)

    def forward_step(self, q, k, v, source: int, o, lse) -> None:
        """Fold the attention of this rank's queries to ``source``'s K/V shard into (o, lse)."""
        for call in self.calls[source]:
            q_, k_, v_ = q[:, call.rows], k[:, call.keys], v[:, call.keys]
            problem, impl = plan(q_, k_, v_, self.backend, call.options)
            o_part, lse_part = run_forward(impl, problem, q_, k_, v_)
            rows, lse_rows = (slice(None), call.rows), (slice(None), slice(None), call.rows)
            o[rows], lse[lse_rows] = merge_states(o[rows], lse[lse_rows], o_part, lse_part)

    def backward_step(self, q, k, v, o, lse, do, source: int, dq):
        """Add this step's part of dq to ``dq``; return its parts of dk and dv of ``source``'s shard."""
        dk = torch.zeros(k.shape, dtype=dq.dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=dq.dtype, device=v.device)
        for call in self.calls[source]:
            q_, k_, v_ = q[:, call.rows], k[:, call.keys], v[:, call.keys]
            problem, impl = plan(q_, k_, v_, self.backend, call.options)
            parts = run_backward(impl, problem, q_, k_, v_, o[:, call.rows], lse[:, :, call.rows], do[:, call.rows])
            for total, part, index in zip((dq, dk, dv), parts, (call.rows, call.keys, call.keys)):
                total[:, index] += part
        return dk, dv


Shift = Callable[[list], Callable[[], list]]


class _Ring:
    """The ranks this process runs (one, or all of them in a simulation), how shards move
    between them (``shift(items)`` sends item r to rank r + 1 and returns the wait for the
    items received, item r then coming from rank r - 1), and the sinks every row joins once
    (None: none), in the lse's dtype."""

    def __init__(self, ranks: list[_Rank], shift: Shift, sinks):
        self.ranks, self.shift, self.sinks = ranks, shift, sinks
        self.world_size = len(ranks[0].calls)

    def forward(self, qs, ks, vs):
        accumulate = _accumulation_dtype(qs[0])
        os = [torch.zeros(*q.shape[:-1], v.shape[-1], dtype=accumulate, device=q.device) for q, v in zip(qs, vs)]
        lses = [torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=accumulate, device=q.device)
                for q in qs]
        shards = [(k.contiguous(), v.contiguous()) for k, v in zip(ks, vs)]
        for step in range(self.world_size):
            arriving = self.shift(shards) if step + 1 < self.world_size else None
            for rank, q, (k, v), o, lse in zip(self.ranks, qs, shards, os, lses):
                rank.forward_step(q, k, v, (rank.index - step) % self.world_size, o, lse)
            if arriving is not None:
                shards = arriving()
        if self.sinks is not None:
            os, lses = zip(*(_join_sink(o, lse, self.sinks) for o, lse in zip(os, lses)))
        return [o.to(q.dtype) for o, q in zip(os, qs)], list(lses)

    def backward(self, qs, ks, vs, os, lses, dos):
        accumulate = _accumulation_dtype(qs[0])
        dqs = [torch.zeros(q.shape, dtype=accumulate, device=q.device) for q in qs]
        shards = [(k.contiguous(), v.contiguous()) for k, v in zip(ks, vs)]
        travelling = None  # the wait for the dk, dv that arrive with this step's K/V shards
        for step in range(self.world_size):
            arriving = self.shift(shards) if step + 1 < self.world_size else None
            grads = [rank.backward_step(q, k, v, o, lse, do, (rank.index - step) % self.world_size, dq)
                     for rank, q, (k, v), o, lse, do, dq in zip(self.ranks, qs, shards, os, lses, dos, dqs)]
            if travelling is not None:
                for (dk, dv), (dk_before, dv_before) in zip(grads, travelling()):
                    dk += dk_before
                    dv += dv_before
            travelling = self.shift(grads)  # after a full turn: to the shard's owner
            if arriving is not None:
                shards = arriving()
        dkvs = travelling()
        dsinks = None if self.sinks is None else sum(map(_sink_gradient, os, lses, dos, itertools.repeat(self.sinks)))
        return ([dq.to(q.dtype) for dq, q in zip(dqs, qs)], [dk.to(k.dtype) for (dk, _), k in zip(dkvs, ks)],
                [dv.to(v.dtype) for (_, dv), v in zip(dkvs, vs)], dsinks)


def _join_sink(o, lse, sinks):
    """A rank's (o, lse) over every key, with the sink's state (o = 0, lse = σ) merged in once
    (the contract's "Merging partial results"), as the contract's softmax computes it: a NaN or
    +inf sink gives NaN rows, a row without keys keeps o = 0 and gets lse = σ."""
    sink = sinks[None, :, None]
    top = torch.maximum(lse, sink)
    top = torch.where(top == -math.inf, 0.0, top)
    joined = torch.where(lse == -math.inf, sink, top + torch.log(torch.exp(lse - top) + torch.exp(sink - top)))
    share = torch.where(lse == -math.inf, 0.0, torch.exp(lse - joined))  # the keys' part of each row's weight
    return o * share.transpose(1, 2)[..., None], joined


def _sink_gradient(o, lse, do, sinks):
    """dsinks of one rank's rows: -sum over them of exp(σ_h - lse_i) * dot(o_i, do_i). Every row of
    a ring call has a key (the band always holds its own position), so every row's term counts."""
    delta = (o.to(lse.dtype) * do.to(lse.dtype)).sum(-1)  # (B, N/W, Hq)
    return -(torch.exp(sinks[None, :, None] - lse) * delta.transpose(1, 2)).sum((0, 2))


def _accumulation_dtype(q) -> torch.dtype:
    """Partial results are merged, and gradients summed, in the LSE's precision."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _rotate(items: list) -> Callable[[], list]:
    """The shift of a simulation: rank r's items are handed to rank r + 1."""
    received = items[-1:] + items[:-1]
    return lambda: received


def _p2p_shift(group, world_size: int, rank: int) -> Shift:
    """The shift of a process group: this rank's tensors go to the next rank by point-to-point
    messages, posted together (``batch_isend_irecv``) and waited for only when needed."""
    if world_size == 1:
        return _rotate
    send_to, receive_from = (rank + 1) % world_size, (rank - 1) % world_size

    def shift(items: list) -> Callable[[], list]:
        (tensors,) = items
        received = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in tensors)
        operations = [dist.P2POp(dist.isend, x, group=group, group_peer=send_to) for x in tensors]
        operations += [dist.P2POp(dist.irecv, x, group=group, group_peer=receive_from) for x in received]
        works = dist.batch_isend_irecv(operations)

        def wait() -> list:
            for work in works:
                work.wait()
            return [received]

        return wait

    return shift


class _RingAttention(torch.autograd.Function):
    """Inputs: the ring, the caller's sinks (or None: their values are the ring's), then the q
    shards of its ranks, their k shards, their v shards. Outputs: the o shards, then the lse
    shards (not differentiable)."""

    @staticmethod
    def forward(ctx, ring: _Ring, sinks, *tensors):
        count = len(ring.ranks)
        qs, ks, vs = tensors[:count], tensors[count : 2 * count], tensors[2 * count :]
        os, lses = ring.forward(qs, ks, vs)
        ctx.ring, ctx.sinks_dtype = ring, None if sinks is None else sinks.dtype
        ctx.save_for_backward(*tensors, *os, *lses)
        ctx.mark_non_differentiable(*lses)
        ctx.set_materialize_grads(False)  # no zero tensor made for the lse's gradient
        return (*os, *lses)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        count = len(ctx.ring.ranks)
        saved = ctx.saved_tensors
        qs, ks, vs, os, lses = (saved[i * count : (i + 1) * count] for i in range(5))
        dos = [torch.zeros_like(o) if do is None else do for do, o in zip(grads[:count], os)]
        dqs, dks, dvs, dsinks = ctx.ring.backward(qs, ks, vs, os, lses, dos)
        dsinks = dsinks.to(ctx.sinks_dtype) if ctx.needs_input_grad[1] else None
        return (None, dsinks, *dqs, *dks, *dvs)
