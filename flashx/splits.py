"""How many splits a split-KV decoding call runs: ``num_splits``, or for ``num_splits=0`` one rule
shared by every GPU backend (``choose_splits``).

A GPU backend decodes with one program per (sequence, kv head, row tile, split): a row tile holds
query rows of the whole GQA group, and a split a share of the key tiles those rows may see, which
the kernel works out on the device from the sequence's length; a merge then joins the splits.
Splits add parallelism where the (sequence, kv head, row tile) programs alone leave the GPU idle,
and cost a partial output per split and the merge. The rule is FlashAttention-3's
(``num_splits_heuristic`` in its hopper/heuristics.h), in the units of a backend's programs:

- the GPU holds ``sm_count`` x ``per_sm`` programs at once, its slots (``per_sm``: the programs
  of the backend's kernel an SM holds, by their shared memory or registers; FA3's hold one);
- no split when the programs alone fill at least ``FILLED`` of the slots, or when the keys make
  at most ``UNSPLIT_TILES`` tiles (the merge would cost more than the parallelism gains);
- otherwise the fewest splits whose efficiency is at least ``EFFICIENCY`` times the best of every
  count up to ``MAX_SPLITS`` and up to one key tile a split. A count stands for the fewest splits
  that hold its tiles a split, so that no split is empty at the capacity.

Efficiency is FA3's waves efficiency, n_waves / ceil(n_waves), counted in key tiles: the tiles
the programs read over what the slots could read in the time the busiest slot takes, that time
being the waves times a split's tiles plus ``PROGRAM_COST``, a program's fixed cost. FA3 counts
whole splits and no fixed cost, and takes 0.85 of the best. Counted in tiles, the last wave's
idle slots and a short last split are seen as what they cost a step that reads each key once;
the fixed cost keeps a count from reaching the best by many waves of programs of one tile each
(on 114 SMs at B=1, L=8k, 128 splits of one tile would otherwise top 13 of ten tiles), and with it
0.95 of the best takes the count of a full last wave where 0.85 would leave an eighth of the
slots idle (29 splits of 8 kv heads on 264 slots, where 32 fill them: on an H200 at B=1, 32
splits read 2.37 TB/s against 16's 2.31 at L=16k, 4.13 against 3.92 at 128k).

Nothing here reads a device value or an array's contents. The keys are the longest sequence the
cache holds (its capacity: S, or max_pages x page_size), shortened by a bounded window, never the
lengths in ``cache_seqlens``: those live on the device, and a call captured in a CUDA graph
replays with new ones. So a problem and a GPU always get the same count, with and without
``validate``, and a fixed count is bitwise reproducible (the contract's "Decoding with a KV
cache"); the kernels still divide each sequence's own tiles among the splits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

FILLED = 0.8  # FA3's: programs filling this share of the slots run unsplit
UNSPLIT_TILES = 4  # FA3's: caches of at most this many key tiles are never split
PROGRAM_COST = 1  # a program's fixed cost (its pipeline's fill, its partial output and its merge), in key tiles
EFFICIENCY = 0.95  # the share of the best efficiency the fewest splits must reach (module docstring)
MAX_SPLITS = 128  # FA3's


class Splits(NamedTuple):
    """A decoding call's splits: ``count`` of them, each holding ``keys`` keys (a multiple of the
    kernel's key tile) of a sequence at the cache's capacity."""

    count: int
    keys: int


@functools.lru_cache(maxsize=1024)  # a decoding loop asks at every step, with the same problem
def choose_splits(*, sm_count: int, batch: int, heads_k: int, rows: int, keys: int, block_n: int, block_m: int,
                  per_sm: int = 1) -> Splits:
    """The splits of ``num_splits=0`` (see the module docstring): ``batch`` x ``heads_k`` x row
    tiles programs (``rows`` query rows per kv head, ``block_m`` a tile), over ``keys`` keys in
    tiles of ``block_n``, on ``sm_count`` SMs holding ``per_sm`` programs each."""
    tiles = _tiles(keys, block_n)
    programs = batch * heads_k * -(-rows // block_m)
    slots = sm_count * per_sm
    if programs == 0 or programs >= FILLED * slots or tiles <= UNSPLIT_TILES:
        return Splits(1, tiles * block_n)
    efficiency = {}  # by count, each count the fewest splits that hold its tiles a split
    for asked in range(1, min(MAX_SPLITS, tiles) + 1):
        per_split = -(-tiles // asked)
        count = -(-tiles // per_split)  # no split left empty at the capacity
        waves = -(-programs * count // slots)
        efficiency[count] = programs * tiles / (slots * waves * (per_split + PROGRAM_COST))
    best = max(efficiency.values())
    count = min(count for count, value in efficiency.items() if value >= EFFICIENCY * best)
    return Splits(count, -(-tiles // count) * block_n)


def decode_splits(problem, *, sm_count: int, block_n: int, block_m: int, per_sm: int = 1) -> Splits:
    """The splits a decoding ``problem`` (a ``flashx.problem.DecodeProblem``) runs on a backend's
    kernel of ``block_m`` query rows and ``block_n`` keys a tile: its ``num_splits``, never more
    than the key tiles its rows may see (more would only add empty splits, and leave each split's
    share as it was), or ``choose_splits``'s."""
    keys = problem.capacity
    left = (problem.band or (-1, -1))[0]
    if left != -1:  # a row tile's keys lie in [L - Nq - left, L): at most Nq + left, in one more tile
        keys = min(keys, (problem.seqlen_q + left + block_n - 1) // block_n * block_n + block_n)
    if not problem.num_splits:
        return choose_splits(sm_count=sm_count, batch=problem.batch, heads_k=problem.heads_k,
                             rows=problem.seqlen_q * problem.group, keys=keys, block_n=block_n, block_m=block_m,
                             per_sm=per_sm)
    tiles = _tiles(keys, block_n)
    count = min(problem.num_splits, tiles)
    return Splits(count, -(-tiles // count) * block_n)


def _tiles(keys: int, block_n: int) -> int:
    """The key tiles of ``keys`` keys, at least one (an empty cache runs one split)."""
    return max(1, -(-keys // block_n))
