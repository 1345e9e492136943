"""Memory accounting: the bytes per token a rank of the ring holds at its peak, beside one device.

The buffers counted are those the schedule holds (``flashx.ring.schedule``): the two K/V shards
of the ring exchange (the one read, the one arriving) or every shard of the all-gather one, and
the dK/dV sums in the LSE's precision, of one head group (``flashx.ring.heads``) at a time, beside
the whole gradients the groups are written into. The ring's default count of groups is the fewest
whose peak is below twice one device's.
"""

from __future__ import annotations

import torch

from flashx.ring.heads import check_head_count
from flashx.ring.layouts import chunks_per_rank
from flashx.ring.schedule import accumulation_dtype, check_exchange


def peak_bytes_per_token(heads_q: int, heads_k: int, head_dim: int, dtype, *, world_size: int,
                         layout: str = "zigzag", exchange: str = "ring", head_dim_v: int | None = None,
                         backward_into: bool = False, head_groups: int | None = None) -> dict:
    """The bytes a rank holds per token of its shard at the peak of a forward and backward, as the
    contract's "Ring attention" section counts them, beside one device's ``flashx.attention``.

    Returns {"single": ..., "ring": ..., "terms": {buffer: bytes}, "forward": {buffer: bytes},
    "head_groups": G}: one device's q, k, v, o, do and their gradients; the ring's buffers at the
    backward's peak, its first call of a middle step (``exchange`` "ring" or "all_gather") in the
    head group of G that it runs (``terms``), and at the forward's, which runs every head at once
    (``forward``: below the backward's but where the all-gather holds many shards); ``ring`` the
    larger. Rows are in the input dtype ``dtype``, sums in the LSE's precision. One call reads a
    chunk of the shard's rows and keys (half of it in the zigzag layouts); its dq, dk and dv parts
    are counted where the backend returns them, without ``backward_into``
    (``backward_into=False``, the core's fallback), and not where it adds into the sums as it
    writes (``backward_into=True``, as the Triton backend does). ``head_groups`` None counts the
    ring's default groups (``_fewest_head_groups``). Kernels' own workspace is left out (a
    backend's, alike on one device and in the ring).
    """
    check_exchange(exchange)
    shape = (heads_q, heads_k, head_dim, dtype, world_size, layout, exchange, head_dim_v)
    groups = _fewest_head_groups(shape) if head_groups is None else check_head_count(head_groups, heads_k)
    return _count(*shape, backward_into, groups)


def _fewest_head_groups(shape: tuple) -> int:
    """The ring's default head groups: the fewest (dividing Hk) whose count is below twice one
    device's, else the fewest of those that count the least (where the forward's peak, which
    groups leave alone, is the larger, more groups than reach it gain nothing). Strictly below: the count leaves out kernels' workspace
    and the allocator's rounding, which put a measured peak a few percent above it. Fewer groups
    are fewer traversals of the ring. Counted with every call's parts held (without
    ``backward_into``, the most a backend holds): every rank must traverse the ring as many times,
    so the count reads nothing but the call's description, which every rank shares, and not
    whether its calls' backends add as they write, which may differ from rank to rank (an empty
    call is the core's)."""
    heads_k = shape[1]
    counts = {groups: _count(*shape, False, groups) for groups in range(1, heads_k + 1) if heads_k % groups == 0}
    below = [groups for groups, counted in counts.items() if counted["ring"] < 2 * counted["single"]]
    return below[0] if below else min(counts, key=lambda groups: counts[groups]["ring"])


def _count(heads_q: int, heads_k: int, head_dim: int, dtype, world_size: int, layout: str, exchange: str,
           head_dim_v: int | None, backward_into: bool, head_groups: int) -> dict:
    """``peak_bytes_per_token`` in ``head_groups`` groups."""
    size = torch.empty((), dtype=dtype).element_size()
    wide = accumulation_dtype(torch.empty((), dtype=dtype)).itemsize / size
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q, o = heads_q * head_dim * size, heads_q * head_dim_v * size  # a row of q (and dq), of o (and do)
    kv = heads_k * (head_dim + head_dim_v) * size  # a row of k and of v (and of dk and dv)
    group, chunks = 1 / head_groups, chunks_per_rank(layout)
    terms = {"q, o, do, k, v (the caller's)": q + 2 * o + kv, "dq summed": wide * q * group,
             "the first call's dK/dV, summed": wide * kv * group / chunks}
    if head_groups > 1:  # one group's sums are converted into the whole gradients, which one group returns as they are
        terms["dq, dk, dv (the results, written in group by group)"] = q + kv
    if not backward_into:
        terms["a call's dq, dk, dv parts"] = (q + kv) * group / chunks
    if exchange == "ring":  # two ranks: the second shard arrives while the rank's own is read, then is read alone
        terms["K/V held and arriving"] = min(world_size - 1, 2) * kv * group
        terms["dK/dV arriving and sent on (two sets)"] = 2 * wide * kv * group
    else:
        terms["K/V of every shard, gathered"] = world_size * kv * group
        terms["dK/dV of every shard, summed"] = world_size * wide * kv * group
    forward = {"q, k, v (the caller's)": q + kv, "o summed": wide * o}
    if exchange == "ring":
        forward["K/V held and arriving"] = min(world_size - 1, 2) * kv
    else:
        forward["K/V of every shard, gathered"] = world_size * kv
    return {"single": 2 * (q + o + kv), "ring": max(sum(terms.values()), sum(forward.values())), "terms": terms,
            "forward": forward, "head_groups": head_groups}
