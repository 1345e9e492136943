"""Layouts: how the sequence axis is cut into the ranks' shards.

A shard is one chunk of the sequence axis (layout "contiguous") or two (layout "zigzag": of 2W
equal chunks rank r holds r and 2W - 1 - r, which balances the causal work). ``shard`` cuts a
whole-sequence tensor so and ``unshard`` joins the shards back; the ring's steps place each chunk
of a shard in the sequence with ``chunks``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashx.errors import ShapeError

#: layout -> chunks of the sequence per rank
LAYOUTS = {"contiguous": 1, "zigzag": 2}


def shard(x, world_size: int, rank: int, layout: str = "zigzag", dim: int = 1):
    """Rank ``rank``'s shard of the whole-sequence tensor ``x`` in ``layout``; ``dim`` is the
    sequence axis (1 for padded q, k, v and o, 2 for their lse; 0 and 1 packed)."""
    chunks = chunks_per_rank(layout)
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
    if chunks_per_rank(layout) == 1:
        return torch.cat(list(shards), dim)
    halves = [x.chunk(2, dim) for x in shards]
    return torch.cat([first for first, _ in halves] + [second for _, second in reversed(halves)], dim)


def chunks_per_rank(layout) -> int:
    """The number of chunks of ``layout``'s shard, the layout checked."""
    if layout not in LAYOUTS:
        raise ShapeError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return LAYOUTS[layout]


def chunks(layout: str, world_size: int, rank: int, size: int) -> list[tuple[int, int]]:
    """(first row in the shard, sequence position) of each chunk of ``rank``'s shard."""
    return [(chunk * size, start) for chunk, start in enumerate(_chunk_starts(layout, world_size, rank, size))]


def _chunk_starts(layout: str, world_size: int, rank: int, size: int) -> tuple[int, ...]:
    """The sequence position of each chunk of ``rank``'s shard, in shard order."""
    if layout == "contiguous":
        return (rank * size,)
    return (rank * size, (2 * world_size - 1 - rank) * size)
