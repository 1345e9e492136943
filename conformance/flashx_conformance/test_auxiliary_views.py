"""Auxiliary arrays passed as views: the same bits as the same call with the array contiguous.

Every array option of ``flashx.attention`` (``flashx.Problem.ARRAYS``) and of
``flashx.attention_with_kvcache`` (``flashx.problem.DecodeProblem.ARRAYS``) is passed as each view
its shape and values allow (``VIEWS``). The memory around a view holds other valid values: another
length, the end of the packed rows, a page no sequence uses, True in a mask, NaN in slopes, sinks
and descales. A backend that reads the array as if it were contiguous then computes another answer,
instead of reading out of bounds. Decoding also holds the call to the oracle and the caches to the caches
with the new tokens written in, so a misread length or table that writes elsewhere is caught.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

import flashx
import flashx.kvcache
from flashx_conformance.harness import _broadcast, make_case, make_varlen_case, outputs_of
from flashx_conformance.test_decode import call, check, failures, make_decode_case

VIEWS = {
    "strided": "every other element of a last axis twice as long",
    "offset": "starting one element into its buffer",
    "transposed": "stored with its last two axes swapped and seen through a transposed view",
    "broadcast": "the first entry of the leading axis seen by every entry (stride 0)",
}
ALL_VIEWS = tuple(VIEWS)
#: Views of a 1-D array: a transposed view needs two axes.
FLAT_VIEWS = ("strided", "offset", "broadcast")


@dataclass(frozen=True)
class Family:
    """One auxiliary array: a call that holds it (``build(rng, dtype, uniform)``, ``uniform`` making
    its values equal along the leading axis, as a broadcast view shows them), the value around its
    views, and the views it is passed as."""

    build: Callable
    fill: object
    views: tuple[str, ...]


def _padded(rng, dtype, **options):
    return make_case(rng, batch=3, seqlen_q=24, seqlen_k=40, heads_q=2, heads_k=1, head_dim=32, dtype=dtype,
                     causal=True, deterministic=True, **options)


def _varlen(rng, dtype, uniform):
    return make_varlen_case(rng, lengths_q=[5, 0, 12, 7], lengths_k=[9, 3, 12, 20], spare_rows=3, heads_q=2,
                            heads_k=1, head_dim=32, dtype=dtype, causal=True, deterministic=True)


def _uniform(x: np.ndarray, uniform: bool) -> np.ndarray:
    return np.broadcast_to(x[:1], x.shape).copy() if uniform else x


def _lengths(name: str, values: list[int]):
    def build(rng, dtype, uniform):
        return _padded(rng, dtype, **{name: _uniform(np.asarray(values, dtype=np.int32), uniform)})

    return build


def _bools(rng, shape, uniform):
    return _uniform(rng.random(shape) < 0.7, uniform)


def _descale(name: str):
    """An FP8 call (whatever the suite's dtype) with descale ``name`` (B, Hk) = (3, 2): any
    positive factors are valid, those of the inputs' quantization or not."""
    def build(rng, dtype, uniform):
        factors = _uniform(2.0 ** rng.uniform(-3, 3, (3, 2)), uniform).astype(np.float32)
        return make_case(rng, batch=3, seqlen_q=24, seqlen_k=40, heads_q=4, heads_k=2, head_dim=32,
                         dtype="float8_e4m3fn", causal=True, **{name: factors})

    return build


ATTENTION = {
    "seqlens_q": Family(_lengths("seqlens_q", [17, 24, 5]), 1, FLAT_VIEWS),
    "seqlens_k": Family(_lengths("seqlens_k", [37, 12, 40]), 1, FLAT_VIEWS),
    # The end of the packed rows keeps a misread offset inside q and k; offsets cannot be broadcast.
    "cu_seqlens_q": Family(_varlen, 24, ("strided", "offset")),
    "cu_seqlens_k": Family(_varlen, 44, ("strided", "offset")),
    "mask": Family(lambda rng, dtype, uniform: _padded(rng, dtype, mask=_bools(rng, (3, 1, 24, 40), uniform)),
                   True, ALL_VIEWS),
    "block_mask": Family(lambda rng, dtype, uniform: _padded(
        rng, dtype, block_mask=flashx.BlockMask(_bools(rng, (3, 2, 3, 5), uniform), 8)), True, ALL_VIEWS),
    "alibi_slopes": Family(lambda rng, dtype, uniform: _padded(
        rng, dtype, alibi_slopes=_uniform(2.0 ** -np.arange(1.0, 7.0).reshape(3, 2), uniform)), np.nan, ALL_VIEWS),
    "sinks": Family(lambda rng, dtype, uniform: _padded(
        rng, dtype, sinks=_uniform(np.array([0.75, -1.5]), uniform)), np.nan, FLAT_VIEWS),
    **{name: Family(_descale(name), np.nan, ALL_VIEWS) for name in ("q_descale", "k_descale", "v_descale")},
}

#: The page of a decoding case that no sequence uses: table entries past a sequence's pages and
#: the memory around a table's view name it, so that a misread entry or length stays in the cache.
SPARE_PAGE = "spare page"


def _decode(rng, dtype, uniform, **options):
    """Three sequences in pages of 8 (equal lengths with ``uniform``), two new tokens each."""
    lengths = [21, 21, 21] if uniform else [13, 40, 1]
    case = make_decode_case(rng, lengths=lengths, page_size=8, dtype=dtype, causal=True, num_splits=2,
                            **{"new": 2, "seqlen_q": 2, **options})
    case.block_table[case.block_table == -1] = _spare_page(case)
    return case


def _spare_page(case) -> int:
    return min(set(range(case.k_cache.shape[0])) - set(case.block_table.ravel().tolist()))


def _shared_table(rng, dtype, uniform):
    """With ``uniform`` every sequence reads the longest one's pages (a table broadcast over the
    batch) and no new token is written: two sequences must never write one slot."""
    if not uniform:
        return _decode(rng, dtype, False)
    case = _decode(rng, dtype, False, new=0, seqlen_q=1)
    longest = case.block_table[np.argmax(case.cache_seqlens)]
    return dataclasses.replace(case, block_table=np.broadcast_to(longest, case.block_table.shape).copy())


def _decode_descale(name: str):
    """An FP8 cache under bfloat16 queries (whatever the suite's dtype) with descale ``name`` (B, Hk) = (3, 2)."""
    def build(rng, dtype, uniform):
        factors = _uniform(2.0 ** rng.uniform(-2, 2, (3, 2)), uniform).astype(np.float32)
        return _decode(rng, "bfloat16", False, cache_dtype="float8_e4m3fn", **{name: factors})

    return build


def _tree(rng, dtype, uniform):
    mask = np.tril(rng.random((3, 1, 4, 4)) < 0.6) | np.eye(4, dtype=bool)
    return _decode(rng, dtype, False, new=4, seqlen_q=4, mask=_uniform(mask, uniform))


DECODE = {
    "cache_seqlens": Family(_decode, 0, FLAT_VIEWS),
    "block_table": Family(_shared_table, SPARE_PAGE, ALL_VIEWS),
    "mask": Family(_tree, True, ALL_VIEWS),
    "alibi_slopes": Family(lambda rng, dtype, uniform: _decode(
        rng, dtype, False, alibi_slopes=_uniform(2.0 ** -np.arange(1.0, 13.0).reshape(3, 4), uniform)), np.nan, ALL_VIEWS),
    "sinks": Family(lambda rng, dtype, uniform: _decode(
        rng, dtype, False, sinks=_uniform(np.array([0.75, -1.5, 2.5, 0.25]), uniform)), np.nan, FLAT_VIEWS),
    **{name: Family(_decode_descale(name), np.nan, ALL_VIEWS) for name in ("k_descale", "v_descale")},
}


def _viewed(target, x: np.ndarray, view: str, fill, dtype: str):
    """``x`` as the backend's kind of array, seen through ``view`` of a buffer holding ``fill`` around it."""
    x = np.asarray(x)
    element = "float32" if x.dtype.kind == "f" else None
    if view == "strided":
        base = np.full(x.shape[:-1] + (2 * x.shape[-1],), fill, dtype=x.dtype)
        base[..., ::2] = x
        return target.array(base, dtype, element=element)[..., ::2]
    if view == "offset":
        base = np.concatenate([np.full(1, fill, dtype=x.dtype), x.ravel()])
        return target.array(base, dtype, element=element)[1:].reshape(x.shape)
    if view == "transposed":
        return target.array(np.ascontiguousarray(x.swapaxes(-1, -2)), dtype, element=element).swapaxes(-1, -2)
    assert view == "broadcast" and (x == x[:1]).all(), "a broadcast view needs values equal along the leading axis"
    return _broadcast(target.array(np.ascontiguousarray(x[:1]), dtype, element=element), x.shape)


def test_every_auxiliary_array_has_views():
    """A new array option joins these families, or this fails."""
    assert set(ATTENTION) == set(flashx.Problem.ARRAYS)
    assert set(DECODE) == set(flashx.problem.DecodeProblem.ARRAYS)


@pytest.mark.parametrize("name, view", [(name, view) for name, family in ATTENTION.items() for view in family.views])
def test_auxiliary_views(flashx_target, flashx_rng, name, view):
    """o, lse, dq, dk, dv with the array as a view are those of the contiguous call, bit for bit."""
    family = ATTENTION[name]
    case = family.build(flashx_rng, flashx_target.dtype, view == "broadcast")
    inputs = flashx_target.inputs(case)
    value = case.options[name]
    array = value.blocks if isinstance(value, flashx.BlockMask) else value
    seen = _viewed(flashx_target, array, view, family.fill, case.dtype)
    as_view = flashx.BlockMask(seen, value.block_size) if isinstance(value, flashx.BlockMask) else seen
    results = []
    for extra in ({}, {name: as_view}):
        o, res, *grads = flashx_target.run(case, inputs, **extra)
        results.append([flashx_target.numpy(x) for x in (o, res.lse, *grads)])
    for output, contiguous, viewed in zip(outputs_of(case), *results):
        differ = ~((contiguous == viewed) | (np.isnan(contiguous) & np.isnan(viewed)))
        assert not differ.any(), (f"{case.describe()}\n{name} {VIEWS[view]}: {output} differs from the contiguous "
                                  f"call at {int(differ.sum())} elements, first at {tuple(np.argwhere(differ)[0])}")


@pytest.mark.parametrize("name, view", [(name, view) for name, family in DECODE.items() for view in family.views])
def test_decode_auxiliary_views(flashx_target, flashx_rng, name, view):
    """o, lse and the caches after the call with the array as a view are those of the contiguous
    call, bit for bit, and meet the oracle: the new tokens are written into their slots, nowhere else."""
    family = DECODE[name]
    case = family.build(flashx_rng, flashx_target.dtype, view == "broadcast")
    array = case.options[name] if name in case.options else getattr(case, name)
    fill = _spare_page(case) if family.fill == SPARE_PAGE else family.fill
    contiguous = check(flashx_target, case)
    viewed = call(flashx_target, case, **{name: _viewed(flashx_target, array, view, fill, case.dtype)})
    found = failures(case, viewed)
    assert not found, f"{case.describe()}\n{name} {VIEWS[view]}:\n" + "\n".join(found)
    for output in contiguous:
        a, b = contiguous[output], viewed[output]
        differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
        assert not differ.any(), (f"{case.describe()}\n{name} {VIEWS[view]}: {output} differs from the contiguous "
                                  f"call at {int(differ.sum())} elements, first at {tuple(np.argwhere(differ)[0])}")
