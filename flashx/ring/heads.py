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
heads numbers them from 0. In the packed layout its documents are renumbered (``HeadGroup.document``):
document d of group g is document d G + g of B G, the others empty, so that the stream
``(d G + g) Hq / G + h`` is the whole call's ``d Hq + (g Hq / G + h)``. The padded layout's batch
entries are the arrays' own, which no view renumbers, and no backend takes heads at an offset of
the stream: there dropout keeps one group (``checked_head_groups``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from flashx.errors import DTypeError, OptionError, UnsupportedError


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

    def document(self, document: int) -> int:
        """The number of packed document ``document`` in a call on the group's heads, whose dropout
        stream ``b * (Hq / G) + h`` is then the whole call's ``b * Hq + h``."""
        return document * self.count + self.index


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


def checked_head_groups(head_groups, problem, packed: bool) -> int | None:
    """A ring call's ``head_groups`` checked against its whole sequence's ``problem``: the count, or
    None where the default (the fewest groups within twice one device's memory) is to be chosen.
    The padded layout with dropout takes one group (the module's docstring says why)."""
    count = None if head_groups is None else check_head_count(head_groups, problem.heads_k)
    if problem.dropout_p > 0 and not packed:
        if count not in (None, 1):
            raise UnsupportedError(
                f"head_groups: the padded (B, N, H, D) layout with dropout runs the backward in one group, got "
                f"{count}. A call on a group of heads draws the dropout mask by b * Hq + h from its first head, and "
                f"no backend takes heads at an offset of that stream (as dropout_offsets takes positions); packed "
                f"input (cu_seqlens) renumbers its documents instead and takes any head_groups")
        return 1
    return count
