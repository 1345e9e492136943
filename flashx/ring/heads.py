"""Head groups: the ring's backward one group of KV heads at a time.

What makes a rank of the ring hold more than one device are the backward's sums in the LSE's
precision (dq's, the dK/dV that travel) and the K/V shards in flight, and each head's are
independent of every other head's. So the backward may traverse the ring once per group of
consecutive KV heads with the query heads that read them (grouped-query attention's groups kept
whole), holding one group's sums and shards at a time: 1/G of those buffers, for G times the
calls and messages, each on 1/G of the heads (G times the launches and the latency). Each group's
results are written into the whole gradients once summed. The forward holds no sums of that size
and runs every head at once.

A call's arithmetic is per head, so a group's results are those of every head's calls, bit for
bit, but for the dropout mask, whose Philox stream is ``b * Hq + h``: a call on a group's Hq / G
heads numbers them from 0, and no backend takes heads at an offset of the stream (as
``dropout_offsets`` takes positions). So with dropout a group's calls renumber their sequences
(``HeadGroup.document``): sequence b of group g is document b G + g of a packed call of B G
documents, the others empty, whose stream ``(b G + g) Hq / G + h`` is the whole call's
``b Hq + (g Hq / G + h)``. Packed documents are renumbered in the packed calls they make; a
padded batch entry, which no view of the (B, N, H, D) arrays renumbers, becomes a packed call of
its own (``flashx.ring.sequences``): one call per entry where the padded layout makes one for all.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from flashx.errors import DTypeError, OptionError


@dataclass(frozen=True)
class HeadGroup:
    """Group ``index`` of ``count``: query heads [index Hq/G, (index + 1) Hq/G) of the (B, N, Hq, D)
    q, o, do and (B, Hq, N) lse, KV heads [index Hk/G, (index + 1) Hk/G) of k and v."""

    index: int
    count: int
    heads_q: int  # of the group
    heads_k: int

    def queries_of(self, x):
        """The group's heads of q, o, do or dq, a view."""
        return x[:, :, self.index * self.heads_q : (self.index + 1) * self.heads_q]

    def keys_of(self, x):
        """The group's heads of k, v, dk or dv, a view."""
        return x[:, :, self.index * self.heads_k : (self.index + 1) * self.heads_k]

    def lse_of(self, lse):
        return lse[:, self.index * self.heads_q : (self.index + 1) * self.heads_q]

    def document(self, sequence: int) -> int:
        """The document that ``sequence`` (a packed document or a padded batch entry) is in a packed
        call on the group's heads, whose dropout stream ``b * (Hq / G) + h`` is then the whole
        call's ``b * Hq + h``."""
        return sequence * self.count + self.index


def split_heads(count: int, heads_q: int, heads_k: int) -> list[HeadGroup]:
    """The ``count`` groups of Hq query and Hk KV heads, ``count`` dividing Hk (and so Hq)."""
    return [HeadGroup(index, count, heads_q // count, heads_k // count) for index in range(count)]


def check_head_count(head_groups, heads_k: int) -> int:
    """``head_groups`` as an int: a positive one dividing Hk; ``DTypeError`` for another type (a
    bool included), ``OptionError`` for another value."""
    expected = f"a positive int dividing Hk = {heads_k}, or None"
    if not isinstance(head_groups, numbers.Integral) or isinstance(head_groups, bool):
        raise DTypeError(f"head_groups: expected {expected}, got {head_groups!r}")
    if head_groups <= 0 or heads_k % head_groups:
        raise OptionError(f"head_groups: expected {expected}, got {head_groups!r}")
    return int(head_groups)
