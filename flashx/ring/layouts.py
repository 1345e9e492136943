"""Layouts: how the sequence axis is cut into the ranks' shards.

The axis is a run of segments, each cut into equal pieces, and every rank holds the same pieces
of every segment:

- "contiguous": one segment, the whole axis, in W pieces; rank r holds piece r.
- "zigzag": one segment in 2W pieces; rank r holds pieces r and 2W - 1 - r. The causal work of
  the pieces grows with their position, so the pair balances it for one sequence. Packed
  documents are cut with the axis, not each alone, and their work falls unevenly on the ranks.
- "document_zigzag" (packed only): the segments are the documents of ``cu_seqlens`` and the
  padding after them, each in 2W pieces; rank r holds pieces r and 2W - 1 - r of every one. Each
  rank then holds exactly 1/W of every document's causal work, whatever the mix of lengths. Every
  document's length must be a multiple of 2W.

A rank's shard is its chunks one after another: chunk c holds the c-th of its pieces of every
segment, in segment order. So a shard's chunks are equal, and a chunk's pieces of consecutive
documents lie side by side: where a pair of chunks meets in every document with one band (as
causal attention's pieces do), their fragments make one packed call (``flashx.ring.sequences``).
``chunks`` gives each chunk as its intervals, ``shard`` cuts a whole-sequence tensor into a
rank's shard and ``unshard`` joins the shards back.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from flashx.errors import ShapeError

#: layout -> chunks of the sequence per rank
LAYOUTS = {"contiguous": 1, "zigzag": 2, "document_zigzag": 2}


class Interval(NamedTuple):
    """Rows [row, row + length) of a shard hold positions [position, position + length) of the
    whole sequence axis."""

    row: int
    position: int
    length: int


def shard(x, world_size: int, rank: int, layout: str = "zigzag", dim: int = 1, cu_seqlens=None):
    """Rank ``rank``'s shard of the whole-sequence tensor ``x`` in ``layout``; ``dim`` is the
    sequence axis (1 for padded q, k, v and o, 2 for their lse; 0 and 1 packed). ``cu_seqlens``,
    the packed documents' offsets, is needed by "document_zigzag" (and unread by the others)."""
    pieces = chunks_per_rank(layout) * world_size
    if not 0 <= rank < world_size:
        raise ShapeError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    length = x.shape[dim]
    if length % pieces:
        raise ShapeError(f"x: layout {layout!r} over {world_size} ranks cuts the sequence into {pieces} "
                         f"equal chunks: expected a length divisible by that, got {length} (axis {dim})")
    parts = [x.narrow(dim, part.position, part.length)
             for chunk in chunks(layout, world_size, rank, length, _offsets(cu_seqlens)) for part in chunk]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(shards: Sequence, layout: str = "zigzag", dim: int = 1, cu_seqlens=None):
    """The whole-sequence tensor from every rank's shard, in rank order: ``shard`` undone."""
    world_size, length = len(shards), sum(x.shape[dim] for x in shards)
    placed = [(part, x) for rank, x in enumerate(shards)
              for chunk in chunks(layout, world_size, rank, length, _offsets(cu_seqlens)) for part in chunk]
    placed.sort(key=lambda held: held[0].position)
    return torch.cat([x.narrow(dim, part.row, part.length) for part, x in placed], dim)


def chunks_per_rank(layout) -> int:
    """The number of chunks of ``layout``'s shard, the layout checked."""
    if layout not in LAYOUTS:
        raise ShapeError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return LAYOUTS[layout]


def chunks(layout: str, world_size: int, rank: int, length: int, offsets=None) -> list[list[Interval]]:
    """The intervals of each chunk of ``rank``'s shard of a sequence axis of ``length`` positions
    (a multiple of the pieces), in shard order; ``offsets`` are the packed documents' (or None)."""
    held = chunks_per_rank(layout)
    pieces = held * world_size
    bounds = segments(layout, world_size, length, offsets)
    found, row = [], 0
    for piece in (rank,) if held == 1 else (rank, pieces - 1 - rank):
        chunk = []
        for begin, end in itertools.pairwise(bounds):
            size = (end - begin) // pieces
            chunk.append(Interval(row, begin + piece * size, size))
            row += size
        found.append(chunk)
    return found


def segments(layout: str, world_size: int, length: int, offsets) -> tuple[int, ...]:
    """The boundaries of ``layout``'s segments on an axis of ``length`` positions (a multiple of the
    pieces), the documents checked: "document_zigzag" needs them, each a multiple of 2W long."""
    if layout != "document_zigzag":
        return (0, length)
    if offsets is None:
        raise ShapeError("cu_seqlens: layout 'document_zigzag' cuts each document of a packed sequence and needs "
                         "its cu_seqlens, got none; padded (B, N) input is cut sequence by sequence by layout "
                         "'zigzag' already")
    if not offsets or offsets[0] != 0 or any(b < a for a, b in itertools.pairwise(offsets)) or offsets[-1] > length:
        raise ShapeError(f"cu_seqlens: expected offsets starting at 0, non-decreasing, ending at most at {length}, "
                         f"got {list(offsets) if len(offsets) <= 16 else f'{list(offsets[:8])}...'}")
    multiple = 2 * world_size
    for document, (begin, end) in enumerate(itertools.pairwise(offsets)):
        if (end - begin) % multiple:
            raise ShapeError(f"cu_seqlens: layout 'document_zigzag' over {world_size} ranks cuts each document into "
                             f"{multiple} equal pieces: expected document lengths that are multiples of {multiple}, "
                             f"got document {document} of length {end - begin} (pad documents to a multiple of "
                             f"{multiple})")
    return tuple(offsets) + ((length,) if offsets[-1] < length or len(offsets) == 1 else ())  # the padding


def _offsets(cu_seqlens) -> tuple[int, ...] | None:
    """``cu_seqlens`` (a tensor, an array or a sequence of ints) on the host."""
    if cu_seqlens is None:
        return None
    return tuple(int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens))
