"""One call of a chosen backend: arrays converted to its kind, outputs checked and returned as the caller's.

Shared by the public functions (``flashx.api``) and torch autograd (``flashx.autograd``).
"""

from __future__ import annotations

from flashx import arrays
from flashx.backend import Backend
from flashx.errors import FlashXError
from flashx.problem import Problem
from flashx.validation import check_like


def run_forward(impl: Backend, problem: Problem, q, k, v):
    if problem.is_empty:
        return (
            arrays.full(q, problem.o_shape, 0.0, problem.dtype),
            arrays.full(q, problem.lse_shape, -float("inf"), problem.lse_dtype),
        )
    o, lse = impl.forward(*_for_backend(impl, problem, q, k, v))
    _check_output(impl, "o", o, problem.o_shape)
    _check_output(impl, "lse", lse, problem.lse_shape)
    return arrays.to_caller(o, q, problem.dtype), arrays.to_caller(lse, q, problem.lse_dtype)


def run_backward(impl: Backend, problem: Problem, q, k, v, o, lse, do):
    """The backend's gradients; ``o`` and ``lse`` must already be checked (autograd's are its own).
    ``do`` may come from autograd, so torch's lazy negation is resolved here."""
    do = arrays.resolved(do)
    check_like("do", do, problem.o_shape, problem.dtype, problem)
    if problem.is_empty:
        return tuple(arrays.full(q, x.shape, 0.0, problem.dtype) for x in (q, k, v))
    grads = impl.backward(*_for_backend(impl, problem, q, k, v, o, lse, do))
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        _check_output(impl, name, grad, tuple(like.shape))
    return tuple(arrays.to_caller(grad, q, problem.dtype) for grad in grads)


def _for_backend(impl: Backend, problem: Problem, *xs):
    """The problem and arrays as the backend's kind of array, auxiliary arrays in the layout it declares."""
    kind = impl.array_kind
    problem = problem.with_arrays(arrays.for_backend(impl))
    if kind == problem.array_kind:
        return (problem, *xs)
    return (problem, *(arrays.convert(x, kind) for x in xs))


def _check_output(impl, name, x, shape):
    if tuple(x.shape) != tuple(shape):
        raise FlashXError(f"backend {impl.name!r} returned {name} of shape {tuple(x.shape)}, expected {tuple(shape)}: a backend bug")
