"""Decoding with a KV cache: ``attention_with_kvcache``, its validation, and the call of a backend.

The contract's "Decoding with a KV cache" section (docs/contract.md) defines the call. A few
query rows per sequence attend to a cache of keys and values, contiguous (B, S, Hk, D) or paged
(P, page_size, Hk, D) through a block table, after the new tokens (``k_new``, ``v_new``) are
written into it in place. Every argument is checked here and described by a ``DecodeProblem``;
a backend that implements ``Backend.decode`` receives it with the arrays in its own kind.

Shapes, dtypes and devices are always checked: they cost no device access. The values of
``cache_seqlens`` and ``block_table`` are checked on the host only with ``validate=True`` (one
small copy each), because a wrong one would make a kernel read or write outside the cache. With
``validate=False`` nothing here reads a device value, so the call makes no host synchronization
and can be captured in a CUDA graph; the dispatch choice is remembered per static description.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from flashx import arrays, dispatch, registry
from flashx.backend import ALL_DTYPES
from flashx.errors import DTypeError, FlashXError, ShapeError
from flashx.options import python_scalar
from flashx.problem import HeadsAndBand, default_scale
from flashx.validation import INTEGER_DTYPES, _bool_broadcastable, _is_int, _is_real, _number, _same_array_as_q, _window

_LIMIT = 256  # dispatch choices remembered; past it the memory starts again empty


@dataclass(frozen=True, eq=False)
class DecodeProblem(HeadsAndBand):
    """One ``attention_with_kvcache`` call, validated. Arrays in it are of the backend's kind.

    q (B, Nq, Hq, D); a contiguous cache (B, S, Hk, D) or a paged one (P, page_size, Hk, D);
    ``cache_seqlens`` (B,) and ``block_table`` (B, max_pages) as int32. Sequence b attends to
    Lk[b] = cache_seqlens[b] + new_tokens keys, its query i sitting at position Lk[b] - Nq + i.
    """

    array_kind: str  # the kind of the caller's arrays
    device: str
    device_index: int | None
    dtype: str
    batch: int  # B
    seqlen_q: int  # Nq
    heads_q: int
    heads_k: int
    head_dim: int
    head_dim_v: int
    new_tokens: int  # Nn: rows of k_new and v_new (0 without them)
    page_size: int | None  # None: a contiguous cache
    num_pages: int  # P of a paged cache; B of a contiguous one (one run of S slots per sequence)
    capacity: int  # the most keys a sequence can hold: S, or max_pages * page_size
    softmax_scale: float
    cache_seqlens: Any  # (B,) int32
    block_table: Any = None  # (B, max_pages) int32, paged caches only
    causal: bool = True
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded; causal not folded in
    mask: Any = None  # bool, broadcastable to (B, Hq, Nq, Nq): the last Nq keys
    num_splits: int = 0  # 0: the backend chooses
    validated: bool = True  # cache_seqlens and block_table were checked on the host

    #: Decoding has no backward; Backend.supports reads this like Problem's.
    deterministic = False

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def o_shape(self) -> tuple[int, ...]:
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (self.batch, self.heads_q, self.seqlen_q)

    @functools.cached_property
    def features(self) -> frozenset[str]:
        """The optional features (keys of ``flashx.problem.FEATURES``) this call uses."""
        used = {
            "causal": self.causal,
            "window": self.window is not None,
            "mask": self.mask is not None,
            "gqa": self.heads_q != self.heads_k,
            "dv_ne_d": self.head_dim_v != self.head_dim,
        }
        return frozenset(name for name, on in used.items() if on)

    @property
    def is_empty(self) -> bool:
        """No output element and nothing to write: the core answers without a backend."""
        return self.batch * self.seqlen_q * self.heads_q == 0 and (self.batch == 0 or self.new_tokens == 0)

    def static_key(self) -> tuple:
        """Everything but the arrays' contents and strides: equal keys, equal dispatch."""
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.ARRAYS)
        return fields + tuple(arrays.signature(getattr(self, name)) for name in self.ARRAYS)

    #: The auxiliary arrays a call may hold.
    ARRAYS = ("cache_seqlens", "block_table", "mask")

    def describe(self) -> str:
        """One line for error messages."""
        where = self.device if self.device_index is None else f"{self.device}:{self.device_index}"
        cache = (f"paged cache of {self.num_pages} pages x {self.page_size}" if self.paged
                 else f"contiguous cache of {self.capacity}")
        parts = [
            f"decode q{(self.batch, self.seqlen_q, self.heads_q, self.head_dim)} with a {cache} slots, "
            f"Hk={self.heads_k}, Dv={self.head_dim_v}, {self.new_tokens} new, {self.dtype} {self.array_kind}@{where}",
            f"scale={self.softmax_scale:.4g}",
        ]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.mask is not None:
            parts.append("mask")
        if self.num_splits:
            parts.append(f"num_splits={self.num_splits}")
        return ", ".join(parts)



