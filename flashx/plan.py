"""A call's validated ``Problem`` and chosen backend, remembered for calls that repeat.

Benchmarks and training loops call ``attention`` again and again with arrays of the same
shapes and the same options; at short sequences, validating and dispatching each time
would cost more than the kernel. Both outcomes depend only on what the key holds:

- of q, k and v: type, shape, dtype and device (validation and dispatch read nothing else;
  strides and contents reach the backend with each call's own arrays),
- the scalar options with their types (``causal=1`` is an error where ``causal=True`` is
  not, and ``1 == True`` in Python),
- the backend name once ``use_backend`` and ``FLASHX_BACKEND`` are applied, and the
  registry's version, which register, unregister and reset change. A backend's
  ``available()`` and ``supports()`` are taken to answer alike for equal problems.

Only successes are stored, so a wrong call always meets every check and raises as before.
Calls with array options (masks, seqlens, ...) are validated every time, since their
contents matter, and so are calls that draw a dropout seed, which must be fresh.
"""

from __future__ import annotations

from flashx import arrays, dispatch, registry
from flashx.backend import Backend
from flashx.problem import Problem
from flashx.validation import build_problem
_SCALARS = frozenset({type(None), bool, int, float})
_PAIRS = ("window", "dropout_offsets")  # options given as a tuple of two ints
_LIMIT = 256  # distinct calls remembered; past it the cache starts again empty

_plans: dict[tuple, tuple[Problem, Backend]] = {}


def plan(q, k, v, backend, options: dict) -> tuple[Problem, Backend]:
    """``build_problem`` then ``dispatch.choose``, or their result for an identical earlier call.

    ``options`` holds every option (``flashx.options.complete``), in the declared order.
    """
    key = _key(q, k, v, backend, options)
    found = _plans.get(key) if key is not None else None
    if found is not None:
        return found
    problem = build_problem(q, k, v, **options)
    found = problem, dispatch.choose(problem, backend)
    if key is not None:
        if len(_plans) >= _LIMIT:
            _plans.clear()
        _plans[key] = found
    return found


def _key(q, k, v, backend, options):
    """Everything the outcome depends on, or None when the call must be checked in full."""
    options = dict(options)
    pairs = tuple(options.pop(name) for name in _PAIRS)
    values = tuple(options.values())
    types = tuple(map(type, values))
    cacheable = (
        isinstance(backend, str)
        and _SCALARS.issuperset(types)  # not with an array option, nor a number of another type
        and all(pair is None or (type(pair) is tuple and all(type(side) is int for side in pair)) for pair in pairs)
        and (options["seed"] is not None or options["dropout_p"] == 0)  # else a seed is drawn
    )
    if not cacheable:
        return None
    signatures = (arrays.signature(q), arrays.signature(k), arrays.signature(v))
    return dispatch.requested(backend), registry.version(), signatures, pairs, values, types
