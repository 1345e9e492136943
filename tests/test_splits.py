"""The split count of split-KV decoding (``flashx.splits``): the rule's properties over issue 42's
grid, and that a decoding problem's count depends on its shapes and options, never on its lengths.

The grid is the decode benchmark's shape (Hq=32 over Hk=8, one query row: 4 rows a kv head, one
row tile of 16) at B in 1..64 and L in 4k..128k, on 132 SMs (H100 SXM, H200) and 114 (H100 PCIe),
with one or two programs an SM (the backends' kernels at d128: Triton's and CuPy's).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashx import splits, validation
from flashx.splits import Splits, choose_splits, decode_splits

BATCHES = (1, 2, 4, 8, 16, 32, 64)
CACHES = tuple(4096 << i for i in range(6))  # 4k .. 128k
HEADS_K, ROWS, BLOCK_M, BLOCK_N = 8, 4, 16, 64
#: The least waves efficiency (programs x splits over the slots of the waves they take) of a split
#: call on the grid: one full wave on 132 SMs; on 114 the tiles divide less evenly among the slots.
LEAST_WAVES_EFFICIENCY = {132: 0.95, 114: 0.75}


def _grid(sm_count, per_sm):
    return {(b, n): choose_splits(sm_count=sm_count, batch=b, heads_k=HEADS_K, rows=ROWS, keys=n, block_n=BLOCK_N,
                                  block_m=BLOCK_M, per_sm=per_sm)
            for b in BATCHES for n in CACHES}


@pytest.mark.parametrize("per_sm", [1, 2])
@pytest.mark.parametrize("sm_count", [132, 114])
def test_the_grid(sm_count, per_sm):
    slots = sm_count * per_sm
    chosen = _grid(sm_count, per_sm)
    for (b, n), (count, keys) in chosen.items():
        programs, tiles = b * HEADS_K, n // BLOCK_N
        where = f"B={b}, L={n}: {count} splits of {keys} keys"
        assert 1 <= count <= min(splits.MAX_SPLITS, tiles), where
        assert keys % BLOCK_N == 0 and (count - 1) * keys < n <= count * keys, where  # tiles, none empty
        assert (count == 1) == (programs >= splits.FILLED * slots), where  # split only where the GPU idles
        if count > 1:
            assert programs * count <= 4 * slots, where  # a few waves at most
            waves = programs * count / slots
            assert waves / math.ceil(waves) >= LEAST_WAVES_EFFICIENCY[sm_count], where


def test_the_grid_on_132_sms():
    """One program an SM: a wave of 128 programs; two: of 256, as the H200's scan read fastest;
    fewer splits for more sequences, the same at every length."""
    for per_sm in (1, 2):
        chosen = _grid(132, per_sm)
        assert {b: chosen[b, 65536].count for b in BATCHES} == {
            b: max(1, 16 * per_sm // b) for b in BATCHES}
        assert all(chosen[b, n].count == chosen[b, 65536].count for b, n in chosen)


def test_the_choice_is_the_rule():
    """The fewest splits within EFFICIENCY of the best efficiency counted in tiles, a program
    costing PROGRAM_COST tiles more, each count taken as the fewest splits of its tiles a split."""
    for sm_count, per_sm, b, n in [(132, 2, 1, 8192), (114, 1, 1, 8192), (114, 2, 4, 4096), (132, 3, 2, 65536)]:
        tiles, programs, slots = n // BLOCK_N, b * HEADS_K, sm_count * per_sm

        def efficiency(count):
            per_split = -(-tiles // count)
            return programs * tiles / (slots * -(-programs * count // slots) * (per_split + splits.PROGRAM_COST))

        counts = {-(-tiles // -(-tiles // asked)) for asked in range(1, min(splits.MAX_SPLITS, tiles) + 1)}
        best = max(map(efficiency, counts))
        expected = min(c for c in counts if efficiency(c) >= splits.EFFICIENCY * best)
        got = choose_splits(sm_count=sm_count, batch=b, heads_k=HEADS_K, rows=ROWS, keys=n, block_n=BLOCK_N,
                            block_m=BLOCK_M, per_sm=per_sm)
        assert got == Splits(expected, -(-tiles // expected) * BLOCK_N)


@pytest.mark.parametrize("keys, expected", [
    (0, Splits(1, 64)),  # an empty cache
    (4 * 64, Splits(1, 256)),  # UNSPLIT_TILES
    (5 * 64, Splits(5, 64)),
    (10**7, Splits(16, 9766 * 64)),  # a wave of 128 programs, at most MAX_SPLITS
])
def test_edges(keys, expected):
    assert choose_splits(sm_count=132, batch=1, heads_k=8, rows=1, keys=keys, block_n=64, block_m=16) == expected


def test_rows_and_programs():
    """Row tiles count as programs; no rows, no split."""
    one_tile = choose_splits(sm_count=132, batch=1, heads_k=8, rows=16, keys=65536, block_n=64, block_m=16)
    two_tiles = choose_splits(sm_count=132, batch=1, heads_k=8, rows=17, keys=65536, block_n=64, block_m=16)
    assert (one_tile.count, two_tiles.count) == (16, 8)
    assert choose_splits(sm_count=132, batch=0, heads_k=8, rows=4, keys=65536, block_n=64, block_m=16).count == 1


def _problem(lengths=(5000, 70), capacity=65536, window=None, num_splits=0, validate=True, **options):
    q = np.zeros((2, 1, 32, 16), np.float32)
    cache = np.zeros((2, capacity, 8, 16), np.float32)
    return validation.build_decode_problem(q, cache, cache, cache_seqlens=np.array(lengths, np.int32), window=window,
                                           num_splits=num_splits, validate=validate, **options)


def test_a_problem_is_planned_from_its_shapes_never_its_lengths():
    """The same count whatever the lengths, with and without validate, and for a problem that a
    CUDA graph's replay holds with other lengths: the cache's capacity stands for them."""
    tile = dict(sm_count=132, block_n=64, block_m=16)
    first = decode_splits(_problem(), **tile)
    assert first == choose_splits(batch=2, heads_k=8, rows=4, keys=65536, **tile) == Splits(8, 8192)
    assert decode_splits(_problem(lengths=(1, 65535), validate=False), **tile) == first
    replayed = _problem(validate=False).holding(cache_seqlens=np.array([65536, 0], np.int32))
    assert decode_splits(replayed, **tile) == first


def test_num_splits_and_windows():
    """A given count runs as given, but never more splits than the key tiles its rows may see: of
    the capacity, or of a bounded window (Nq + left keys, in one tile more)."""
    tile = dict(sm_count=132, block_n=64, block_m=16)
    assert decode_splits(_problem(num_splits=3), **tile) == Splits(3, 21888)
    assert decode_splits(_problem(lengths=(50, 7), capacity=100, num_splits=64), **tile) == Splits(2, 64)
    windowed = _problem(window=(1000, 0))
    assert decode_splits(windowed, **tile) == choose_splits(batch=2, heads_k=8, rows=4, keys=17 * 64, **tile)
    assert decode_splits(_problem(window=(1000, 0), num_splits=64), **tile) == Splits(17, 64)
    assert decode_splits(_problem(window=(-1, 5), causal=False), **tile) == decode_splits(_problem(), **tile)
