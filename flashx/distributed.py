"""Context-parallel (ring) attention on torch.distributed: the contract's "Ring attention" section.

Each of the W ranks of a process group holds one shard of the sequence axis of q, k and v.
The K/V shards travel once around the ring of ranks: at each step a rank attends its queries
to the shard it holds, through any flashx backend, and folds the partial result into its
running one as the contract's "Merging partial results" says, while the next shard is already
on its way. The backward recomputes each step from the global LSE; the dK/dV of a shard travel
around the ring with it, each rank adding its part, and reach the shard's owner after a full
turn. ``exchange="all_gather"`` gathers every K/V shard at once instead (the step on the rank's
own shard runs while the gather is under way) and sums the dK/dV of every shard over the group at
the end (a reduce-scatter): the same steps, fewer and larger messages, memory for the whole
sequence's K/V.

Positions. A shard is one chunk of the sequence axis (layout "contiguous") or two (layout
"zigzag": of 2W equal chunks rank r holds r and 2W - 1 - r, which balances the causal work).
The sequences are the batch entries, each as long as the whole axis or as its ``seqlens`` entry,
or the documents of a packed axis (``cu_seqlens``), which may span chunks and ranks. For each
pair of a query chunk and a key chunk, each sequence that joins them gives a fragment: just the
rows and keys that the causal or window band lets meet, the band becoming a window in the
fragment's own coordinates (``_pair``). Fragments that share their window and dropout offsets
and lie side by side make one backend call (``_Sequences.calls``); a pair no sequence joins is
skipped, and with it whole steps of a causal contiguous ring. Two different chunks are joined
by at most one document (a document is an interval), so an off-diagonal pair of a packed axis
is one call; a diagonal pair is one call for the documents that start in the chunk and one for
the document that began before it. Dropout is drawn at positions within each sequence (the
``dropout_offsets`` option, and the sequence's own index in a packed call), so the mask is the
one ``flashx.attention`` draws on the whole sequence, bit for bit.

Memory. Partial results, dq and the travelling dK/dV are summed in the LSE's precision
(float32 for 16-bit inputs): each is a sum of W parts, and rounding the running sum to 16 bits
at every step would add an error that grows with W, which the contract's exactness rule does
not allow. What travels unchanged, the K/V shards, travels in the input dtype. The backward
holds two sets of dK/dV per rank, not three: a step's first call runs while the dK/dV of the
shard it reads are still arriving, its parts are then added into the arrived buffer, the step's
other calls add straight into it, and that buffer is sent on. ``peak_bytes_per_token`` counts
every buffer of both exchanges.

Score modifications. A softcap acts on each score alone, so every step's call takes it. The sink
belongs to no step: the steps are computed without it, and each rank joins the sink's state
(o = 0, lse = σ) into its rows once, after the last step (``_join_sink``), so the lse the
backward recomputes from holds it and dq, dk, dv need nothing more. dsinks is each rank's own
rows' terms (``_sink_gradient``), reaching the caller's ``sinks`` through autograd; the ranks'
parts add up to the whole sequence's, as the parts of every parameter's gradient do under
context parallelism (the contract's Ring attention section says why no all-reduce). ALiBi is
declined: a step's call measures its distance from the call's own diagonal, not the sequence's.

``simulate_ring_attention`` runs the steps of all W ranks in one process, without a process
group, to check the kernels and the merging on one device.

Importing this module imports torch; ``import flashx`` does not import this module.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from flashx import arrays
from flashx.api import merge_states
from flashx.errors import DTypeError, FlashXError, OptionError, ShapeError, UnsupportedError
from flashx.execute import run_backward, run_forward
from flashx.options import complete
from flashx.plan import plan
from flashx.problem import Problem
from flashx.validation import build_problem

#: layout -> chunks of the sequence per rank
LAYOUTS = {"contiguous": 1, "zigzag": 2}
#: how the K/V shards reach every rank
EXCHANGES = ("ring", "all_gather")


def ring_attention(q, k, v, *, group=None, layout="zigzag", exchange="ring", causal=False, window=None,
                   softmax_scale=None, softcap=None, alibi_slopes=None, sinks=None, seqlens=None, cu_seqlens=None,
                   dropout_p=0.0, seed=None, rng_offset=0, return_lse=False, backend="auto"):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the whole world).

    Padded: q (B, N/W, Hq, D), k (B, N/W, Hk, D), v (B, N/W, Hk, Dv), this rank's shard in
    ``layout`` ("zigzag" or "contiguous"; ``shard`` cuts a whole sequence so), with ``seqlens``
    (B,) the whole sequences' lengths if given. Packed: q (T/W, Hq, D), k and v likewise, with
    ``cu_seqlens`` (B + 1,) the offsets of the documents in the whole packed sequence of T rows
    (every rank passes the same). Returns this rank's rows of ``flashx.attention`` on the whole
    sequence with the same keywords: o, and with ``return_lse`` lse ((B, Hq, N/W), or (Hq, T/W)
    packed). ``exchange`` "ring" (the default) passes K/V shards from rank to rank; "all_gather"
    gathers them at once, for more memory (``peak_bytes_per_token``). Differentiable through
    torch autograd; every rank of the group must make the call, with equal shapes and keywords,
    and run its backward. With ``seed=None`` and dropout, rank 0 draws the seed and sends it to
    the others. ``sinks`` (Hq,), equal on every rank, receives the dsinks terms of this rank's
    rows: the ranks' sum is the whole sequence's. ``alibi_slopes`` is declined
    (``UnsupportedError``, with the reason).
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ShapeError("group: expected a process group this process belongs to")
    options = dict(causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, seed=seed, rng_offset=rng_offset)
    problem, sequences = _shard_problem(q, k, v, layout, exchange, world_size, options, seqlens, cu_seqlens)
    if seed is None and problem.dropout_p > 0:
        problem = dataclasses.replace(problem, seed=_broadcast_seed(problem.seed, group, q.device))
    q4, k4, v4 = (sequences.batched(x) for x in (q, k, v))
    ranks = [_Rank(rank, world_size, layout, problem, sequences, backend, q4, k4, v4)]
    o, lse = _RingAttention.apply(_Ring(ranks, _group_messages(group, world_size, rank), exchange, problem.sinks),
                                  _caller_sinks(sinks), q4, k4, v4)
    o, lse = sequences.unbatched(o), sequences.unbatched(lse)
    return (o, lse) if return_lse else o


def simulate_ring_attention(q, k, v, world_size, *, layout="zigzag", exchange="ring", causal=False, window=None,
                            softmax_scale=None, softcap=None, alibi_slopes=None, sinks=None, seqlens=None,
                            cu_seqlens=None, dropout_p=0.0, seed=None, rng_offset=0, return_lse=False,
                            backend="auto"):
    """``ring_attention`` of ``world_size`` ranks in one process, without a process group.

    q, k, v hold the whole sequence, (B, N, H, D) or packed (T, H, D); each rank's shard is cut
    by ``shard``, the ranks run the very steps and merges of ``ring_attention`` in turn, and
    "sending" a shard hands it to the next rank's step. Returns the whole-sequence o (and lse),
    differentiable; ``sinks``, one tensor for every rank, receives the sum of their dsinks.
    """
    options = dict(causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, seed=seed, rng_offset=rng_offset)
    _require_torch(q)
    axis = 0 if cu_seqlens is not None else 1
    shards = [[shard(x, world_size, rank, layout, dim=axis) for rank in range(world_size)] for x in (q, k, v)]
    problem, sequences = _shard_problem(shards[0][0], shards[1][0], shards[2][0], layout, exchange, world_size,
                                        options, seqlens, cu_seqlens)
    shards = [[sequences.batched(x) for x in xs] for xs in shards]
    ranks = [_Rank(rank, world_size, layout, problem, sequences, backend, *(xs[rank] for xs in shards))
             for rank in range(world_size)]
    outputs = _RingAttention.apply(_Ring(ranks, _SimulatedMessages(), exchange, problem.sinks), _caller_sinks(sinks),
                                   *shards[0], *shards[1], *shards[2])
    o = unshard([sequences.unbatched(x) for x in outputs[:world_size]], layout, dim=axis)
    lse = unshard([sequences.unbatched(x) for x in outputs[world_size:]], layout, dim=axis + 1)
    return (o, lse) if return_lse else o


def shard(x, world_size: int, rank: int, layout: str = "zigzag", dim: int = 1):
    """Rank ``rank``'s shard of the whole-sequence tensor ``x`` in ``layout``; ``dim`` is the
    sequence axis (1 for padded q, k, v and o, 2 for their lse; 0 and 1 packed)."""
    chunks = _chunks_per_rank(layout)
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
    if _chunks_per_rank(layout) == 1:
        return torch.cat(list(shards), dim)
    halves = [x.chunk(2, dim) for x in shards]
    return torch.cat([first for first, _ in halves] + [second for _, second in reversed(halves)], dim)


def peak_bytes_per_token(heads_q: int, heads_k: int, head_dim: int, dtype, *, world_size: int,
                         layout: str = "zigzag", exchange: str = "ring", head_dim_v: int | None = None) -> dict:
    """The bytes a rank holds per token of its shard at the peak of a forward and backward, as the
    contract's "Ring attention" section counts them, beside one device's ``flashx.attention``.

    Returns {"single": ..., "ring": ..., "terms": {buffer: bytes}}: one device's q, k, v, o, do and
    their gradients, and the ring's buffers at its peak, the backward's first call of a middle step
    (``exchange`` "ring" or "all_gather"). Rows are in the input dtype ``dtype``, sums in the LSE's
    precision. One call reads a chunk of the shard's rows and keys (half of it in the zigzag
    layout). Kernels' own workspace is left out (a backend's, alike on one device and in the ring).
    """
    size = torch.empty((), dtype=dtype).element_size()
    wide = _accumulation_dtype(torch.empty((), dtype=dtype)).itemsize / size
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q, o = heads_q * head_dim * size, heads_q * head_dim_v * size  # a row of q (and dq), of o (and do)
    kv = heads_k * (head_dim + head_dim_v) * size  # a row of k and of v (and of dk and dv)
    _check_exchange(exchange)
    terms = {"q, o, do, k, v (the caller's)": q + 2 * o + kv, "dq summed": wide * q,
             "a call's dq, dk, dv parts": (q + kv) / _chunks_per_rank(layout)}
    if exchange == "ring":  # two ranks: the second shard arrives while the rank's own is read, then is read alone
        terms["K/V held and arriving"] = min(world_size - 1, 2) * kv
        terms["dK/dV arriving and sent on (two sets)"] = 2 * wide * kv
    else:
        terms["K/V of every shard, gathered"] = world_size * kv
        terms["dK/dV of every shard, summed"] = world_size * wide * kv
    return {"single": 2 * (q + o + kv), "ring": sum(terms.values()), "terms": terms}


def _check_exchange(exchange) -> None:
    if exchange not in EXCHANGES:
        raise OptionError(f"exchange: expected one of {', '.join(map(repr, EXCHANGES))}, got {exchange!r}")


def _chunks_per_rank(layout) -> int:
    if layout not in LAYOUTS:
        raise ShapeError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return LAYOUTS[layout]


def _chunk_starts(layout: str, world_size: int, rank: int, size: int) -> tuple[int, ...]:
    """The sequence position of each chunk of ``rank``'s shard, in shard order."""
    if layout == "contiguous":
        return (rank * size,)
    return (rank * size, (2 * world_size - 1 - rank) * size)


