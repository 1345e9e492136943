"""Memory accounting: the bytes per token a rank of the ring holds at its peak, beside one device.

The buffers counted are those the schedule holds (``flashx.ring.schedule``): the two K/V shards
of the ring exchange (the one read, the one arriving) or every shard of the all-gather one, and
the dK/dV sums in the LSE's precision.
"""

from __future__ import annotations

import torch

from flashx.ring.layouts import chunks_per_rank
from flashx.ring.schedule import accumulation_dtype, check_exchange


def peak_bytes_per_token(heads_q: int, heads_k: int, head_dim: int, dtype, *, world_size: int,
                         layout: str = "zigzag", exchange: str = "ring", head_dim_v: int | None = None,
                         backward_into: bool = False) -> dict:
    """The bytes a rank holds per token of its shard at the peak of a forward and backward, as the
    contract's "Ring attention" section counts them, beside one device's ``flashx.attention``.

    Returns {"single": ..., "ring": ..., "terms": {buffer: bytes}}: one device's q, k, v, o, do and
    their gradients, and the ring's buffers at its peak, the backward's first call of a middle step
    (``exchange`` "ring" or "all_gather"). Rows are in the input dtype ``dtype``, sums in the LSE's
    precision. One call reads a chunk of the shard's rows and keys (half of it in the zigzag
    layouts); its dq, dk and dv parts are counted where the backend returns them, without
    ``backward_into`` (``backward_into=False``, the core's fallback), and not where it adds into
    the sums as it writes (``backward_into=True``, as the Triton backend does). Kernels' own
    workspace is left out (a backend's, alike on one device and in the ring).
    """
    size = torch.empty((), dtype=dtype).element_size()
    wide = accumulation_dtype(torch.empty((), dtype=dtype)).itemsize / size
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q, o = heads_q * head_dim * size, heads_q * head_dim_v * size  # a row of q (and dq), of o (and do)
    kv = heads_k * (head_dim + head_dim_v) * size  # a row of k and of v (and of dk and dv)
    check_exchange(exchange)
    terms = {"q, o, do, k, v (the caller's)": q + 2 * o + kv, "dq summed": wide * q,
             "the first call's dK/dV, summed": wide * kv / chunks_per_rank(layout)}
    if not backward_into:
        terms["a call's dq, dk, dv parts"] = (q + kv) / chunks_per_rank(layout)
    if exchange == "ring":  # two ranks: the second shard arrives while the rank's own is read, then is read alone
        terms["K/V held and arriving"] = min(world_size - 1, 2) * kv
        terms["dK/dV arriving and sent on (two sets)"] = 2 * wide * kv
    else:
        terms["K/V of every shard, gathered"] = world_size * kv
        terms["dK/dV of every shard, summed"] = world_size * wide * kv
    return {"single": 2 * (q + o + kv), "ring": sum(terms.values()), "terms": terms}
