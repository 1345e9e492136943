"""The public functions of the contract's API section (docs/contract.md)."""

from __future__ import annotations

from typing import Any, NamedTuple

from flashx import arrays, dispatch, registry
from flashx.errors import DTypeError, ShapeError, UnsupportedError
from flashx.execute import run_backward, run_forward
from flashx.options import complete, python_scalar, signature
from flashx.plan import call_key, plan, prepare, prepared
from flashx.validation import build_problem, check_like


class Residuals(NamedTuple):
    """What the backward needs besides q, k, v, o: the LSE and the dropout RNG state used."""

    lse: Any
    seed: int
    rng_offset: int


def attention(q, k, v, *, return_lse=False, backend="auto", **options):
    """softmax(scale * q k^T, masked) v, exactly, in O(N) extra memory.

    q (B, Nq, Hq, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv) -> o (B, Nq, Hq, Dv), and with
    ``return_lse`` also lse (B, Hq, Nq) in natural log. With cu_seqlens the packed layout
    (T, H, D) is used. Differentiable through torch autograd when q, k, v or ``sinks`` require
    grad. The keywords (``flashx.options.OPTIONS``, shown in this function's signature) are
    defined in docs/contract.md, sections "Shapes", "Scores and masking", "Score modifications"
    and "Dropout".
    """
    key = call_key(q, k, v, backend, options) if type(return_lse) is bool and as_given(q, k, v) else None
    run = None if key is None else prepared(key)
    if run is not None:  # a call of these keywords and metadata has met every check below
        o, lse = run(q, k, v)
        return (o, lse) if return_lse else o
    options = complete("attention", options)
    return_lse = _checked_bool("return_lse", return_lse)
    q, k, v = arrays.under_autocast(q, k, v)
    if _is_fp8(q) and _wants_grad(q, k, v, options["sinks"]):
        raise UnsupportedError(f"q, k, v: FP8 attention is forward only (the contract's FP8 section), got "
                               f"{arrays.dtype_name(q)} tensors that require grad with grad mode on; call it "
                               f"under torch.no_grad() or on detached tensors")
    if arrays.traced(q):
        from flashx.ops import attention as traced_attention

        return traced_attention(q, k, v, backend, options, return_lse)
    q, k, v = map(arrays.resolved, (q, k, v))
    problem, impl = plan(q, k, v, backend, options)
    sinks = options["sinks"]  # the caller's tensor, which autograd differentiates (the problem's is data)
    if _wants_grad(q, k, v, sinks):
        from flashx.autograd import differentiable_forward

        o, lse = differentiable_forward(impl, problem, q, k, v, None if sinks is None else arrays.resolved(sinks))
    elif key is not None:
        o, lse = prepare(key, impl, problem, q, k, v)
    else:
        o, lse = run_forward(impl, problem, q, k, v)
    return (o, lse) if return_lse else o


def attention_forward(q, k, v, *, return_lse=True, backend="auto", **options) -> tuple[Any, Residuals]:
    """(o, res) without autograd; ``res`` feeds ``attention_backward``."""
    options = complete("attention_forward", options)
    _checked_bool("return_lse", return_lse)
    q, k, v = map(arrays.resolved, (q, k, v))
    problem, impl = plan(q, k, v, backend, options)
    o, lse = run_forward(impl, problem, q, k, v)
    return o, Residuals(lse, problem.seed, problem.rng_offset)


def attention_backward(do, q, k, v, o, res: Residuals, *, return_lse=True, backend="auto", **options):
    """(dq, dk, dv) for the upstream gradient ``do``, recomputing from ``res``; with ``sinks``,
    (dq, dk, dv, dsinks), dsinks (Hq,) in lse's dtype (the contract's API section)."""
    if not isinstance(res, Residuals):
        raise DTypeError(f"res: expected the flashx.Residuals that attention_forward returned, got {type(res).__name__}")
    for name in ("seed", "rng_offset"):
        given = options.pop(name, None)
        if given is not None and given != getattr(res, name):
            raise ShapeError(f"{name}: the backward regenerates dropout from res.{name}={getattr(res, name)}, got {given}")
    options = complete("attention_backward", {**options, "seed": res.seed, "rng_offset": res.rng_offset})
    _checked_bool("return_lse", return_lse)
    if _is_fp8(q):
        raise UnsupportedError(f"attention_backward: FP8 attention is forward only (the contract's FP8 section): "
                               f"no backend computes gradients of {arrays.dtype_name(q)} inputs")
    q, k, v, o, lse = map(arrays.resolved, (q, k, v, o, res.lse))
    problem, impl = plan(q, k, v, backend, options)
    check_like("o", o, problem.o_shape, problem.dtype, problem)
    check_like("res.lse", lse, problem.lse_shape, problem.lse_dtype, problem)
    return run_backward(impl, problem, q, k, v, o, lse, do)