def _chunks(layout: str, world_size: int, rank: int, size: int) -> list[tuple[int, int]]:
    """(first row in the shard, sequence position) of each chunk of ``rank``'s shard."""
    return [(chunk * size, start) for chunk, start in enumerate(_chunk_starts(layout, world_size, rank, size))]


def _shard_problem(q, k, v, layout: str, exchange: str, world_size: int, options: dict, seqlens, cu_seqlens):
    """One shard's keywords and shapes checked: the whole sequence's ``Problem`` (band, scale and
    seed drawn) and its ``_Sequences``."""
    _require_torch(q)
    if options["alibi_slopes"] is not None:
        raise UnsupportedError(
            "alibi_slopes: ring attention does not take ALiBi. Each ring step is a backend call on a pair of "
            "chunks, which measures ALiBi's distance from its own bottom-right diagonal, not the whole "
            "sequence's, and no backend takes ALiBi at offset positions (as dropout_offsets does for dropout)")
    _check_exchange(exchange)
    if seqlens is not None and cu_seqlens is not None:
        raise ShapeError("seqlens: indexes the padded layout and cannot be combined with cu_seqlens, got both")
    chunks = _chunks_per_rank(layout)
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
    if axis == 0:
        sequences = _Sequences(offsets=tuple(int(x) for x in arrays.to_host(problem.cu_seqlens_q)))
    else:
        length = q.shape[1] * world_size
        given = [length] * q.shape[0] if seqlens is None else arrays.to_host(problem.seqlens_q)
        sequences = _Sequences(lengths=tuple(int(x) for x in given))
    return problem, sequences


