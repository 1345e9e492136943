"""Context-parallel (ring) attention on torch.distributed: the contract's "Ring attention" section.

Each of the W ranks of a process group holds one shard of the sequence axis of q, k and v.
The K/V shards travel once around the ring of ranks: at each step a rank attends its queries
to the shard it holds, through any flashx backend, and folds the partial result into its
running one as the contract's "Merging partial results" says, while the next shard is already
on its way. The backward recomputes the steps, and each shard's dK/dV travel around the ring
with it back to its owner. ``exchange="all_gather"`` gathers every K/V shard at once instead.

This module is the public face: ``ring_attention`` on the ranks of a process group,
``simulate_ring_attention`` running the steps of all W ranks in one process without one (to
check the kernels and the merging on one device), ``shard`` and ``unshard`` (the layouts),
``peak_bytes_per_token``, ``LAYOUTS`` and ``EXCHANGES``. The package ``flashx.ring`` holds the
parts, one concept per module, each with its design:

- ``arguments``: a call's keywords and shards checked, the whole sequence's ``Problem``;
- ``layouts``: how a sequence is cut into the ranks' shards ("contiguous", "zigzag",
  "document_zigzag");
- ``sequences``: the batch entries or packed documents, which rows and keys of two chunks meet,
  and the backend calls that serve them;
- ``steps``: one rank's calls at each step, planned once, run forward and backward;
- ``messages``: the ranks' exchanges, over torch.distributed or within one process;
- ``schedule``: the ring forward and backward, the K/V and dK/dV exchanges, the autograd Function;
- ``heads``: the backward's head groups, one group of KV heads traversing the ring at a time;
- ``sinks``: the sink, joined once after the last step, and its gradient;
- ``memory``: the bytes per token a rank holds at its peak.

Importing this module imports torch; ``import flashx`` does not import this module.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from flashx.errors import ShapeError
from flashx.ring.arguments import caller_sinks, require_torch, shard_problem
from flashx.ring.heads import check_head_count, split_heads
from flashx.ring.layouts import LAYOUTS, shard, unshard
from flashx.ring.memory import peak_bytes_per_token
from flashx.ring.messages import SimulatedMessages, broadcast_seed, group_messages
from flashx.ring.schedule import EXCHANGES, Ring, RingAttention
from flashx.ring.steps import Rank

__all__ = ["EXCHANGES", "LAYOUTS", "peak_bytes_per_token", "ring_attention", "shard", "simulate_ring_attention",
           "unshard"]


def ring_attention(q, k, v, *, group=None, layout="zigzag", exchange="ring", causal=False, window=None,
                   softmax_scale=None, softcap=None, alibi_slopes=None, sinks=None, seqlens=None, cu_seqlens=None,
                   dropout_p=0.0, seed=None, rng_offset=0, return_lse=False, head_groups=None, backend="auto"):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the whole world).

    Padded: q (B, N/W, Hq, D), k (B, N/W, Hk, D), v (B, N/W, Hk, Dv), this rank's shard in
    ``layout`` ("zigzag" or "contiguous"; ``shard`` cuts a whole sequence so), with ``seqlens``
    (B,) the whole sequences' lengths if given. Packed: q (T/W, Hq, D), k and v likewise, with
    ``cu_seqlens`` (B + 1,) the offsets of the documents in the whole packed sequence of T rows
    (every rank passes the same); ``layout`` may also be "document_zigzag", which zigzags each
    document (its length a multiple of 2W) and balances the causal work of any mix of documents
    (``shard(..., cu_seqlens=cu_seqlens)`` cuts a whole packed sequence so). Returns this rank's
    rows of ``flashx.attention`` on the whole sequence with the same keywords: o, and with
    ``return_lse`` lse ((B, Hq, N/W), or (Hq, T/W) packed). ``exchange`` "ring" (the default)
    passes K/V shards from rank to rank; "all_gather" gathers them at once, for more memory
    (``peak_bytes_per_token``). Differentiable through torch autograd; every rank of the group
    must make the call, with equal shapes and keywords, and run its backward. With ``seed=None``
    and dropout, rank 0 draws the seed and sends it to the others. ``sinks`` (Hq,), equal on every
    rank, receives the dsinks terms of this rank's rows: the ranks' sum is the whole sequence's.
    ``alibi_slopes`` is declined (``UnsupportedError``, with the reason). ``head_groups`` (a
    positive int dividing Hk) runs the backward once per group of KV heads with their query heads,
    holding one group's sums and K/V in flight at a time, for as many traversals of the ring
    (launches and latency); None (the default) takes the fewest groups whose counted peak
    (``peak_bytes_per_token``) is below twice one device's.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ShapeError("group: expected a process group this process belongs to")
    options = {"causal": causal, "window": window, "softmax_scale": softmax_scale, "softcap": softcap,
               "alibi_slopes": alibi_slopes, "sinks": sinks, "dropout_p": dropout_p, "seed": seed,
               "rng_offset": rng_offset}
    problem, sequences = shard_problem(q, k, v, layout, exchange, world_size, options, seqlens, cu_seqlens)
    head_groups = None if head_groups is None else check_head_count(head_groups, problem.heads_k)
    if seed is None and problem.dropout_p > 0:
        problem = dataclasses.replace(problem, seed=broadcast_seed(problem.seed, group, q.device))
    q4, k4, v4 = (sequences.batched(x) for x in (q, k, v))
    ring = _ring(lambda heads: [Rank.planned(rank, world_size, layout, problem, sequences, backend, q4, k4, v4,
                                             heads)],
                 problem, layout, exchange, world_size, head_groups, group_messages(group, world_size, rank))
    o, lse = RingAttention.apply(ring, caller_sinks(sinks), q4, k4, v4)
    o, lse = sequences.unbatched(o), sequences.unbatched(lse)
    return (o, lse) if return_lse else o


def simulate_ring_attention(q, k, v, world_size, *, layout="zigzag", exchange="ring", causal=False, window=None,
                            softmax_scale=None, softcap=None, alibi_slopes=None, sinks=None, seqlens=None,
                            cu_seqlens=None, dropout_p=0.0, seed=None, rng_offset=0, return_lse=False,
                            head_groups=None, backend="auto"):
    """``ring_attention`` of ``world_size`` ranks in one process, without a process group.

    q, k, v hold the whole sequence, (B, N, H, D) or packed (T, H, D); each rank's shard is cut
    by ``shard`` (with ``cu_seqlens``, packed), the ranks run the very steps and merges of
    ``ring_attention`` in turn, and "sending" a shard hands it to the next rank's step. Returns the
    whole-sequence o (and lse), differentiable; ``sinks``, one tensor for every rank, receives the
    sum of their dsinks. ``head_groups`` as ``ring_attention``'s.
    """
    options = {"causal": causal, "window": window, "softmax_scale": softmax_scale, "softcap": softcap,
               "alibi_slopes": alibi_slopes, "sinks": sinks, "dropout_p": dropout_p, "seed": seed,
               "rng_offset": rng_offset}
    require_torch(q)
    axis = 0 if cu_seqlens is not None else 1
    shards = [[shard(x, world_size, rank, layout, dim=axis, cu_seqlens=cu_seqlens) for rank in range(world_size)]
              for x in (q, k, v)]
    problem, sequences = shard_problem(shards[0][0], shards[1][0], shards[2][0], layout, exchange, world_size,
                                       options, seqlens, cu_seqlens)
    head_groups = None if head_groups is None else check_head_count(head_groups, problem.heads_k)
    shards = [[sequences.batched(x) for x in xs] for xs in shards]
    ring = _ring(lambda heads: [Rank.planned(rank, world_size, layout, problem, sequences, backend,
                                             *(xs[rank] for xs in shards), heads) for rank in range(world_size)],
                 problem, layout, exchange, world_size, head_groups, SimulatedMessages())
    outputs = RingAttention.apply(ring, caller_sinks(sinks), *shards[0], *shards[1], *shards[2])
    o = unshard([sequences.unbatched(x) for x in outputs[:world_size]], layout, dim=axis, cu_seqlens=cu_seqlens)
    lse = unshard([sequences.unbatched(x) for x in outputs[world_size:]], layout, dim=axis + 1, cu_seqlens=cu_seqlens)
    return (o, lse) if return_lse else o


def _ring(planned, problem, layout: str, exchange: str, world_size: int, head_groups: int | None, messages) -> Ring:
    """The ring of the ranks ``planned(head_group)`` plans (None: on every head), in ``head_groups``
    groups for the backward (None: ``peak_bytes_per_token``'s default, which every rank computes
    alike from the call's description)."""
    ranks = planned(None)
    if head_groups is None:
        head_groups = peak_bytes_per_token(problem.heads_q, problem.heads_k, problem.head_dim,
                                           getattr(torch, problem.dtype), world_size=world_size, layout=layout,
                                           exchange=exchange, head_dim_v=problem.head_dim_v)["head_groups"]
    groups = split_heads(head_groups, problem.heads_q, problem.heads_k)
    backward = [(groups[0], ranks)] if head_groups == 1 else [(group, planned(group)) for group in groups]
    return Ring(ranks, messages, exchange, problem.sinks, backward)
