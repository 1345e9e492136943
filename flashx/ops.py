"""flashx's torch operators, registered with ``torch.library`` so that compilers see them whole.

``torch.compile`` and ``torch.export`` trace ``flashx.attention`` on torch tensors into two
operators, ``flashx::attention_forward`` and ``flashx::attention_backward``: the tracer sees
only their fake implementations (the output shapes and dtypes, from the input shapes alone)
and their autograd formula, never flashx's Python, so a model calling flashx traces without
a graph break. When the graph runs, the operators validate, plan and dispatch exactly as an
eager call does (backend="auto" picks at run time), through ``flashx.execute``.

An operator takes tensors and primitives only, so each keyword of ``flashx.attention`` travels
as one argument (``block_mask`` as its blocks and its block size), in the order of
``_TYPES``. Seeds and RNG offsets are uint64 in the contract and int64 in an operator's
schema: they travel as the int64 with the same 64 bits. The forward returns the dropout seed
it used (drawn at run time when none was given, from torch's default generator as in eager)
as a CPU int64 scalar, which the autograd formula hands to the backward: the backward
regenerates exactly the forward's dropout mask without the host ever reading a device value.

``sinks`` is a tensor argument like q, k, v, and the backward operator returns its gradient as a
fourth output, dsinks: an operator's outputs are fixed by its schema, so a call without sinks
returns an empty (0,) dsinks, which the autograd formula drops.

Every output is contiguous, as the fake implementations promise (and as the built-in backends
allocate them: a backend that returns another layout costs one copy here).

Lengths and offsets (seqlens, cu_seqlens) are read on the host inside the operator, at run
time, as eager calls read them: nothing in the traced graph depends on their values, so the
varlen layout needs no ``max_seqlen_*`` to trace (given, it is checked as in eager).

Eager calls do not come here: ``flashx.attention`` calls ``flashx.execute`` directly outside
of tracing, which costs less host time per call than the dispatcher's way into an operator.
"""

from __future__ import annotations

import torch

from flashx.errors import ShapeError
from flashx.execute import run_backward, run_decode, run_forward
from flashx.options import OPTIONS
from flashx.plan import plan, plan_decode
from flashx.problem import FP8_DTYPES, FP8_OUT_DTYPES, BlockMask
from flashx.validation import _is_int, _number

U64 = 2**64
I64_MAX = 2**63 - 1

#: Each option of ``flashx.options.OPTIONS`` as an operator argument, in the operators' order:
#: block_mask travels as its blocks and its block size, the backend's name with them, and the seed
#: apart (the forward takes the one given, the backward the one the forward used).
_TYPES = {
    "causal": "bool",
    "window": "int[]?",
    "softmax_scale": "float?",
    "softcap": "float?",
    "alibi_slopes": "Tensor?",
    "sinks": "Tensor?",
    "mask": "Tensor?",
    "block_mask": "Tensor?",
    "block_size": "int[]?",
    "seqlens_q": "Tensor?",
    "seqlens_k": "Tensor?",
    "cu_seqlens_q": "Tensor?",
    "cu_seqlens_k": "Tensor?",
    "max_seqlen_q": "SymInt?",
    "max_seqlen_k": "SymInt?",
    "dropout_p": "float",
    "rng_offset": "int",
    "dropout_offsets": "int[]?",
    "deterministic": "bool",
    "q_descale": "Tensor?",
    "k_descale": "Tensor?",
    "v_descale": "Tensor?",
    "out_dtype": "str?",  # a dtype's name: the schema's ScalarType would not take one
    "validate": "bool",
    "backend": "str",
}
_OPTIONS = ", ".join(f"{type_} {name}" for name, type_ in _TYPES.items())
_OPTION_NAMES = tuple(_TYPES)
_SINKS = _OPTION_NAMES.index("sinks")
_OUT_DTYPE = _OPTION_NAMES.index("out_dtype")
#: Options given as tuples of ints, lists in an operator's schema.
_TUPLES = ("window", "dropout_offsets")


