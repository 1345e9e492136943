"""Every argument checked once, turned into a problem: ``build_problem`` for attention,
``build_decode_problem`` for decoding with a KV cache.

Each error names the argument, what was expected and what was given (the contract's Errors
section, docs/contract.md). Lengths and offsets (seqlens, cu_seqlens) are read on the host: a
wrong value there would make a kernel read out of bounds, so it is worth one small copy. So are
FP8 descales: a zero, negative or NaN one would silently void every score of its head.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
import threading
from types import SimpleNamespace
from typing import Any

from flashx import arrays
from flashx.backend import ALL_DTYPES
from flashx.errors import DeviceError, DTypeError, OptionError, ShapeError
from flashx.options import complete, python_scalar
from flashx.problem import (
    FP8_CACHE_DTYPE,
    FP8_DTYPES,
    FP8_OUT_DTYPES,
    BlockMask,
    DecodeProblem,
    Problem,
    default_scale,
)

U64 = 2**64
ARRAY_OPTIONS = ("alibi_slopes", "sinks", "mask", "seqlens_q", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k",
                 "q_descale", "k_descale", "v_descale")
DESCALES = ("q_descale", "k_descale", "v_descale")
_FP8_INPUTS = f"FP8 inputs ({', '.join(sorted(FP8_DTYPES))})"
INTEGER_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


def build_problem(q, k, v, **options) -> Problem:
    """Every argument checked once; ``options`` are the keywords of ``flashx.options.OPTIONS``.

    Shapes, dtypes and scalar options are checked here, the call's own values (its auxiliary
    arrays and seed) by ``attention_fields``, which a remembered plan runs alone on a repeated
    call (``flashx.plan.plan``)."""
    o = SimpleNamespace(**complete("build_problem", options))
    kind, device, device_index, dtype = _operands(q, ALL_DTYPES | FP8_DTYPES, k=k, v=v)

    varlen = o.cu_seqlens_q is not None or o.cu_seqlens_k is not None
    if varlen and (o.cu_seqlens_q is None or o.cu_seqlens_k is None):
        missing = "cu_seqlens_k" if o.cu_seqlens_k is None else "cu_seqlens_q"
        raise ShapeError(f"{missing}: expected an integer array with the other cu_seqlens, got None")
    layout = "(T, H, D) (varlen, cu_seqlens given)" if varlen else "(B, N, H, D)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != (3 if varlen else 4):
            raise ShapeError(f"{name}: expected {layout}, got shape {tuple(x.shape)}")
    if varlen:
        (total_q, heads_q, head_dim), (total_k, heads_k, dim_k) = q.shape, k.shape
        batch = None
    else:
        (batch, seqlen_q, heads_q, head_dim), (batch_k, seqlen_k, heads_k, dim_k) = q.shape, k.shape
        total_q = total_k = None
        if batch_k != batch:
            raise ShapeError(f"k: expected batch {batch} (from q), got shape {tuple(k.shape)}")
    if dim_k != head_dim:
        raise ShapeError(f"k: expected head dim {head_dim} (from q), got shape {tuple(k.shape)}")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ShapeError(f"v: expected shape {tuple(k.shape[:-1])} + (Dv,) (from k), got {tuple(v.shape)}")
    if heads_k == 0 or heads_q % heads_k:
        raise ShapeError(f"k: expected a head count dividing q's {heads_q}, got {heads_k}")
    if head_dim == 0:
        raise ShapeError(f"q: expected a head dim D >= 1 (scores of D = 0 carry no information), got shape {tuple(q.shape)}")

    if varlen:
        for name, x in (("mask", o.mask), ("block_mask", o.block_mask), ("seqlens_q", o.seqlens_q), ("seqlens_k", o.seqlens_k)):
            if x is not None:
                raise ShapeError(f"{name}: indexes the padded layout and cannot be combined with cu_seqlens, got both")
        for side in ("q", "k"):
            name = f"cu_seqlens_{side}"
            cu = getattr(o, name)
            _same_array_as_q(name, cu, kind, device, device_index)
            if cu.ndim != 1 or cu.shape[0] < 1:
                raise ShapeError(f"{name}: expected shape (B + 1,), got {tuple(cu.shape)}")
        batch = o.cu_seqlens_q.shape[0] - 1
        if o.cu_seqlens_k.shape[0] - 1 != batch:
            raise ShapeError(f"cu_seqlens_k: expected shape ({batch + 1},) like cu_seqlens_q, got {tuple(o.cu_seqlens_k.shape)}")
        seqlen_q = seqlen_k = 0  # the longest sequences, which attention_fields reads from cu_seqlens
    else:
        for name, x in (("max_seqlen_q", o.max_seqlen_q), ("max_seqlen_k", o.max_seqlen_k)):
            if x is not None:
                raise ShapeError(f"{name}: only meaningful with cu_seqlens (varlen layout), got {x!r}")
    if o.block_mask is not None and not isinstance(o.block_mask, BlockMask):
        raise DTypeError(f"block_mask: expected a flashx.BlockMask, got {type(o.block_mask).__name__}")

    if not isinstance(o.causal, bool):
        raise DTypeError(f"causal: expected a bool, got {o.causal!r}")
    for name in ("deterministic", "validate"):
        if not isinstance(getattr(o, name), bool):
            raise DTypeError(f"{name}: expected a bool, got {getattr(o, name)!r}")
    if o.window is not None:
        o.window = _window(o.window)
    if o.softmax_scale is None:
        o.softmax_scale = default_scale(head_dim)
    else:
        _number("softmax_scale", o.softmax_scale, _is_real, "a finite real number or None", math.isfinite)
    o.softcap, _, _ = _score_modifications(o.softcap, None, None, batch, heads_q, dtype, kind, device, device_index)
    _number("dropout_p", o.dropout_p, _is_real, "a number in [0, 1)", lambda x: 0 <= x < 1)
    o.dropout_offsets = (0, 0) if o.dropout_offsets is None else _dropout_offsets(o.dropout_offsets)
    fp8 = dtype in FP8_DTYPES
    if o.out_dtype is not None and not fp8:
        raise DTypeError(f"out_dtype: only for {_FP8_INPUTS}, got q of dtype {dtype}")
    out_dtype = _out_dtype(o.out_dtype) if fp8 else dtype

    problem = Problem(
        array_kind=kind,
        device=device,
        device_index=device_index,
        dtype=dtype,
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        total_q=total_q,
        total_k=total_k,
        heads_q=heads_q,
        heads_k=heads_k,
        head_dim=head_dim,
        head_dim_v=v.shape[-1],
        softmax_scale=float(o.softmax_scale),
        causal=o.causal,
        window=o.window,
        softcap=o.softcap,
        dropout_p=float(o.dropout_p),
        dropout_offsets=o.dropout_offsets,
        deterministic=o.deterministic,
        out_dtype=out_dtype,
    )
    return dataclasses.replace(problem, **attention_fields(problem, vars(o)))


def attention_fields(problem: Problem, options: dict, key_checked: bool = False) -> dict:
    """The fields of an attention call's problem that are its own: its auxiliary arrays
    (``Problem.ARRAYS``; those given), each checked against ``problem`` (its scalars and shapes
    checked) and converted as the contract states, lengths and offsets read on the host; its seed,
    drawn afresh for dropout without one, and its RNG offset (``Problem.PER_CALL``); and its
    ``seqlen_q``, ``seqlen_k``: ``problem``'s, or with cu_seqlens the longest sequences they hold
    (or the max_seqlen hints, checked against those), and whether rows lie past their last
    sequences (``rows_past_sequences``, per call too).

    ``options`` holds every option (``flashx.options.complete``). Calls of one key of
    ``flashx.plan`` differ in these fields alone, so that a remembered plan runs just this. There
    (``key_checked``) the call that made the plan has checked what the key holds, so the checks
    that read nothing else are not made again: those of the type, shape, dtype and device of
    masks, block masks, lengths and offsets (whose values are still read and checked), and,
    without dropout, of the seed and RNG offset, which the plan's problem holds."""
    p = problem
    like_q = (p.array_kind, p.device, p.device_index)
    read = options["validate"]
    given = {name: arrays.resolved(options[name]) for name in ARRAY_OPTIONS if options[name] is not None}
    fields = dict(given, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k)
    if p.total_q is not None:  # packed (read from the totals: ``problem`` may hold no cu_seqlens)
        fields["cu_seqlens_q"], fields["seqlen_q"], past_q = _cu_seqlens("q", given["cu_seqlens_q"], p.total_q,
                                                                         options["max_seqlen_q"], like_q, key_checked,
                                                                         read)
        if (given["cu_seqlens_k"] is given["cu_seqlens_q"] and p.total_k == p.total_q
                and options["max_seqlen_k"] == options["max_seqlen_q"]):  # self-attention: one host read
            fields["cu_seqlens_k"], fields["seqlen_k"], past_k = fields["cu_seqlens_q"], fields["seqlen_q"], past_q
        else:
            fields["cu_seqlens_k"], fields["seqlen_k"], past_k = _cu_seqlens("k", given["cu_seqlens_k"], p.total_k,
                                                                             options["max_seqlen_k"], like_q,
                                                                             key_checked, read)
        fields["rows_past_sequences"] = past_q or past_k
    if "seqlens_q" in given:
        fields["seqlens_q"] = _seqlens("seqlens_q", given["seqlens_q"], p.batch, p.seqlen_q, like_q, key_checked,
                                       read)
    if "seqlens_k" in given:
        fields["seqlens_k"] = _seqlens("seqlens_k", given["seqlens_k"], p.batch, p.seqlen_k, like_q, key_checked,
                                       read)
    score_shape = (p.batch, p.heads_q, fields["seqlen_q"], fields["seqlen_k"])
    if "mask" in given and not key_checked:
        _bool_broadcastable("mask", given["mask"], score_shape, *like_q)
    block_mask = options["block_mask"]
    if block_mask is not None:
        if arrays.resolved(block_mask.blocks) is not block_mask.blocks:
            block_mask = BlockMask(arrays.resolved(block_mask.blocks), block_mask.block_size)
        if not key_checked:
            bq, bk = block_mask.block_size
            grid = (*score_shape[:2], -(-score_shape[2] // bq), -(-score_shape[3] // bk))
            _bool_broadcastable("block_mask.blocks", block_mask.blocks, grid, *like_q)
        fields["block_mask"] = block_mask
    if "alibi_slopes" in given or "sinks" in given:
        _, fields["alibi_slopes"], fields["sinks"] = _score_modifications(
            None, given.get("alibi_slopes"), given.get("sinks"), p.batch, p.heads_q, p.dtype, *like_q)
    if not given.keys().isdisjoint(DESCALES):
        fields.update(_descales({name: given.get(name) for name in DESCALES}, p.fp8,
                                f"{_FP8_INPUTS}, got q of dtype {p.dtype}", p.batch, p.heads_k, *like_q,
                                read_values=read))
    if p.dropout_p > 0 or not key_checked:
        seed = options["seed"]
        if seed is None:
            seed = _draw_seed(p.array_kind) if p.dropout_p > 0 else 0
        else:
            _number("seed", seed, _is_int, "an int in [0, 2**64) or None", lambda x: 0 <= x < U64)
        _number("rng_offset", options["rng_offset"], _is_int, "an int in [0, 2**64)", lambda x: 0 <= x < U64)
        fields["seed"], fields["rng_offset"] = int(seed), int(options["rng_offset"])
    return fields


def _operands(q, dtypes, **others) -> tuple:
    """q's kind, device, device index and dtype (one of ``dtypes``), checked, and each of
    ``others`` (None: absent) an array of q's kind, device and dtype."""
    kind = arrays.require_array(q, "q")
    device, device_index = arrays.device_of(q)
    dtype = arrays.dtype_name(q)
    if dtype not in dtypes:
        raise DTypeError(f"q: expected one of {sorted(dtypes)}, got {dtype}")
    for name, x in others.items():
        if x is not None:
            _same_array_as_q(name, x, kind, device, device_index)
            if arrays.dtype_name(x) != dtype:
                raise DTypeError(f"{name}: expected the dtype of q ({dtype}), got {arrays.dtype_name(x)}")
    return kind, device, device_index, dtype


def check_like(name: str, x: Any, shape: tuple[int, ...], dtype: str, problem: Problem) -> None:
    """``x`` (o, do, lse) must be an array like the problem's q, of this shape and dtype."""
    _same_array_as_q(name, x, problem.array_kind, problem.device, problem.device_index)
    if tuple(x.shape) != tuple(shape):
        raise ShapeError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if arrays.dtype_name(x) != dtype:
        raise DTypeError(f"{name}: expected dtype {dtype}, got {arrays.dtype_name(x)}")


def _same_array_as_q(name, x, kind, device, device_index):
    if arrays.require_array(x, name) != kind:
        raise DTypeError(f"{name}: expected a {kind} array like q, got {type(x).__module__}.{type(x).__name__}")
    if arrays.device_of(x) != (device, device_index):
        where = device if device_index is None else f"{device}:{device_index}"
        got_device, got_index = arrays.device_of(x)
        got = got_device if got_index is None else f"{got_device}:{got_index}"
        raise DeviceError(f"{name}: expected an array on q's device {where}, got one on {got}")


#: Up to this many values, lengths and offsets are checked as Python ints, more in NumPy, whose
#: every operation costs about a microsecond however few the values: a call with a few sequences
#: would pay that several times over.
_FEW_VALUES = 64


def _int_vector(name, x, length, like_q, key_checked, read=True):
    """The values of an integer vector, read on the host in one copy (any integer dtype; kernels
    receive int32): a list of Python ints for up to ``_FEW_VALUES``, an int64 NumPy array for more;
    None unless ``read``. Its kind, device, dtype and shape are checked unless ``key_checked``
    (``attention_fields``)."""
    if not key_checked:
        _same_array_as_q(name, x, *like_q)
        if arrays.dtype_name(x) not in INTEGER_DTYPES:
            raise DTypeError(f"{name}: expected an integer dtype, got {arrays.dtype_name(x)}")
        if tuple(x.shape) != (length,):
            raise ShapeError(f"{name}: expected shape ({length},), got {tuple(x.shape)}")
    if not read:
        return None
    if length <= _FEW_VALUES:
        return x.tolist()  # NumPy, torch and CuPy arrays alike: one copy to the host
    import numpy as np

    return np.asarray(arrays.to_host(x), dtype=np.int64)


def _extremes(values) -> tuple[int, int]:
    """(min, max) of ``_int_vector``'s values (or of their differences), (0, 0) for none."""
    if not len(values):
        return 0, 0
    if isinstance(values, list):
        return min(values), max(values)
    return int(values.min()), int(values.max())


def _seqlens(name, x, batch, limit, like_q, key_checked, read):
    """``x`` checked (its values only if ``read``), as int32 (a copy only when given in another
    integer dtype)."""
    values = _int_vector(name, x, batch, like_q, key_checked, read)
    if values is not None:
        low, high = _extremes(values)
        if low < 0 or high > limit:
            raise ShapeError(f"{name}: expected lengths in [0, {limit}], got values from {low} to {high}")
    return arrays.astype(x, "int32")


def _cu_seqlens(side, cu, total, max_seqlen, like_q, key_checked, read):
    """``cu`` (of shape (B + 1,), ``build_problem`` checked) as int32; the longest sequence it
    holds, or ``max_seqlen`` checked against it; and whether rows lie past its last sequence.
    Unless ``read``, the hint ``max_seqlen`` is taken as it is, if given, and the offsets are not
    read: rows past the last sequence are then assumed."""
    name = f"cu_seqlens_{side}"
    if not read and max_seqlen is not None:
        _int_vector(name, cu, cu.shape[0], like_q, key_checked, read=False)
        _number(f"max_seqlen_{side}", max_seqlen, _is_int, "an int >= 0", lambda x: x >= 0, error=ShapeError)
        return arrays.astype(cu, "int32"), int(max_seqlen), True
    offsets = _int_vector(name, cu, cu.shape[0], like_q, key_checked)
    if isinstance(offsets, list):
        shortest, longest = _extremes([end - start for start, end in zip(offsets, offsets[1:])])
    else:
        shortest, longest = _extremes(offsets[1:] - offsets[:-1])
    if offsets[0] != 0 or shortest < 0 or offsets[-1] > total:
        shown = offsets if len(offsets) <= 16 else f"{[int(x) for x in offsets[:8]]}..."
        raise ShapeError(f"{name}: expected offsets starting at 0, non-decreasing, ending at most at {total} "
                         f"(rows of {side}), got {shown}")
    if max_seqlen is not None:
        _number(f"max_seqlen_{side}", max_seqlen, _is_int, f"an int >= the longest sequence ({longest})", lambda x: x >= longest,
                error=ShapeError)
    return arrays.astype(cu, "int32"), longest if max_seqlen is None else int(max_seqlen), bool(offsets[-1] < total)


def _score_modifications(softcap, alibi_slopes, sinks, batch, heads_q, dtype, kind, device, device_index):
    """(softcap, alibi_slopes, sinks) of the contract's "Score modifications", checked for either
    operation: softcap as a float, slopes and sinks in the lse's dtype."""
    if softcap is not None:
        _number("softcap", softcap, _is_real, "a positive number or None", lambda x: x > 0)
        softcap = float(softcap)
    lse_dtype = "float64" if dtype == "float64" else "float32"
    if alibi_slopes is not None:
        alibi_slopes = _real_array("alibi_slopes", alibi_slopes, ((heads_q,), (batch, heads_q)), lse_dtype,
                                   kind, device, device_index)
    if sinks is not None:
        sinks = _real_array("sinks", sinks, ((heads_q,),), lse_dtype, kind, device, device_index)
    return softcap, alibi_slopes, sinks


def _real_array(name, x, shapes, dtype, kind, device, device_index):
    """``x`` (slopes, sinks) checked, in ``dtype`` (the lse's): any floating dtype is taken and
    converted once here, so that a backend receives the one dtype the contract states."""
    _same_array_as_q(name, x, kind, device, device_index)
    if arrays.dtype_name(x) not in ALL_DTYPES:
        raise DTypeError(f"{name}: expected a floating dtype ({', '.join(sorted(ALL_DTYPES))}), got {arrays.dtype_name(x)}")
    if tuple(x.shape) not in shapes:
        expected = " or ".join(map(str, shapes))
        raise ShapeError(f"{name}: expected shape {expected}, got {tuple(x.shape)}")
    return arrays.astype(arrays.detached(x), dtype)


def _descales(descales: dict, fp8: bool, needs: str, batch, heads_k, kind, device, device_index,
              read_values: bool = True) -> dict:
    """The descales of the contract's FP8 section, each a float32 (B, Hk) array of finite values
    > 0 (read on the host with ``read_values``), or None; given without FP8 data (``fp8``), a
    DTypeError saying what they ``need``."""
    given = [name for name, x in descales.items() if x is not None]
    if given and not fp8:
        raise DTypeError(f"{given[0]}: only for {needs}")
    return {name: None if x is None else _descale(name, x, batch, heads_k, kind, device, device_index, read_values)
            for name, x in descales.items()}


def _descale(name, x, batch, heads_k, kind, device, device_index, read_values):
    _same_array_as_q(name, x, kind, device, device_index)
    if arrays.dtype_name(x) != "float32":
        raise DTypeError(f"{name}: expected a float32 array of shape (B, Hk), got dtype {arrays.dtype_name(x)}")
    if tuple(x.shape) != (batch, heads_k):
        raise ShapeError(f"{name}: expected shape ({batch}, {heads_k}) (B, Hk), got {tuple(x.shape)}")
    if not read_values:
        return arrays.detached(x)
    import numpy as np

    values = np.asarray(arrays.to_host(x))
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        b, h = (int(i) for i in np.argwhere(bad)[0])
        raise OptionError(f"{name}: expected finite descales > 0, got {values[b, h]} at [{b}, {h}] "
                          f"({int(bad.sum())} of {bad.size} are not)")
    return arrays.detached(x)


def _out_dtype(value) -> str:
    """o's dtype for FP8 inputs: a name of FP8_OUT_DTYPES or the torch dtype, None for the first."""
    if value is None:
        return FP8_OUT_DTYPES[0]
    name = str(value).removeprefix("torch.") if type(value).__module__ == "torch" else value
    if name not in FP8_OUT_DTYPES:
        raise DTypeError(f"out_dtype: expected one of {', '.join(FP8_OUT_DTYPES)} (a name or the torch dtype) "
                         f"or None, got {value!r}")
    return name


def _bool_broadcastable(name, x, shape, kind, device, device_index):
    _same_array_as_q(name, x, kind, device, device_index)
    if arrays.dtype_name(x) != "bool":
        raise DTypeError(f"{name}: expected a bool array (True = may attend), got dtype {arrays.dtype_name(x)}")
    given = tuple(x.shape)
    fits = len(given) <= len(shape) and all(g in (1, s) for g, s in zip(given[::-1], shape[::-1]))
    if not fits:
        raise ShapeError(f"{name}: expected a shape broadcastable to {shape}, got {given}")


def _window(window):
    expected = "(left, right) ints >= -1 (-1 = unbounded) or None"
    if not isinstance(window, (tuple, list)) or not all(map(_is_int, window)):
        raise DTypeError(f"window: expected {expected}, got {window!r}")
    if len(window) != 2 or not all(side >= -1 for side in window):
        raise OptionError(f"window: expected {expected}, got {window!r}")
    return int(window[0]), int(window[1])


def _dropout_offsets(offsets):
    # Kernels add them to int32 row and key indices.
    expected = "(row, key) ints in [0, 2**31) or None"
    if not isinstance(offsets, (tuple, list)) or not all(map(_is_int, offsets)):
        raise DTypeError(f"dropout_offsets: expected {expected}, got {offsets!r}")
    if len(offsets) != 2 or not all(0 <= x < 2**31 for x in offsets):
        raise OptionError(f"dropout_offsets: expected {expected}, got {offsets!r}")
    return int(offsets[0]), int(offsets[1])


def _number(name, value, is_type, expected, in_range, error=OptionError):
    """A wrong type is a DTypeError, a wrong value (``in_range(value)`` false) an ``error``: an
    OptionError, or a ShapeError for a number that is a length."""
    if not is_type(value):
        raise DTypeError(f"{name}: expected {expected}, got {value!r}")
    if not in_range(value):
        raise error(f"{name}: expected {expected}, got {value!r}")


def _draw_seed(kind: str) -> int:
    # torch users expect torch.manual_seed to make dropout reproducible, as in flash-attn.
    if kind == "torch":
        return _seed_tensor().random_(0, 2**63 - 1).item()
    return secrets.randbits(64)


_seeds = threading.local()


def _seed_tensor():
    """This thread's scalar tensor that torch's default (CPU) generator draws dropout seeds into:
    the draw of ``torch.randint(2**63 - 1, ())``, without a tensor made for each call. One per
    thread, since another thread's draw could land between a draw and its read; made outside
    inference mode, where it would become a tensor that no call outside inference mode may write."""
    tensor = getattr(_seeds, "tensor", None)
    if tensor is None:
        import torch

        with torch.inference_mode(False):
            tensor = _seeds.tensor = torch.empty((), dtype=torch.int64, device="cpu")
    return tensor


def _is_int(x) -> bool:
    # the exact types first: an abstract class's isinstance costs a repeated call's checks more
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _is_real(x) -> bool:
    return type(x) in (float, int) or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def build_decode_problem(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None,
                         causal=True, window=None, softmax_scale=None, softcap=None, alibi_slopes=None, sinks=None,
                         mask=None, num_splits=0, validate=True, k_descale=None, v_descale=None) -> DecodeProblem:
    """Every argument checked; lengths, tables and descales on the host only with ``validate``."""
    causal, window, softmax_scale, softcap, num_splits, validate = map(
        python_scalar, (causal, window, softmax_scale, softcap, num_splits, validate))
    q = arrays.resolved(q)
    kind, device, device_index, dtype = _operands(q, ALL_DTYPES, k_new=k_new, v_new=v_new)
    like_q = (kind, device, device_index)
    cache_dtype = _cache_dtype(k_cache, v_cache, dtype, *like_q)
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

    if not isinstance(causal, bool):
        raise DTypeError(f"causal: expected a bool, got {causal!r}")
    if window is not None:
        window = _window(window)
    if softmax_scale is None:
        softmax_scale = default_scale(head_dim)
    else:
        _number("softmax_scale", softmax_scale, _is_real, "a finite real number or None", math.isfinite)
    softcap, _, _ = _score_modifications(softcap, None, None, batch, heads_q, dtype, *like_q)
    _number("num_splits", num_splits, _is_int, "an int >= 0 (0: the backend chooses)", lambda n: n >= 0)
    if not isinstance(validate, bool):
        raise DTypeError(f"validate: expected a bool, got {validate!r}")
    problem = DecodeProblem(
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
        cache_seqlens=None,
        causal=causal,
        window=window,
        softcap=softcap,
        num_splits=int(num_splits),
        validated=validate,
        cache_dtype=cache_dtype,
    )
    problem = problem.holding(**decode_arrays(
        problem, cache_seqlens=cache_seqlens, block_table=block_table, mask=mask, alibi_slopes=alibi_slopes,
        sinks=sinks, k_descale=k_descale, v_descale=v_descale))
    if validate:
        _check_values(cache_seqlens, block_table, new_tokens, capacity, slots if paged else None, rows)
    return problem


def decode_arrays(problem: DecodeProblem, *, cache_seqlens, block_table, mask, alibi_slopes, sinks, k_descale,
                  v_descale) -> dict:
    """A call's auxiliary arrays, each checked against ``problem`` (its scalars and shapes checked)
    and converted as the contract states: lengths and tables in int32, slopes and sinks in the
    lse's dtype; descales read on the host only where the problem is ``validated``. A decoding
    loop's calls differ in these alone (``flashx.plan.plan_decode``)."""
    p = problem
    like_q = (p.array_kind, p.device, p.device_index)
    mask, alibi_slopes, sinks, k_descale, v_descale = (None if x is None else arrays.resolved(x)
                                                       for x in (mask, alibi_slopes, sinks, k_descale, v_descale))
    _same_array_as_q("cache_seqlens", cache_seqlens, *like_q)
    if arrays.dtype_name(cache_seqlens) not in INTEGER_DTYPES:
        raise DTypeError(f"cache_seqlens: expected an integer dtype, got {arrays.dtype_name(cache_seqlens)}")
    if tuple(cache_seqlens.shape) != (p.batch,):
        raise ShapeError(f"cache_seqlens: expected shape ({p.batch},), got {tuple(cache_seqlens.shape)}")
    if mask is not None:
        _bool_broadcastable("mask", mask, (p.batch, p.heads_q, p.seqlen_q, p.seqlen_q), *like_q)
    _, alibi_slopes, sinks = _score_modifications(None, alibi_slopes, sinks, p.batch, p.heads_q, p.dtype, *like_q)
    descales = _descales({"k_descale": k_descale, "v_descale": v_descale}, p.cache_dtype in FP8_DTYPES,
                         f"an FP8 cache ({FP8_CACHE_DTYPE}), got k_cache of dtype {p.cache_dtype}", p.batch, p.heads_k,
                         *like_q, read_values=p.validated)
    return dict(cache_seqlens=arrays.astype(cache_seqlens, "int32"),
                block_table=None if block_table is None else arrays.astype(block_table, "int32"), mask=mask,
                alibi_slopes=alibi_slopes, sinks=sinks, **descales)


def _cache_dtype(k_cache, v_cache, dtype, kind, device, device_index) -> str:
    """The caches' one dtype: q's, or under bfloat16 and float16 queries FP8_CACHE_DTYPE (the
    contract's FP8 section)."""
    allowed = (dtype, FP8_CACHE_DTYPE) if dtype in FP8_OUT_DTYPES else (dtype,)
    expected = f"the dtype of q ({dtype})" + (f" or {FP8_CACHE_DTYPE} (an FP8 cache)" if len(allowed) > 1 else "")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        _same_array_as_q(name, x, kind, device, device_index)
        if arrays.dtype_name(x) not in allowed:
            raise DTypeError(f"{name}: expected {expected}, got {arrays.dtype_name(x)}")
    if arrays.dtype_name(v_cache) != arrays.dtype_name(k_cache):
        raise DTypeError(f"v_cache: expected the dtype of k_cache ({arrays.dtype_name(k_cache)}), "
                         f"got {arrays.dtype_name(v_cache)}")
    return arrays.dtype_name(k_cache)


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
