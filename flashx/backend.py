"""The contract's Backend plugins section (docs/contract.md) as a declarative base class.

A backend declares what it can do (devices, dtypes, head dims, features); ``supports()``
turns every unmet declaration into a readable reason, so dispatch can show all of them.
Nothing here imports a GPU library.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from flashx.problem import FEATURES, BaseProblem, Problem

#: The dtypes a backend takes unless it declares others; FP8_DTYPES are taken only by naming them,
#: since FP8 inputs come with descales that a backend must read.
ALL_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
#: Features a backend has only by naming them: one that keeps the default declaration would
#: otherwise claim them without reading the Problem fields they add, and compute another function
#: (scores without their softcap, bias or sink; for dropout offsets, another mask).
OPT_IN_FEATURES = frozenset({"dropout_offsets", "softcap", "alibi", "sinks"})
#: Each operation (``BaseProblem.operation``): what it is, the method that runs it (a backend
#: implements the operation by overriding it; every backend owes attention) and the method that
#: adds a backend's own reasons.
OPERATIONS = {
    "attention": ("flashx.attention (forward and backward)", None, "extra_reasons"),
    "decode": ("decoding with a KV cache (attention_with_kvcache)", "decode", "decode_reasons"),
}


class Backend:
    """Subclass, set the class attributes, implement ``forward`` and ``backward``.

    ``forward(problem, q, k, v) -> (o, lse)`` and
    ``backward(problem, q, k, v, o, lse, do) -> (dq, dk, dv)``, or ``(dq, dk, dv, dsinks)`` when
    ``problem.sinks`` is set (dsinks (Hq,) in ``problem.lse_dtype``), receive arrays of
    ``array_kind`` on the problem's device, in the layouts of the contract's Shapes section, with any
    strides. Outputs may be returned in float32 where ``array_kind`` cannot hold the
    input dtype (bfloat16 in NumPy); the core rounds them to the contract dtype.
    """

    name: str = ""
    version: str = "0"
    array_kind: str = "numpy"  # "numpy" | "torch" | "cupy": what forward/backward receive
    devices: frozenset[str] = frozenset()  # "cpu", "cuda"
    dtypes: frozenset[str] = ALL_DTYPES
    max_head_dim: int = 256
    features: frozenset[str] = frozenset(FEATURES) - OPT_IN_FEATURES
    deterministic_backward: bool = True
    #: The auxiliary arrays (names of ``Problem.ARRAYS`` and ``DecodeProblem.ARRAYS``) this backend
    #: reads through their strides; every other one reaches it contiguous, whatever view the
    #: caller passed. A bool mask is worth reading by strides: its broadcast is free that way.
    strided_arrays: frozenset[str] = frozenset()

    def available(self) -> str | None:
        """None when the backend can run on this machine, else the reason it cannot."""
        return None

    def device_names(self) -> list[str]:
        """The concrete devices it would run on here, for ``flashx info``."""
        return sorted(self.devices)

    def priority(self, problem: Problem) -> int:
        """Higher wins in ``backend="auto"``."""
        return 0

    @property
    def operations(self) -> frozenset[str]:
        """The operations (keys of ``OPERATIONS``) whose method this backend implements."""
        return frozenset(name for name, (_, method, _) in OPERATIONS.items() if method is None or self.implements(method))

    def implements(self, method: str) -> bool:
        """Whether this backend overrides ``method``, one of Backend's optional methods (``decode``,
        ``forward_into``, ``backward_into``)."""
        return getattr(type(self), method) is not getattr(Backend, method)

    def supports(self, problem: BaseProblem) -> list[str]:
        what, _, own_reasons = OPERATIONS[problem.operation]
        if problem.operation not in self.operations:
            return [f"does not implement {what}"]
        reasons = []
        if problem.device not in self.devices:
            reasons.append(f"runs on {_names(self.devices)}, not {problem.device}")
        if problem.fp8 and problem.fp8_dtype not in self.dtypes:
            reasons.append(f"does not implement FP8 ({problem.fp8_dtype}) yet")
        if problem.dtype not in self.dtypes and problem.dtype != problem.fp8_dtype:  # FP8: said above
            reasons.append(f"supports dtypes {_names(self.dtypes)}, not {problem.dtype}")
        if problem.fp8 and "dropout" in problem.features:
            reasons.append("takes no dropout with FP8 inputs: FP8 attention is forward only (inference), "
                           "where dropout is off")
        widest = max(problem.head_dim, problem.head_dim_v)
        if widest > self.max_head_dim:
            reasons.append(f"supports head dims up to {self.max_head_dim}, not {widest}")
        for feature in sorted(problem.features - self.features):
            reasons.append(f"does not support {FEATURES[feature]}")
        if problem.deterministic and not self.deterministic_backward:
            reasons.append("cannot promise a deterministic backward (deterministic=True)")
        return reasons + getattr(self, own_reasons)(problem)

    def extra_reasons(self, problem: Problem) -> list[str]:
        """Reasons beyond the declarations (limits of a kernel, a missing device feature)."""
        return []

    def forward(self, problem: Problem, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def backward(self, problem: Problem, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any) -> tuple[Any, Any, Any]:
        raise NotImplementedError

    def prepare_forward(self, problem: Problem, q: Any, k: Any, v: Any) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
        """``forward`` of ``problem`` as a function of (q, k, v), for every call of this problem whose
        q, k and v have the metadata of these (type, shape, strides, dtype, device): the core
        remembers it per call metadata and calls it on each such call's own arrays (the contract's
        Backend plugins section). What that metadata fixes may be worked out here, once; what
        depends on the arrays' addresses (alignment) or contents must be worked out on each call,
        and the function must keep no array. By default, ``forward`` itself."""
        return functools.partial(self.forward, problem)

    def settle(self) -> None:
        """Return once the work earlier calls left running past their return (kernels compiling in
        another process) has ended: until then calls are exact but may be slower (the contract's
        Backend plugins section). By default nothing is left running."""

    def forward_into(self, problem: Problem, q: Any, k: Any, v: Any, o_sums: Any, lse_sums: Any) -> None:
        """Optional: merge this call's (o, lse) into the running sums ``o_sums`` (o's shape) and
        ``lse_sums`` (lse's shape), in place, as ``flashx.api.merge_states`` merges two parts; both
        of ``problem.lse_dtype``, views with any strides (a ring passes slices of its running
        buffers), holding a state (o = 0 where lse = -inf). Rows of no sequence are left as they
        are. ``flashx.accumulate.run_forward_into`` calls it, and without it merges ``forward``'s
        outputs itself; accumulating in the kernel spares the passes that merge a returned part,
        and the part's rounding to the input dtype."""
        raise NotImplementedError

    def backward_into(self, problem: Problem, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, dq_sums: Any,
                      dk_sums: Any, dv_sums: Any) -> Any:
        """Optional: add ``backward``'s dq, dk and dv, unrounded, into the running sums ``dq_sums``,
        ``dk_sums``, ``dv_sums`` (views of ``problem.lse_dtype`` with any strides), in place; returns
        dsinks when ``problem.sinks`` is set, else None. ``flashx.accumulate.run_backward_into``
        calls it, and without it adds ``backward``'s outputs itself."""
        raise NotImplementedError

    def decode_reasons(self, problem) -> list[str]:
        """For ``flashx.attention_with_kvcache`` (a ``flashx.problem.DecodeProblem``), what
        ``extra_reasons`` is for attention."""
        return []

    def decode(self, problem, q: Any, k_cache: Any, v_cache: Any, k_new: Any, v_new: Any) -> tuple[Any, Any]:
        """(o, lse) of the contract's "Decoding with a KV cache" section, after writing k_new and
        v_new (None without new tokens) into the caches in place."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<flashx backend {self.name} {self.version}>"


#: How many static problems and layouts a backend's ``per_static_problem`` memory holds before it
#: starts again empty.
BUILT_LIMIT = 256


def per_static_problem(memory: dict, problem: BaseProblem, key, build: Callable[[], Any]) -> Any:
    """``build()``, made once per static problem (``problem.static_key``: what runs, not what it
    runs on) and ``key`` (what else the build reads: a kernel's name, ``tensor_layout`` of the
    call's tensors) and kept in ``memory``, a backend's own dict. What is built must hold no array
    and none of a call's own values (addresses, dropout's seed): calls with masks, lengths or a
    drawn seed are new problems every time, and share what their first call built."""
    full_key = (problem.static_key, key)
    found = memory.get(full_key)
    if found is None:
        if len(memory) >= BUILT_LIMIT:
            memory.clear()
        found = memory[full_key] = build()
    return found


def tensor_layout(*tensors) -> tuple:
    """What a launch depends on in tensors (torch's) of a given problem, whose shapes and dtype
    the problem fixes: their strides, and whether each address is a multiple of 16 bytes (vector
    and TMA copies need it); None for an absent one."""
    return tuple(None if x is None else (x.stride(), x.data_ptr() % 16 == 0) for x in tensors)


def weightless_rows_as_plus_inf(lse):
    """lse (torch's) as a backward that recomputes P = exp(S - lse) reads it: rows without weight
    (lse = -inf: no allowed key, or every allowed score -inf) as +inf, so that their P is exactly 0
    rather than exp(-inf + inf) = NaN (docs/contract.md, "Rows of -inf scores"). NaN stays NaN."""
    return lse.masked_fill(lse == -math.inf, math.inf)


def _names(items) -> str:
    return ", ".join(sorted(items))