def _attention_forward(q, k, v, seed, *options):
    backend, keywords = _keywords(options, None if seed is None else _uint64(seed))
    problem, impl = plan(q, k, v, backend, keywords)
    o, lse = run_forward(impl, problem, q, k, v)
    return o.contiguous(), lse.contiguous(), torch.tensor(_int64("seed", problem.seed))


def _attention_backward(do, q, k, v, o, lse, seed, *options):
    backend, keywords = _keywords(options, _uint64(int(seed)))
    problem, impl = plan(q, k, v, backend, keywords)
    dq, dk, dv, *dsinks = run_backward(impl, problem, q, k, v, o, lse, do)
    dsinks = dsinks[0] if dsinks else lse.new_empty((0,))
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks.contiguous()


def _define(name: str, schema: str, implementation, fake, tags=()):
    """One operator: its schema, the implementation for every device, the fake implementation.

    Registered at the level of ``torch.library.define``/``impl``: the call from the dispatcher goes
    straight to ``implementation``, without the checks and the dynamo guard ``custom_op`` wraps it in.
    """
    qualname = f"flashx::{name}"
    torch.library.define(qualname, schema, tags=tags)
    torch.library.impl(qualname, "default", implementation)
    torch.library.register_fake(qualname, fake)
    return getattr(torch.ops.flashx, name).default


def _forward_fake(q, k, v, seed, *options):
    if q.ndim not in (3, 4) or v.ndim != q.ndim:
        raise ShapeError(f"q, v: expected (B, N, H, D) or (T, H, D) (varlen), "
                         f"got shapes {tuple(q.shape)} and {tuple(v.shape)}")
    # (B, Nq, Hq, Dv) and (B, Hq, Nq) padded, (Tq, Hq, Dv) and (Hq, Tq) varlen.
    o = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=_out_dtype(q, options[_OUT_DTYPE]))
    lse = q.new_empty((*q.shape[:-3], q.shape[-2], q.shape[-3]), dtype=_lse_dtype(q))
    return o, lse, torch.empty((), dtype=torch.int64)


def _backward_fake(do, q, k, v, o, lse, seed, *options):
    sinks = options[_SINKS]
    return (*(x.new_empty(x.shape) for x in (q, k, v)), lse.new_empty((0,) if sinks is None else sinks.shape))


forward_op = _define(
    "attention_forward",
    f"(Tensor q, Tensor k, Tensor v, int? seed, {_OPTIONS}) -> (Tensor o, Tensor lse, Tensor seed_used)",
    _attention_forward,
    _forward_fake,
    # A seed drawn at run time makes the forward random: compilers must not merge or replay calls.
    tags=(torch.Tag.nondeterministic_seeded,),
)
backward_op = _define(
    "attention_backward",
    f"(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor seed, {_OPTIONS}) "
    "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)",
    _attention_backward,
    _backward_fake,
)


def _setup_context(ctx, inputs, output):
    q, k, v, _, *options = inputs
    o, lse, seed_used = output
    ctx.save_for_backward(q, k, v, o, lse, seed_used)
    ctx.mark_non_differentiable(lse)  # as in eager: the LSE takes no gradient
    ctx.options = options


def _backward(ctx, do, _dlse, _dseed):
    q, k, v, o, lse, seed_used = ctx.saved_tensors
    dq, dk, dv, dsinks = backward_op(do, q, k, v, o, lse, seed_used, *ctx.options)
    options = [None] * len(ctx.options)
    if ctx.options[_SINKS] is not None:
        options[_SINKS] = dsinks
    return dq, dk, dv, None, *options


torch.library.register_autograd("flashx::attention_forward", _backward, setup_context=_setup_context)


def _attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, window,
                            softmax_scale, softcap, alibi_slopes, sinks, mask, num_splits, validate, k_descale, v_descale,
                            backend):
    keywords = dict(cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new, block_table=block_table, causal=causal,
                    window=None if window is None else tuple(window), softmax_scale=softmax_scale, softcap=softcap,
                    alibi_slopes=alibi_slopes, sinks=sinks, mask=mask, num_splits=num_splits, validate=validate,
                    k_descale=k_descale, v_descale=v_descale)
    problem, impl = plan_decode(q, k_cache, v_cache, backend, keywords)
    o, lse = run_decode(impl, problem, q, k_cache, v_cache, k_new, v_new)
    return o.contiguous(), lse.contiguous()