def _as_whole(x, axis: int, world_size: int):
    """A view of the whole sequence's shape, for validation only (it repeats one row; nothing reads it)."""
    shape = list(x.shape)
    shape[axis] *= world_size
    return x.narrow(axis, 0, min(1, x.shape[axis])).expand(shape) if x.shape[axis] else x


def _caller_sinks(sinks):
    """The caller's sinks as autograd's input (the problem holds a detached copy for the steps)."""
    return None if sinks is None else arrays.resolved(sinks)


def _require_torch(q) -> None:
    if arrays.kind_of(q) != "torch":
        raise DTypeError(f"q: expected a torch tensor (ring attention runs on torch.distributed), "
                         f"got {type(q).__name__}")


def _broadcast_seed(seed: int, group, device) -> int:
    """Rank 0's seed on every rank (a drawn seed differs between processes)."""
    signed = torch.tensor([seed - (1 << 64) if seed >= 1 << 63 else seed], dtype=torch.int64, device=device)
    dist.broadcast(signed, group=group, group_src=0)
    return int(signed.item()) % (1 << 64)


def _pair(band, query_start: int, rows: int, key_start: int, keys: int):
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
    """The rows and keys of one sequence that a pair of chunks lets meet (chunk-relative), the
    window of their call and the positions of their first row and key in the sequence."""

    sequence: int
    rows: slice
    keys: slice
    window: tuple[int, int] | None
    offsets: tuple[int, int] | None  # None without dropout: the draw's positions do not matter


