"""One call of a chosen backend, for every operation: arrays converted to its kind (auxiliary
arrays in the layout it declares), outputs checked and returned as the caller's. An empty
problem is answered here, without the backend.

Shared by the public functions (``flashx.api``, ``flashx.kvcache``), torch autograd
(``flashx.autograd``) and the torch operators (``flashx.ops``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashx import arrays
from flashx.backend import Backend
from flashx.errors import FlashXError
from flashx.problem import BaseProblem, DecodeProblem, Problem
from flashx.validation import check_like


def run_forward(impl: Backend, problem: Problem, q, k, v):
    if problem.is_empty:
        return _empty_outputs(problem, q)
    return _caller_outputs(impl, problem, q, *impl.forward(*for_backend(impl, problem, q, k, v)))


def prepare_forward(impl: Backend, problem: Problem, q, k, v) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """``run_forward`` of ``problem`` as a function of (q, k, v), for the calls of this very problem
    whose q, k and v have these arrays' metadata (``flashx.plan.prepare``): what that metadata
    fixes is worked out once, here (the empty answer, the problem as the backend receives it, the
    backend's own preparation, ``Backend.prepare_forward``); each call still converts its arrays
    where the backend takes another kind, and has its outputs checked and returned as the caller's."""
    if problem.is_empty:
        return lambda q, k, v: _empty_outputs(problem, q)
    received, *operands = for_backend(impl, problem, q, k, v)
    forward = impl.prepare_forward(received, *operands)
    if impl.array_kind == problem.array_kind:
        return lambda q, k, v: _caller_outputs(impl, problem, q, *forward(q, k, v))
    return lambda q, k, v: _caller_outputs(impl, problem, q, *forward(*_of_kind(impl, problem, (q, k, v))))


def run_backward(impl: Backend, problem: Problem, q, k, v, o, lse, do):
    """The backend's gradients: (dq, dk, dv), and dsinks when the problem has sinks (the
    contract's API section). ``o`` and ``lse`` must already be checked (autograd's are its own).
    ``do`` may come from autograd, so torch's lazy negation is resolved here."""
    do = arrays.resolved(do)
    check_like("do", do, problem.o_shape, problem.dtype, problem)
    expected = {"dq": (q.shape, problem.dtype), "dk": (k.shape, problem.dtype), "dv": (v.shape, problem.dtype)}
    if problem.sinks is not None:
        expected["dsinks"] = ((problem.heads_q,), problem.lse_dtype)
    if problem.is_empty:  # nothing reads a key: every gradient is 0, dsinks included
        return tuple(arrays.full(q, tuple(shape), 0.0, dtype) for shape, dtype in expected.values())
    grads = impl.backward(*for_backend(impl, problem, q, k, v, o, lse, do))
    if len(grads) != len(expected):
        raise FlashXError(f"backend {impl.name!r} returned {len(grads)} gradients, expected {len(expected)} "
                          f"({', '.join(expected)}): a backend bug")
    for (name, (shape, _)), grad in zip(expected.items(), grads):
        _check_output(impl, name, grad, tuple(shape))
    return tuple(arrays.to_caller(grad, q, dtype) for (_, dtype), grad in zip(expected.values(), grads))


def run_decode(impl: Backend, problem: DecodeProblem, q, k_cache, v_cache, k_new, v_new):
    """(o, lse) of ``attention_with_kvcache``, the new tokens written into the caches in place."""
    q, k_new, v_new = (None if x is None else arrays.resolved(x) for x in (q, k_new, v_new))
    if problem.is_empty:
        return _empty_outputs(problem, q)
    return _caller_outputs(impl, problem, q, *impl.decode(*for_backend(impl, problem, q, k_cache, v_cache, k_new, v_new)))


def _empty_outputs(problem: BaseProblem, q):
    """o = 0 and lse = -inf, or the sink's logit σ_h with sinks: what a problem whose rows read no
    key returns."""
    o = arrays.full(q, problem.o_shape, 0.0, problem.out_dtype)
    sinks = problem.sinks
    if sinks is None:
        return o, arrays.full(q, problem.lse_shape, -float("inf"), problem.lse_dtype)
    # heads lead the varlen lse (Hq, Tq) and follow the batch in the padded one (B, Hq, Nq)
    lse = arrays.full(q, problem.lse_shape, 0.0, problem.lse_dtype) + sinks.reshape(-1, 1)
    return o, lse


def _caller_outputs(impl: Backend, problem: BaseProblem, q, o, lse):
    """The backend's o and lse, checked, as arrays like q in the contract's dtypes."""
    _check_output(impl, "o", o, problem.o_shape)
    _check_output(impl, "lse", lse, problem.lse_shape)
    return arrays.to_caller(o, q, problem.out_dtype), arrays.to_caller(lse, q, problem.lse_dtype)


def for_backend(impl: Backend, problem: BaseProblem, *xs):
    """The problem and arrays as the backend's kind of array, auxiliary arrays in the layout it declares."""
    return (problem.with_arrays(arrays.for_backend(impl)), *_of_kind(impl, problem, xs))


def _of_kind(impl: Backend, problem: BaseProblem, xs: tuple) -> tuple:
    """``xs`` (None: absent) as arrays of the backend's kind."""
    kind = impl.array_kind
    if kind == problem.array_kind:
        return xs
    return tuple(None if x is None else arrays.convert(x, kind) for x in xs)


def _check_output(impl, name, x, shape):
    if tuple(x.shape) != tuple(shape):
        raise FlashXError(f"backend {impl.name!r} returned {name} of shape {tuple(x.shape)}, expected {tuple(shape)}: a backend bug")