def merge_states(o_a, lse_a, o_b, lse_b):
    """Combine attention over two disjoint key sets; empty parts weigh 0.

    The contract's "Merging partial results" section. o (..., N, H, Dv) with lse (..., H, N), as
    attention returns them, padded or varlen.
    """
    o_a, lse_a, o_b, lse_b = map(arrays.resolved, (o_a, lse_a, o_b, lse_b))
    kind = arrays.require_array(o_a, "o_a")
    for name, x in (("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if arrays.require_array(x, name) != kind:
            raise DTypeError(f"{name}: expected a {kind} array like o_a, got {arrays.kind_of(x)}")
    for name, o, lse in (("a", o_a, lse_a), ("b", o_b, lse_b)):
        expected = tuple(o.shape[:-3]) + (o.shape[-2], o.shape[-3]) if o.ndim >= 3 else None
        if expected is None or tuple(lse.shape) != expected:
            raise ShapeError(f"lse_{name}: expected shape {expected} to match o_{name} {tuple(o.shape)}, got {tuple(lse.shape)}")
    if tuple(o_a.shape) != tuple(o_b.shape):
        raise ShapeError(f"o_b: expected the shape of o_a {tuple(o_a.shape)}, got {tuple(o_b.shape)}")
    weight_a, weight_b, lse = merge_weights(arrays.module(kind), lse_a, lse_b)
    o = weight_a * o_a + weight_b * o_b
    return arrays.to_caller(o, o_a, arrays.dtype_name(o_a)), lse


def merge_weights(xp, lse_a, lse_b):
    """(weight of o_a, weight of o_b, the merged lse) of ``merge_states``, the weights shaped to
    multiply o: exp(lse_part - lse), and 0 where both parts are empty. ``xp``: the arrays' module."""
    lse = xp.logaddexp(lse_a, lse_b)
    empty = lse == -float("inf")

    def weight(part_lse):
        w = xp.where(empty, 0.0, xp.exp(part_lse - xp.where(empty, 0.0, lse)))
        return w.swapaxes(-1, -2)[..., None]

    return weight(lse_a), weight(lse_b), lse


def backends():
    """Every registered backend (name, version, devices, available or why not), load failures included."""
    return registry.infos()


def explain(q, k, v, *, return_lse=False, backend="auto", **options) -> dispatch.Explanation:
    """Which backend ``attention`` would run for these arguments, and why each other one would not.

    ``backend`` (or ``use_backend``, or ``FLASHX_BACKEND``) is honoured as ``attention`` honours it:
    ``chosen`` is the requested backend, or None when it cannot run these arguments.
    """
    options = complete("explain", options)
    _checked_bool("return_lse", return_lse)
    return dispatch.explain(build_problem(q, k, v, **options), backend)


def _checked_bool(name, value) -> bool:
    value = python_scalar(value)
    if not isinstance(value, bool):
        raise DTypeError(f"{name}: expected a bool, got {value!r}")
    return value


def as_given(q, k, v) -> bool:
    """Whether ``attention`` takes q, k and v as they are, with none of its steps that change
    them or the call: torch tensors outside torch.compile's tracing, outside autocast on their
    device, without torch's lazy negation or conjugation, and outside autograd (grad mode off, or
    none requires grad); arrays of another kind have none of these. The outcome of such a call is
    fixed by its keywords and its arrays' metadata (``plan.call_key``). Conjugation is left
    untested: only a complex tensor has it, and no call of a complex dtype is ever remembered."""
    if arrays.kind_of(q) != "torch":
        return True
    if type(k) is not type(q) or type(v) is not type(q):  # of one type (rarely not, and then planned)
        return False
    import torch  # a plain import: Dynamo traces it, and is_compiling() comes first

    return not (torch.compiler.is_compiling() or torch.is_autocast_enabled(q.device.type)
                or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
                or q.is_neg() or k.is_neg() or v.is_neg())


def _is_fp8(q) -> bool:
    """Whether q is an FP8 array: the contract's FP8 section, forward only."""
    return arrays.kind_of(q) is not None and arrays.dtype_name(q) in arrays.FP8_DTYPES


def _wants_grad(*tensors) -> bool:
    """Whether autograd must record the call: grad mode on and a torch input (None: absent) that requires grad."""
    if arrays.kind_of(tensors[0]) != "torch":
        return False
    import torch

    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


attention.__signature__ = signature("q", "k", "v", return_lse=False, backend="auto")
attention_forward.__signature__ = signature("q", "k", "v", return_lse=True, backend="auto")
attention_backward.__signature__ = signature("do", "q", "k", "v", "o", "res", return_lse=True, backend="auto")
explain.__signature__ = signature("q", "k", "v", return_lse=False, backend="auto")