@dataclass(frozen=True)
class _Sequences:
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

    def fragments(self, band, size: int, query_start: int, key_start: int, dropout: bool) -> list[_Fragment]:
        """Every sequence's fragment of a query chunk and a key chunk of ``size`` positions."""
        if self.packed:  # the documents that meet the query chunk
            first = bisect.bisect_right(self.offsets, query_start) - 1
            last = min(bisect.bisect_left(self.offsets, query_start + size), len(self.offsets) - 1)
            spans = [(d, self.offsets[d], self.offsets[d + 1]) for d in range(first, last)]
        else:
            spans = [(b, 0, length) for b, length in enumerate(self.lengths)]
        found = []
        for sequence, begin, end in spans:
            x0, x1 = max(query_start, begin), min(query_start + size, end)
            y0, y1 = max(key_start, begin), min(key_start + size, end)
            pair = _pair(band, x0 - begin, x1 - x0, y0 - begin, y1 - y0) if x0 < x1 and y0 < y1 else None
            if pair is not None:
                rows, keys, window, offsets = pair
                found.append(_Fragment(sequence, _shifted(rows, x0 - query_start), _shifted(keys, y0 - key_start),
                                       window, offsets if dropout else None))
        return found

    def calls(self, fragments: list[_Fragment]) -> list[tuple]:
        """(rows, keys, window, offsets, lengths) of each backend call that serves ``fragments``:
        lengths are the keywords (``seqlens_*`` or ``cu_seqlens_*``) as host lists, or {}."""
        if self.packed:  # documents side by side, with one window and offsets: one packed call
            groups = []
            for fragment in fragments:
                last = groups[-1][-1] if groups else None
                if (last is not None and (last.window, last.offsets) == (fragment.window, fragment.offsets)
                        and last.rows.stop == fragment.rows.start and last.keys.stop == fragment.keys.start):
                    groups[-1].append(fragment)
                else:
                    groups.append([fragment])
            calls = []
            for group in groups:
                rows, keys = slice(group[0].rows.start, group[-1].rows.stop), slice(group[0].keys.start,
                                                                                    group[-1].keys.stop)
                counts = {f.sequence: (_length(f.rows), _length(f.keys)) for f in group}
                documents = len(self.offsets) - 1
                cu_q = [0] + list(itertools.accumulate(counts.get(d, (0, 0))[0] for d in range(documents)))
                cu_k = [0] + list(itertools.accumulate(counts.get(d, (0, 0))[1] for d in range(documents)))
                calls.append((rows, keys, group[0].window, group[0].offsets,
                              {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}))
            return calls
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
            calls.append((rows, keys, first.window, first.offsets, lengths))
        return calls