def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None,
                           causal=True, window=None, softmax_scale=None, mask=None, num_splits=0, validate=True,
                           return_lse=False, backend="auto"):
    """Attention of a few new query rows per sequence over a KV cache, after appending k_new, v_new.

    q (B, Nq, Hq, D); k_cache, v_cache (B, S, Hk, D|Dv), or (P, page_size, Hk, D|Dv) pages with
    ``block_table`` (B, max_pages); ``cache_seqlens`` (B,) tokens already cached. The new tokens
    (B, Nn, Hk, D|Dv) are written into the cache in place at positions cache_seqlens[b] onwards;
    ``cache_seqlens`` is not advanced. Returns o (B, Nq, Hq, Dv), and lse (B, Hq, Nq) with
    ``return_lse``. ``mask`` (broadcastable to (B, Hq, Nq, Nq)) applies to the last Nq keys: a
    speculative-decoding tree. ``num_splits``: parts of each sequence's keys computed in parallel
    (0: the backend chooses). ``validate=False``: no host synchronization (the caller promises
    valid lengths and tables), capturable in a CUDA graph.
    """
    if arrays.traced(q):
        from flashx.ops import attention_with_kvcache as traced_call

        return traced_call(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new,
                           block_table=block_table, causal=causal, window=window, softmax_scale=softmax_scale,
                           mask=mask, num_splits=num_splits, validate=validate, return_lse=return_lse,
                           backend=backend)
    problem, impl = plan_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new,
                                 block_table=block_table, causal=causal, window=window, softmax_scale=softmax_scale,
                                 mask=mask, num_splits=num_splits, validate=validate, backend=backend)
    q, k_new, v_new = (None if x is None else arrays.resolved(x) for x in (q, k_new, v_new))
    if problem.is_empty:
        o = arrays.full(q, problem.o_shape, 0.0, problem.dtype)
        lse = arrays.full(q, problem.lse_shape, -math.inf, problem.lse_dtype)
    else:
        kind = impl.array_kind
        problem = problem.with_arrays(arrays.for_backend(impl))
        inputs = (None if x is None else arrays.convert(x, kind) for x in (q, k_cache, v_cache, k_new, v_new))
        o, lse = impl.decode(problem, *inputs)
        for name, x, shape in (("o", o, problem.o_shape), ("lse", lse, problem.lse_shape)):
            if tuple(x.shape) != shape:
                raise FlashXError(f"backend {impl.name!r} returned {name} of shape {tuple(x.shape)}, expected {shape}: "
                                  "a backend bug")
        o, lse = arrays.to_caller(o, q, problem.dtype), arrays.to_caller(lse, q, problem.lse_dtype)
    return (o, lse) if return_lse else o


def explain(q, k_cache, v_cache, **keywords) -> dispatch.Explanation:
    """Which backend ``attention_with_kvcache`` would run for these arguments, and why not the others."""
    keywords.pop("return_lse", None)
    keywords.pop("backend", None)
    return dispatch.explain(build_decode_problem(q, k_cache, v_cache, **keywords))


def plan_kvcache(q, k_cache, v_cache, *, backend="auto", **keywords):
    """(DecodeProblem, backend): every argument checked, the backend chosen (remembered per static key)."""
    problem = build_decode_problem(q, k_cache, v_cache, **keywords)
    key = (dispatch.requested(backend), registry.version(), problem.static_key())
    impl = _choices.get(key)
    if impl is None:
        impl = dispatch.choose(problem, backend)
        if len(_choices) >= _LIMIT:
            _choices.clear()
        _choices[key] = impl
    return problem, impl