def _kvcache_fake(q, k_cache, v_cache, *options):
    if q.ndim != 4 or v_cache.ndim != 4:
        raise ShapeError(f"q, v_cache: expected 4 dims, got shapes {tuple(q.shape)} and {tuple(v_cache.shape)}")
    batch, rows, heads, _ = q.shape
    return q.new_empty((batch, rows, heads, v_cache.shape[-1])), q.new_empty((batch, heads, rows), dtype=_lse_dtype(q))


kvcache_op = _define(
    "attention_with_kvcache",
    # k_new and v_new are written into the caches in place.
    "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? k_new, Tensor? v_new, "
    "Tensor? block_table, bool causal, int[]? window, float? softmax_scale, float? softcap, Tensor? alibi_slopes, "
    "Tensor? sinks, Tensor? mask, int num_splits, bool validate, Tensor? k_descale, Tensor? v_descale, str backend) "
    "-> (Tensor o, Tensor lse)",
    _attention_with_kvcache,
    _kvcache_fake,
)


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None,
                           causal=True, window=None, softmax_scale=None, softcap=None, alibi_slopes=None, sinks=None,
                           mask=None, num_splits=0, validate=True, k_descale=None, v_descale=None, return_lse=False,
                           backend="auto"):
    """``flashx.attention_with_kvcache`` through its operator: what a tracer records."""
    o, lse = kvcache_op(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                        None if window is None else list(window), softmax_scale, softcap, alibi_slopes, sinks, mask,
                        num_splits, validate, k_descale, v_descale, backend)
    return (o, lse) if return_lse else o


def attention(q, k, v, backend, options: dict, return_lse: bool):
    """``flashx.attention`` through the operators: what a tracer records."""
    arguments = dict(options, backend=backend, rng_offset=_int64("rng_offset", options["rng_offset"]))
    block_mask = arguments["block_mask"]
    if block_mask is not None:
        arguments["block_mask"], arguments["block_size"] = block_mask.blocks, list(block_mask.block_size)
    else:
        arguments["block_size"] = None
    for name in _TUPLES:
        if isinstance(arguments[name], tuple):
            arguments[name] = list(arguments[name])
    if isinstance(arguments["out_dtype"], torch.dtype):
        arguments["out_dtype"] = str(arguments["out_dtype"]).removeprefix("torch.")
    seed = None if arguments["seed"] is None else _int64("seed", arguments["seed"])
    o, lse, _ = forward_op(q, k, v, seed, *(arguments[name] for name in _OPTION_NAMES))
    return (o, lse) if return_lse else o


def _keywords(options, seed) -> tuple[str, dict]:
    """The backend's name and every option in the declared order, from the operator's arguments."""
    arguments = dict(zip(_OPTION_NAMES, options), seed=seed)
    blocks = arguments["block_mask"]
    arguments["block_mask"] = None if blocks is None else BlockMask(blocks, tuple(arguments["block_size"]))
    for name in _TUPLES:
        if arguments[name] is not None:
            arguments[name] = tuple(arguments[name])
    arguments["rng_offset"] = _uint64(arguments["rng_offset"])
    return arguments["backend"], {name: arguments[name] for name in OPTIONS}


def _int64(name: str, value: int) -> int:
    """A uint64, checked as validation checks it, as the int64 with the same bits."""
    expected = "an int in [0, 2**64)" + (" or None" if name == "seed" else "")
    _number(name, value, _is_int, expected, lambda x: 0 <= x < U64)
    return value - U64 if value > I64_MAX else value


def _uint64(value: int) -> int:
    return value + U64 if value < 0 else value


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _out_dtype(q, out_dtype: str | None):
    """o's dtype: q's, or for FP8 inputs ``out_dtype`` (a name; None: the default)."""
    if str(q.dtype).removeprefix("torch.") not in FP8_DTYPES:
        return q.dtype
    return getattr(torch, out_dtype or FP8_OUT_DTYPES[0])