def _shifted(part: slice, by: int) -> slice:
    return slice(part.start + by, part.stop + by)


def _length(part: slice) -> int:
    return part.stop - part.start


@dataclass(frozen=True)
class _Call:
    """One backend call of a step: query rows ``rows`` of the shard against keys ``keys`` of the
    K/V shard held (of every batch entry, or of the packed axis), planned once."""

    rows: slice
    keys: slice
    batch: object  # index of the batch axis: every entry (padded) or the one packed axis (then dropped)
    problem: Problem
    impl: object


class _Rank:
    """One rank's part of a ring call: for the K/V shard of each source rank, the calls of its step.
    Calls are planned (validated, a backend chosen) once, from this rank's shards, whose shapes
    every source's shard shares."""

    def __init__(self, index: int, world_size: int, layout: str, problem: Problem, sequences: _Sequences, backend,
                 q, k, v):
        self.index = index
        size = q.shape[1] // LAYOUTS[layout]
        mine = _chunks(layout, world_size, index, size)
        common = dict(softmax_scale=problem.softmax_scale, softcap=problem.softcap, dropout_p=problem.dropout_p,
                      seed=problem.seed, rng_offset=problem.rng_offset)
        batch = 0 if sequences.packed else slice(None)
        self.calls = []
        for source in range(world_size):
            calls = []
            for (row0, query_start), (key0, key_start) in itertools.product(mine, _chunks(layout, world_size, source,
                                                                                           size)):
                fragments = sequences.fragments(problem.band, size, query_start, key_start, problem.dropout_p > 0)
                for rows, keys, window, offsets, lengths in sequences.calls(fragments):
                    rows, keys = _shifted(rows, row0), _shifted(keys, key0)
                    lengths = {name: torch.tensor(x, dtype=torch.int32, device=q.device) for name, x in lengths.items()}
                    options = complete("ring_attention", dict(common, window=window, dropout_offsets=offsets, **lengths))
                    calls.append(_Call(rows, keys, batch, *plan(q[batch, rows], k[batch, keys], v[batch, keys],
                                                                 backend, options)))
            self.calls.append(calls)

    def forward_step(self, q, k, v, source: int, o, lse) -> None:
        """Fold the attention of this rank's queries to ``source``'s K/V shard into (o, lse)."""
        for call in self.calls[source]:
            rows, lse_rows = (call.batch, call.rows), (call.batch, slice(None), call.rows)
            o_part, lse_part = run_forward(call.impl, call.problem, q[rows], k[call.batch, call.keys],
                                           v[call.batch, call.keys])
            o[rows], lse[lse_rows] = merge_states(o[rows], lse[lse_rows], o_part, lse_part)

    def backward_parts(self, q, k, v, o, lse, do, source: int, dq) -> Iterator[tuple]:
        """Add each call's part of dq to ``dq``, and yield (keys index, its dk part, its dv part)
        for ``source``'s shard, one call at a time."""
        for call in self.calls[source]:
            rows, keys = (call.batch, call.rows), (call.batch, call.keys)
            dq_part, dk_part, dv_part = run_backward(call.impl, call.problem, q[rows], k[keys], v[keys], o[rows],
                                                     lse[call.batch, :, call.rows], do[rows])
            dq[rows] += dq_part
            yield keys, dk_part, dv_part


class _SimulatedMessages:
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
        received = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in tensors)
        operations = [dist.P2POp(dist.isend, x, group=self.group, group_peer=self.send_to) for x in tensors]
        operations += [dist.P2POp(dist.irecv, x, group=self.group, group_peer=self.receive_from) for x in received]
        works = dist.batch_isend_irecv(operations)

        def wait() -> list:
            for work in works:
                work.wait()
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


def _group_messages(group, world_size: int, rank: int):
    return _SimulatedMessages() if world_size == 1 else _GroupMessages(group, world_size, rank)