_choices: dict[tuple, Any] = {}


def build_decode_problem(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None,
                         causal=True, window=None, softmax_scale=None, mask=None, num_splits=0,
                         validate=True) -> DecodeProblem:
    """Every argument checked; lengths and tables on the host only with ``validate``."""
    causal, window, softmax_scale, num_splits, validate = map(python_scalar, (causal, window, softmax_scale,
                                                                            num_splits, validate))
    q, mask = arrays.resolved(q), None if mask is None else arrays.resolved(mask)
    kind = arrays.require_array(q, "q")
    device, device_index = arrays.device_of(q)
    dtype = arrays.dtype_name(q)
    if dtype not in ALL_DTYPES:
        raise DTypeError(f"q: expected one of {sorted(ALL_DTYPES)}, got {dtype}")
    like_q = (kind, device, device_index)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if x is not None:
            _same_array_as_q(name, x, *like_q)
            if arrays.dtype_name(x) != dtype:
                raise DTypeError(f"{name}: expected the dtype of q ({dtype}), got {arrays.dtype_name(x)}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if arrays.resolved(x) is not x:
            raise DTypeError(f"{name}: expected a tensor that can be written in place, got a lazily negated view")

    paged = block_table is not None
    layout = "(P, page_size, Hk, D) pages (block_table given)" if paged else "(B, S, Hk, D)"
    if q.ndim != 4:
        raise ShapeError(f"q: expected (B, Nq, Hq, D), got shape {tuple(q.shape)}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ShapeError(f"{name}: expected {layout}, got shape {tuple(x.shape)}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    rows, slots, heads_k, dim_k = k_cache.shape
    if head_dim == 0:
        raise ShapeError(f"q: expected a head dim D >= 1, got shape {tuple(q.shape)}")
    if dim_k != head_dim:
        raise ShapeError(f"k_cache: expected head dim {head_dim} (from q), got shape {tuple(k_cache.shape)}")
    if tuple(v_cache.shape[:3]) != (rows, slots, heads_k):
        raise ShapeError(f"v_cache: expected shape {(rows, slots, heads_k)} + (Dv,) (from k_cache), "
                         f"got {tuple(v_cache.shape)}")
    if heads_k == 0 or heads_q % heads_k:
        raise ShapeError(f"k_cache: expected a head count dividing q's {heads_q}, got {heads_k}")
    head_dim_v = v_cache.shape[3]
    if paged:
        _same_array_as_q("block_table", block_table, *like_q)
        if arrays.dtype_name(block_table) not in INTEGER_DTYPES:
            raise DTypeError(f"block_table: expected an integer dtype, got {arrays.dtype_name(block_table)}")
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ShapeError(f"block_table: expected shape ({batch}, max_pages), got {tuple(block_table.shape)}")
        if slots == 0:
            raise ShapeError(f"k_cache: expected pages of page_size >= 1 slots, got shape {tuple(k_cache.shape)}")
        capacity = block_table.shape[1] * slots
    else:
        if rows != batch:
            raise ShapeError(f"k_cache: expected batch {batch} (from q) in {layout}, got shape {tuple(k_cache.shape)}")
        capacity = slots

    if (k_new is None) != (v_new is None):
        missing = "v_new" if v_new is None else "k_new"
        raise ShapeError(f"{missing}: expected an array with the other of k_new, v_new, got None")
    new_tokens = 0
    if k_new is not None:
        if k_new.ndim != 4 or k_new.shape[0] != batch or tuple(k_new.shape[2:]) != (heads_k, head_dim):
            raise ShapeError(f"k_new: expected ({batch}, Nn, {heads_k}, {head_dim}), got shape {tuple(k_new.shape)}")
        new_tokens = k_new.shape[1]
        if tuple(v_new.shape) != (batch, new_tokens, heads_k, head_dim_v):
            raise ShapeError(f"v_new: expected {(batch, new_tokens, heads_k, head_dim_v)}, got shape {tuple(v_new.shape)}")

    _same_array_as_q("cache_seqlens", cache_seqlens, *like_q)
    if arrays.dtype_name(cache_seqlens) not in INTEGER_DTYPES:
        raise DTypeError(f"cache_seqlens: expected an integer dtype, got {arrays.dtype_name(cache_seqlens)}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ShapeError(f"cache_seqlens: expected shape ({batch},), got {tuple(cache_seqlens.shape)}")
    if mask is not None:
        _bool_broadcastable("mask", mask, (batch, heads_q, seqlen_q, seqlen_q), *like_q)
    if not isinstance(causal, bool):
        raise DTypeError(f"causal: expected a bool, got {causal!r}")
    if window is not None:
        window = _window(window)
    if softmax_scale is None:
        softmax_scale = default_scale(head_dim)
    else:
        _number("softmax_scale", softmax_scale, _is_real, "a finite real number or None", math.isfinite)
    _number("num_splits", num_splits, _is_int, "an int >= 0 (0: the backend chooses)", lambda n: n >= 0)
    if not isinstance(validate, bool):
        raise DTypeError(f"validate: expected a bool, got {validate!r}")

    if validate:
        _check_values(cache_seqlens, block_table, new_tokens, capacity, slots if paged else None, rows)
    return DecodeProblem(
        array_kind=kind,
        device=device,
        device_index=device_index,
        dtype=dtype,
        batch=batch,
        seqlen_q=seqlen_q,
        heads_q=heads_q,
        heads_k=heads_k,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        new_tokens=new_tokens,
        page_size=slots if paged else None,
        num_pages=rows,
        capacity=capacity,
        softmax_scale=float(softmax_scale),
        cache_seqlens=arrays.astype(cache_seqlens, "int32"),
        block_table=arrays.astype(block_table, "int32") if paged else None,
        causal=causal,
        window=window,
        mask=mask,
        num_splits=int(num_splits),
        validated=validate,
    )


def _check_values(cache_seqlens, block_table, new_tokens, capacity, page_size, num_pages):
    """The lengths fit the cache; every table entry that holds one of those tokens is a page;
    no two sequences write their new tokens into one slot."""
    import numpy as np

    lengths = np.asarray(arrays.to_host(cache_seqlens), dtype=np.int64)
    if lengths.size == 0:
        return
    if lengths.min() < 0:
        b = int(np.argmin(lengths))
        raise ShapeError(f"cache_seqlens: expected lengths >= 0, got {lengths[b]} for sequence {b}")
    total = lengths + new_tokens
    if total.max() > capacity:
        b = int(np.argmax(total))
        where = "S" if page_size is None else f"max_pages x page_size = {capacity // page_size} x {page_size}"
        raise ShapeError(f"cache_seqlens: sequence {b} holds {lengths[b]} cached + {new_tokens} new tokens, "
                         f"more than the cache's capacity {capacity} ({where})")
    if page_size is None:
        return
    table = np.asarray(arrays.to_host(block_table), dtype=np.int64)
    pages_used = -(-total // page_size)
    in_use = np.arange(table.shape[1])[None, :] < pages_used[:, None]
    bad = in_use & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        raise ShapeError(f"block_table: entry [{b}, {j}] = {table[b, j]} holds tokens of sequence {b} but is not a "
                         f"page of the cache (expected 0 <= page < {num_pages})")
    if new_tokens:
        positions = lengths[:, None] + np.arange(new_tokens)[None, :]
        slots = np.take_along_axis(table, positions // page_size, axis=1) * page_size + positions % page_size
        order = np.argsort(slots, axis=None, kind="stable")
        ordered = slots.ravel()[order]
        clash = np.flatnonzero(ordered[1:] == ordered[:-1])
        if clash.size:
            first, second = order[clash[0]] // new_tokens, order[clash[0] + 1] // new_tokens
            slot = int(ordered[clash[0]])
            where = "twice" if first == second else f"as sequence {first} does"
            raise ShapeError(f"block_table: sequence {second} writes a new token into page {slot // page_size} "
                             f"slot {slot % page_size} {where}: two writes into one slot")
