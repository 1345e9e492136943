"""Backend calls that accumulate into running sums: a partial result merged into a running
(o, lse), gradients added into running dq, dk, dv. Ring attention makes one such call per query
chunk, key chunk and set of sequences at every step (``flashx.ring.steps``).

A backend that implements ``Backend.forward_into`` and ``Backend.backward_into`` merges and adds
as its kernels write; for any other, the call's outputs are merged or added here, by the
arithmetic of the contract's "Merging partial results" (``flashx.api.merge_weights``), in the
sums' precision. The backend's way spares the passes over each returned part (allocating it,
weighting and adding it) and the part's rounding to the input dtype before it is summed.
"""

from __future__ import annotations

from flashx import arrays
from flashx.api import merge_weights
from flashx.backend import Backend
from flashx.execute import for_backend, run_backward, run_forward
from flashx.problem import Problem
from flashx.validation import check_like


def run_forward_into(impl: Backend, problem: Problem, q, k, v, o_sums, lse_sums) -> None:
    """Merge this call's (o, lse) into ``o_sums`` and ``lse_sums`` in place: arrays like q, of o's
    and lse's shapes, in ``problem.lse_dtype``, any strides. They hold a state: o = 0 where
    lse = -inf."""
    check_like("o_sums", o_sums, problem.o_shape, problem.lse_dtype, problem)
    check_like("lse_sums", lse_sums, problem.lse_shape, problem.lse_dtype, problem)
    if _in_kernels(impl, problem, "forward_into"):
        impl.forward_into(*for_backend(impl, problem, q, k, v), o_sums, lse_sums)
        return
    o, lse = run_forward(impl, problem, q, k, v)
    # written into the sums where they lie: no merged copy of o to allocate and copy back
    weight_sums, weight, lse_sums[...] = merge_weights(arrays.module(problem.array_kind), lse_sums, lse)
    o_sums *= weight_sums
    o_sums += o * weight


def run_backward_into(impl: Backend, problem: Problem, q, k, v, o, lse, do, dq_sums, dk_sums, dv_sums):
    """Add this call's dq, dk and dv into the sums in place (arrays like q, k and v, in
    ``problem.lse_dtype``, any strides); returns dsinks when the problem has sinks, else None.
    ``o`` and ``lse`` must already be checked, as for ``run_backward``."""
    for name, sums, like in (("dq_sums", dq_sums, q), ("dk_sums", dk_sums, k), ("dv_sums", dv_sums, v)):
        check_like(name, sums, tuple(like.shape), problem.lse_dtype, problem)
    if _in_kernels(impl, problem, "backward_into"):
        do = arrays.resolved(do)
        check_like("do", do, problem.o_shape, problem.dtype, problem)
        dsinks = impl.backward_into(*for_backend(impl, problem, q, k, v, o, lse, do), dq_sums, dk_sums, dv_sums)
        return None if dsinks is None else arrays.to_caller(dsinks, q, problem.lse_dtype)
    grads = run_backward(impl, problem, q, k, v, o, lse, do)
    for sums, part in zip((dq_sums, dk_sums, dv_sums), grads):
        sums += part
    return grads[3] if problem.sinks is not None else None


def _in_kernels(impl: Backend, problem: Problem, method: str) -> bool:
    """Whether the backend's ``method`` accumulates this call: it has one, and receives the sums
    themselves (arrays of its own kind, which no conversion copies). An empty problem is answered
    by the core, as ``flashx.execute`` answers it."""
    return impl.implements(method) and impl.array_kind == problem.array_kind and not problem.is_empty