class _Ring:
    """The ranks this process runs (one, or all of them in a simulation), the messages between
    them, the exchange of K/V ("ring" or "all_gather") and the sinks every row joins once (None:
    none), in the lse's dtype."""

    def __init__(self, ranks: list[_Rank], messages, exchange: str, sinks):
        self.ranks, self.messages, self.exchange, self.sinks = ranks, messages, exchange, sinks
        self.world_size = len(ranks[0].calls)

    def key_values(self, shards: list) -> Iterator[list]:
        """Each step's K/V shard of every rank, the next one's already on its way. Two shards per
        rank are held, the one read and the one arriving, if the caller drops each step's shards
        before asking for the next (``_step``)."""
        if self.exchange == "all_gather":
            gathered = self.messages.all_gather(shards)
            yield shards  # every rank's own shard while the others are gathered
            everything = gathered()
            for step in range(1, self.world_size):
                yield [theirs[(rank.index - step) % self.world_size] for rank, theirs in zip(self.ranks, everything)]
            return
        for step in range(self.world_size):
            arriving = self.messages.shift(shards) if step + 1 < self.world_size else None
            yield shards
            if arriving is not None:
                shards, arriving = arriving(), None  # the wait done, nothing holds the shards sent

    def forward(self, qs, ks, vs):
        accumulate = _accumulation_dtype(qs[0])
        os = [torch.zeros(*q.shape[:-1], v.shape[-1], dtype=accumulate, device=q.device) for q, v in zip(qs, vs)]
        lses = [torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=accumulate, device=q.device)
                for q in qs]
        for step, shards in _step(self.key_values([(k.contiguous(), v.contiguous()) for k, v in zip(ks, vs)])):
            for rank, q, kv, o, lse in zip(self.ranks, qs, shards, os, lses):
                rank.forward_step(q, *kv, (rank.index - step) % self.world_size, o, lse)
            kv = None
        keyless = [lse == -math.inf for lse in lses]
        if self.sinks is not None:
            os, lses = zip(*(_join_sink(o, lse, self.sinks) for o, lse in zip(os, lses)))
        return [o.to(q.dtype) for o, q in zip(os, qs)], list(lses), keyless

    def backward(self, qs, ks, vs, os, lses, dos, keyless):
        accumulate = _accumulation_dtype(qs[0])
        dqs = [torch.zeros(q.shape, dtype=accumulate, device=q.device) for q in qs]
        gradients = _RingGradients(self, ks, vs) if self.exchange == "ring" else _GatheredGradients(self, ks, vs)
        for step, shards in _step(self.key_values([(k.contiguous(), v.contiguous()) for k, v in zip(ks, vs)])):
            calls = [rank.backward_parts(q, *kv, o, lse, do, (rank.index - step) % self.world_size, dq)
                     for rank, q, kv, o, lse, do, dq in zip(self.ranks, qs, shards, os, lses, dos, dqs)]
            firsts = [next(parts, None) for parts in calls]  # computed while the step's dK/dV still arrive
            sums = gradients.arrived(step)
            for first, parts, sum_ in zip(firsts, calls, sums):
                _add_parts(sum_, itertools.chain([first] if first else [], parts))
            firsts = calls = None
            gradients.pass_on(sums)
        dkvs = gradients.finish()
        dsinks = None
        if self.sinks is not None:
            dsinks = sum(map(_sink_gradient, os, lses, dos, keyless, itertools.repeat(self.sinks)))
        return ([dq.to(q.dtype) for dq, q in zip(dqs, qs)], [dk.to(k.dtype) for (dk, _), k in zip(dkvs, ks)],
                [dv.to(v.dtype) for (_, dv), v in zip(dkvs, vs)], dsinks)


def _step(key_values: Iterator[list]) -> Iterator[tuple[int, list]]:
    """(step, shards) of ``key_values``, the list of shards emptied once its step is done: the
    caller's loop variable would otherwise hold them while the next shards arrive (a third set)."""
    for step, shards in enumerate(key_values):
        yield step, shards
        shards.clear()


class _RingGradients:
    """dK/dV of the ring exchange: the buffers of a step's shards arrive from the previous rank,
    take this rank's parts and are sent on; after a full turn they reach the shard's owner. Two
    sets per rank: the one sent on and the one arriving (the sent set is freed once received)."""

    def __init__(self, ring: _Ring, ks, vs):
        self.ring, self.ks, self.vs, self.travelling = ring, ks, vs, None

    def arrived(self, step: int) -> list:
        if self.travelling is None:  # the first step: this rank's shard, no part yet
            wide = _accumulation_dtype(self.ks[0])
            return [(torch.zeros(k.shape, dtype=wide, device=k.device), torch.zeros(v.shape, dtype=wide, device=v.device))
                    for k, v in zip(self.ks, self.vs)]
        sums, self.travelling = self.travelling(), None  # the wait done: the sent set is freed
        return sums

    def pass_on(self, sums: list) -> None:
        self.travelling = self.ring.messages.shift(sums)

    def finish(self) -> list:
        return self.travelling()


