"""Sequences: which rows and keys of a pair of chunks meet, and the backend calls that serve them.

The sequences are the batch entries, each as long as the whole axis or as its ``seqlens`` entry,
or the documents of a packed axis (``cu_seqlens``), which may span chunks and ranks. A chunk is
a list of intervals of the axis (``flashx.ring.layouts``); each interval's parts that one
sequence holds are its pieces. For each pair of a query chunk and a key chunk, each pair of a
query piece and a key piece of one sequence gives a fragment: just the rows and keys that the
causal or window band lets meet, the band becoming a window in the fragment's own coordinates
(``pair_call``). Fragments that share their window and dropout offsets and lie side by side
make one backend call (``Sequences.calls``), a packed call with one entry of ``cu_seqlens`` per
document; a pair no sequence joins is skipped, and with it whole steps of a causal contiguous
ring. In the layouts that cut the packed axis as one sequence, two different chunks are joined
by at most one document (a document is an interval), so an off-diagonal pair is one call and a
diagonal pair one call for the documents that start in the chunk and one for the document that
began before it. In "document_zigzag" every document joins every pair of chunks, its pieces in
the two chunks at the same places relative to its length: causal attention gives every
document's fragment the same band (whole, none or the diagonal), and a pair is one call however
many documents it holds. A window, or dropout's offsets, which move with a document's length,
part documents of different lengths into calls of their own. Dropout is drawn at positions
within each sequence (the ``dropout_offsets`` option, and the sequence's own index in the call:
its batch entry, or its document in a packed call; calls on a group of heads renumber them, each
padded entry then a packed call of its own: ``flashx.ring.heads``), so the mask is the one
``flashx.attention`` draws on the whole sequence, bit for bit.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from flashx.ring.heads import HeadGroup
from flashx.ring.layouts import Interval


def pair_call(band, query_start: int, rows: int, key_start: int, keys: int):
    """(rows, keys, window, offsets) of the call for ``rows`` query positions and ``keys`` key
    positions of one sequence, starting at these positions in it; None where the band allows no pair.

    The key at position y is allowed for the query at x iff -left <= y - x <= right (the
    sequence's band; its query and key lengths are equal, so the diagonal is y = x; -1 is
    unbounded). For row i and key j, y - x = j - i + key_start - query_start, so j - i must lie
    in [lo, hi]. Row i meets a key iff i + hi >= 0 and i + lo < keys, key j a row iff
    j - hi < rows and j >= lo: the call takes rows [a, e) and keys [s, f). Its own band is
    centred on j' - i' = (f - s) - (e - a) (bottom-right), and j - i = j' - i' + s - a, so its
    window is (f - e - lo, hi - f + e): both sides >= 0 by the choice of e and f, and -1 where no
    pair of the call reaches that side.
    """
    left, right = band or (-1, -1)
    shift = key_start - query_start
    lo = -math.inf if left == -1 else -left - shift
    hi = math.inf if right == -1 else right - shift
    a, e = max(0, -hi), min(rows, keys - lo)
    s, f = max(0, lo), min(keys, rows + hi)
    if a >= e or s >= f:
        return None
    a, e, s, f = int(a), int(e), int(s), int(f)
    near = -1 if lo <= 1 - (f - s) + (f - e) else f - e - lo
    far = -1 if hi >= e - a - 1 + (f - e) else hi - f + e
    window = None if near == far == -1 else (int(near), int(far))
    return slice(a, e), slice(s, f), window, (query_start + a, key_start + s)


@dataclass(frozen=True)
class _Fragment:
    """The rows and keys of one sequence that a pair of chunks lets meet (rows of the query shard,
    keys of the K/V shard), the window of their call and the positions of their first row and key
    in the sequence."""

    sequence: int
    rows: slice
    keys: slice
    window: tuple[int, int] | None
    offsets: tuple[int, int] | None  # None without dropout: the draw's positions do not matter


class _Piece(NamedTuple):
    """Shard rows [row, row + length) holding positions [position, position + length) of one sequence."""

    sequence: int
    row: int
    position: int
    length: int


@dataclass(frozen=True)
class Sequences:
    """The sequences of a ring call: the batch entries of the padded layout with their lengths,
    or the documents of the packed layout with their offsets on its one sequence axis."""

    lengths: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None

    @property
    def packed(self) -> bool:
        return self.offsets is not None

    def batched(self, x):
        """A shard as the ring holds it: (B, N/W, ...), packed as one batch entry."""
        return x.unsqueeze(0) if self.packed else x

    def unbatched(self, x):
        return x.squeeze(0) if self.packed else x

    def fragments(self, band, query_chunk: list[Interval], key_chunk: list[Interval], dropout: bool) -> list[_Fragment]:
        """Every sequence's fragments of a query chunk and a key chunk, given as their intervals,
        in the order of the query chunk's rows: rows and keys are the shards' own."""
        key_pieces = {}
        for piece in self._pieces(key_chunk):
            key_pieces.setdefault(piece.sequence, []).append(piece)
        found = []
        for query in self._pieces(query_chunk):
            for key in key_pieces.get(query.sequence, ()):
                pair = pair_call(band, query.position, query.length, key.position, key.length)
                if pair is not None:
                    rows, keys, window, offsets = pair
                    found.append(_Fragment(query.sequence, _shifted(rows, query.row), _shifted(keys, key.row),
                                           window, offsets if dropout else None))
        return found

    def _pieces(self, chunk: list[Interval]) -> Iterator[_Piece]:
        """The parts of ``chunk``'s intervals that each sequence holds, in the chunk's order."""
        for interval in chunk:
            start, stop = interval.position, interval.position + interval.length
            if self.packed:  # the documents that meet the interval
                first = bisect.bisect_right(self.offsets, start) - 1
                last = min(bisect.bisect_left(self.offsets, stop), len(self.offsets) - 1)
                spans = [(d, self.offsets[d], self.offsets[d + 1]) for d in range(first, last)]
            else:
                spans = [(b, 0, length) for b, length in enumerate(self.lengths)]
            for sequence, begin, end in spans:
                x0, x1 = max(start, begin), min(stop, end)
                if x0 < x1:
                    yield _Piece(sequence, interval.row + x0 - start, x0 - begin, x1 - x0)

    def calls(self, fragments: list[_Fragment], head_group: HeadGroup | None = None) -> list[tuple]:
        """(batch, rows, keys, window, offsets, lengths) of each backend call that serves
        ``fragments``: batch indexes the (B, N/W, ...) shards' batch axis (every entry, or one, whose
        axis it drops), lengths are the keywords (``seqlens_*`` or ``cu_seqlens_*``) as host lists,
        or {}. ``head_group``: the calls of a group of heads with dropout, whose sequences are
        renumbered as their dropout streams need (``flashx.ring.heads``); in the padded layout each
        batch entry is then a packed call of its own, the one way to renumber it."""
        if self.packed:  # documents side by side, with one window and offsets: one packed call
            groups = []
            for fragment in fragments:
                last = groups[-1][-1] if groups else None
                if (last is not None and (last.window, last.offsets) == (fragment.window, fragment.offsets)
                        and last.rows.stop == fragment.rows.start and last.keys.stop == fragment.keys.start
                        and last.sequence < fragment.sequence):  # cu_seqlens lists the documents in order, once
                    groups[-1].append(fragment)
                else:
                    groups.append([fragment])
            return [(0, slice(group[0].rows.start, group[-1].rows.stop),
                     slice(group[0].keys.start, group[-1].keys.stop), group[0].window, group[0].offsets,
                     self._packed_lengths(group, head_group)) for group in groups]
        if head_group is not None:
            return [(f.sequence, f.rows, f.keys, f.window, f.offsets, self._packed_lengths([f], head_group))
                    for f in fragments]
        groups = {}  # batch entries with one fragment: one padded call, the others' lengths 0
        for fragment in fragments:
            key = (fragment.rows.start, fragment.rows.stop, fragment.keys.start, fragment.keys.stop, fragment.window,
                   fragment.offsets)
            groups.setdefault(key, (fragment, set()))[1].add(fragment.sequence)
        calls = []
        for (first, members) in groups.values():
            rows, keys = first.rows, first.keys
            lengths = {}
            if len(members) < len(self.lengths):
                lengths = {"seqlens_q": [_length(rows) * (b in members) for b in range(len(self.lengths))],
                           "seqlens_k": [_length(keys) * (b in members) for b in range(len(self.lengths))]}
            calls.append((slice(None), rows, keys, first.window, first.offsets, lengths))
        return calls

    def _packed_lengths(self, fragments: list[_Fragment], head_group: HeadGroup | None) -> dict:
        """The cu_seqlens of a packed call of ``fragments``, side by side in sequence order: one
        document per sequence, empty but for theirs, renumbered for ``head_group``."""
        counts = {f.sequence: (_length(f.rows), _length(f.keys)) for f in fragments}
        documents = len(self.offsets) - 1 if self.packed else len(self.lengths)
        if head_group is not None:
            counts = {head_group.document(d): lengths for d, lengths in counts.items()}
            documents *= head_group.count
        cu_q = [0] + list(itertools.accumulate(counts.get(d, (0, 0))[0] for d in range(documents)))
        cu_k = [0] + list(itertools.accumulate(counts.get(d, (0, 0))[1] for d in range(documents)))
        return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}


def _shifted(part: slice, by: int) -> slice:
    return slice(part.start + by, part.stop + by)


def _length(part: slice) -> int:
    return part.stop - part.start
