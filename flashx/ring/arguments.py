"""Arguments: a ring call's keywords and shards checked, and the whole sequence they describe.

Every rank checks its shard by validating, as ``flashx.attention`` does, a view of the whole
sequence's shape (``_as_whole``), with ``seqlens`` or ``cu_seqlens`` as the lengths of both
sides: the errors (naming the ring's keywords), and the scale and seed drawn, are those of one
device's call on the whole sequence. The result is the whole sequence's ``Problem``, which every
step's call starts from, and its ``Sequences``. ALiBi is declined: a step's call measures
its distance from the call's own diagonal, not the sequence's.
"""

from __future__ import annotations

from flashx import arrays
from flashx.errors import DTypeError, FlashXError, ShapeError, UnsupportedError
from flashx.options import complete
from flashx.ring.layouts import chunks_per_rank, segments
from flashx.ring.schedule import check_exchange
from flashx.ring.sequences import Sequences
from flashx.validation import build_problem


def shard_problem(q, k, v, layout: str, exchange: str, world_size: int, options: dict, seqlens, cu_seqlens):
    """One shard's keywords and shapes checked: the whole sequence's ``Problem`` (band, scale and
    seed drawn) and its ``Sequences``."""
    require_torch(q)
    if options["alibi_slopes"] is not None:
        raise UnsupportedError(
            "alibi_slopes: ring attention does not take ALiBi. Each ring step is a backend call on a pair of "
            "chunks, which measures ALiBi's distance from its own bottom-right diagonal, not the whole "
            "sequence's, and no backend takes ALiBi at offset positions (as dropout_offsets does for dropout)")
    check_exchange(exchange)
    if seqlens is not None and cu_seqlens is not None:
        raise ShapeError("seqlens: indexes the padded layout and cannot be combined with cu_seqlens, got both")
    chunks = chunks_per_rank(layout)
    axis = 0 if cu_seqlens is not None else 1
    if q.ndim != (3 if axis == 0 else 4) or k.ndim != q.ndim:
        expected = "(T/W, H, D) with cu_seqlens" if axis == 0 else "(B, N/W, H, D)"
        raise ShapeError(f"q: expected a shard of shape {expected}, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[axis] != q.shape[axis]:
        raise ShapeError(f"k: expected a shard as long as q's ({q.shape[axis]} positions), got shape {tuple(k.shape)}")
    if q.shape[axis] % chunks:
        raise ShapeError(f"q: layout {layout!r} holds {chunks} equal chunks per rank: expected a shard length "
                         f"divisible by {chunks}, got shape {tuple(q.shape)}")
    lengths = {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens} if axis == 0 else \
        {"seqlens_q": seqlens, "seqlens_k": seqlens}
    whole = [_as_whole(x, axis, world_size) for x in (q, k, v)]
    try:
        problem = build_problem(*whole, **complete("ring_attention", {**options, **lengths}))
    except FlashXError as error:  # the ring's argument is one array for both sides
        message = str(error)
        for name in lengths:
            message = message.replace(f"{name}:", f"{name[:-2]}:")
        raise type(error)(message) from None
    offsets = tuple(int(x) for x in arrays.to_host(problem.cu_seqlens_q)) if axis == 0 else None
    segments(layout, world_size, q.shape[axis] * world_size, offsets)  # the documents the layout cuts, checked
    if axis == 0:
        sequences = Sequences(offsets=offsets)
    else:
        length = q.shape[1] * world_size
        given = [length] * q.shape[0] if seqlens is None else arrays.to_host(problem.seqlens_q)
        sequences = Sequences(lengths=tuple(int(x) for x in given))
    return problem, sequences


def _as_whole(x, axis: int, world_size: int):
    """A view of the whole sequence's shape, for validation only (it repeats one row; nothing reads it)."""
    shape = list(x.shape)
    shape[axis] *= world_size
    return x.narrow(axis, 0, min(1, x.shape[axis])).expand(shape) if x.shape[axis] else x


def caller_sinks(sinks):
    """The caller's sinks as autograd's input (the problem holds a detached copy for the steps)."""
    return None if sinks is None else arrays.resolved(sinks)


def require_torch(q) -> None:
    """Raise ``DTypeError`` unless ``q`` is a torch tensor."""
    if arrays.kind_of(q) != "torch":
        raise DTypeError(f"q: expected a torch tensor (ring attention runs on torch.distributed), "
                         f"got {type(q).__name__}")