class _GatheredGradients:
    """dK/dV of the all-gather exchange: each rank sums its parts for every shard, then the group
    sums every shard's over its ranks (a reduce-scatter), each rank receiving its own shard's."""

    def __init__(self, ring: _Ring, ks, vs):
        wide = _accumulation_dtype(ks[0])
        self.ring = ring
        self.sums = [tuple(torch.zeros((ring.world_size, *x.shape), dtype=wide, device=x.device) for x in (k, v))
                     for k, v in zip(ks, vs)]  # per rank: dK and dV of every shard, by source

    def arrived(self, step: int) -> list:
        size = self.ring.world_size
        return [(dk[(rank.index - step) % size], dv[(rank.index - step) % size])
                for rank, (dk, dv) in zip(self.ring.ranks, self.sums)]

    def pass_on(self, sums: list) -> None:
        """Nothing moves until every shard's parts are summed."""

    def finish(self) -> list:
        return self.ring.messages.reduce_scatter(self.sums)


def _add_parts(sums: tuple, parts) -> None:
    """Add each (keys, dk part, dv part) into the shard's (dk, dv) sums; no part outlives its call."""
    dk, dv = sums
    for keys, dk_part, dv_part in parts:
        dk[keys] += dk_part
        dv[keys] += dv_part


def _join_sink(o, lse, sinks):
    """A rank's (o, lse) over every key, with the sink's state (o = 0, lse = σ) merged in once
    (the contract's "Merging partial results"), as the contract's softmax computes it: a NaN or
    +inf sink gives NaN rows, a row without keys keeps o = 0 and gets lse = σ."""
    sink = sinks[None, :, None]
    top = torch.maximum(lse, sink)
    top = torch.where(top == -math.inf, 0.0, top)
    joined = torch.where(lse == -math.inf, sink, top + torch.log(torch.exp(lse - top) + torch.exp(sink - top)))
    share = torch.where(lse == -math.inf, 0.0, torch.exp(lse - joined))  # the keys' part of each row's weight
    return o * share.transpose(1, 2)[..., None], joined


def _sink_gradient(o, lse, do, keyless, sinks):
    """dsinks of one rank's rows: -sum over them of exp(σ_h - lse_i) * dot(o_i, do_i), over the
    rows that have a key (``keyless`` marks the others: padding, whatever their do holds)."""
    delta = (o.to(lse.dtype) * do.to(lse.dtype)).sum(-1).transpose(1, 2)  # (B, Hq, N/W)
    return -torch.where(keyless, 0.0, torch.exp(sinks[None, :, None] - lse) * delta).sum((0, 2))


def _accumulation_dtype(q) -> torch.dtype:
    """Partial results are merged, and gradients summed, in the LSE's precision."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


class _RingAttention(torch.autograd.Function):
    """Inputs: the ring, the caller's sinks (or None: their values are the ring's), then the q
    shards of its ranks, their k shards, their v shards. Outputs: the o shards, then the lse
    shards (not differentiable)."""

    @staticmethod
    def forward(ctx, ring: _Ring, sinks, *tensors):
        count = len(ring.ranks)
        qs, ks, vs = tensors[:count], tensors[count : 2 * count], tensors[2 * count :]
        os, lses, keyless = ring.forward(qs, ks, vs)
        ctx.ring, ctx.sinks_dtype = ring, None if sinks is None else sinks.dtype
        ctx.save_for_backward(*tensors, *os, *lses, *keyless)
        ctx.mark_non_differentiable(*lses)
        ctx.set_materialize_grads(False)  # no zero tensor made for the lse's gradient
        return (*os, *lses)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        count = len(ctx.ring.ranks)
        saved = ctx.saved_tensors
        qs, ks, vs, os, lses, keyless = (saved[i * count : (i + 1) * count] for i in range(6))
        dos = [torch.zeros_like(o) if do is None else do for do, o in zip(grads[:count], os)]
        dqs, dks, dvs, dsinks = ctx.ring.backward(qs, ks, vs, os, lses, dos, keyless)
        dsinks = dsinks.to(ctx.sinks_dtype) if ctx.needs_input_grad[1] else None
        return (None, dsinks, *dqs, *dks, *dvs)
