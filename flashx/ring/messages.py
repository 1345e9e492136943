"""Messages: how the ranks of a ring reach each other.

A ring moves tensors three ways: ``shift`` hands each rank's items to the next rank (the ring
exchange: K/V forward, dK/dV backward); ``all_gather`` gives every rank every rank's items and
``reduce_scatter`` gives each rank the sum over the ranks of its own slice of theirs (the
all-gather exchange: K/V forward, dK/dV backward). ``shift`` and ``all_gather`` return the wait
for their result, so a step computes while its next message is on its way.
The ranks of a process group message each other over torch.distributed (``_GroupMessages``);
the ranks of a simulation are all in one process, where a message is a hand-off
(``SimulatedMessages``), as it is for a group of one. ``broadcast_seed`` gives every rank of
a group rank 0's dropout seed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class SimulatedMessages:
    """The messages of a simulation: every rank's items are in this process; each method returns
    the wait for its result, as a process group's do."""

    def shift(self, items: list) -> Callable[[], list]:
        """Rank r's items handed to rank r + 1."""
        received = items[-1:] + items[:-1]
        return lambda: received

    def all_gather(self, items: list) -> Callable[[], list]:
        """Every rank gets every rank's items, in rank order."""
        everything = list(items)
        return lambda: [everything] * len(everything)

    def reduce_scatter(self, items: list) -> list:
        """Rank r gets, of each tensor of its items, the sum over the ranks of its r-th slice."""
        return [tuple(sum(stacked[r] for stacked in same) for same in zip(*items)) for r in range(len(items))]


class _GroupMessages:
    """The messages of one rank of a process group: point-to-point to the next rank, posted together
    (``batch_isend_irecv``) and waited for only when needed, and the group's collectives."""

    def __init__(self, group, world_size: int, rank: int):
        self.group, self.world_size = group, world_size
        self.send_to, self.receive_from = (rank + 1) % world_size, (rank - 1) % world_size

    def shift(self, items: list) -> Callable[[], list]:
        (tensors,) = items
        # a head group's heads of a shard are a view, sent as a copy that lives until the wait
        sent = [x.contiguous() for x in tensors]
        received = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in tensors)
        operations = [dist.P2POp(dist.isend, x, group=self.group, group_peer=self.send_to) for x in sent]
        operations += [dist.P2POp(dist.irecv, x, group=self.group, group_peer=self.receive_from) for x in received]
        works = dist.batch_isend_irecv(operations)

        def wait() -> list:
            for work in works:
                work.wait()
            sent.clear()
            return [received]

        return wait

    def all_gather(self, items: list) -> Callable[[], list]:
        (tensors,) = items
        gathered = [torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device) for x in tensors]
        works = [dist.all_gather_into_tensor(out.flatten(0, 1), x.contiguous(), group=self.group, async_op=True)
                 for out, x in zip(gathered, tensors)]  # the ranks' shards one after another on the batch axis

        def wait() -> list:
            for work in works:
                work.wait()
            return [list(zip(*gathered))]

        return wait

    def reduce_scatter(self, items: list) -> list:
        (stacked,) = items
        mine = tuple(torch.empty(x.shape[1:], dtype=x.dtype, device=x.device) for x in stacked)
        for out, x in zip(mine, stacked):
            dist.reduce_scatter_tensor(out, x.flatten(0, 1), group=self.group)
        return [mine]


def group_messages(group, world_size: int, rank: int):
    """The messages of rank ``rank`` of ``group``; a group of one sends nothing."""
    return SimulatedMessages() if world_size == 1 else _GroupMessages(group, world_size, rank)


def broadcast_seed(seed: int, group, device) -> int:
    """Rank 0's seed on every rank (a drawn seed differs between processes)."""
    signed = torch.tensor([seed - (1 << 64) if seed >= 1 << 63 else seed], dtype=torch.int64, device=device)
    dist.broadcast(signed, group=group, group_src=0)
    return int(signed.item()) % (1 << 64)
