"""Planning a call of either operation: its validated problem and its chosen backend, remembered.

Two memories, each keyed on what its outcome depends on, never on an object's identity:

- the choice of a backend, for every operation: keyed on the requested backend, the registry's
  version and the problem's ``static_key`` (what runs, not what it runs on: no array contents,
  no dropout seed), so calls with masks, lengths, drawn seeds or a KV cache choose once;
- the whole plan (problem and backend) of an attention call without array options, whose
  validation itself is skipped when it repeats;
- the plan of a decoding call with ``validate=False`` but for its auxiliary arrays (lengths,
  tables, masks, slopes, sinks, descales): a decoding loop's steps differ in those alone, so a
  step checks and converts just them (``validation.decode_arrays``).

Benchmarks and training loops call ``attention`` again and again with arrays of the same
shapes and the same options; at short sequences, validating and dispatching each time
would cost more than the kernel. A whole plan depends only on what its key holds:

- of q, k and v: type, shape, dtype and device (validation and dispatch read nothing else;
  strides and contents reach the backend with each call's own arrays),
- the scalar options with their types (``causal=1`` is an error where ``causal=True`` is
  not, and ``1 == True`` in Python),
- the backend name once ``use_backend`` and ``FLASHX_BACKEND`` are applied, and the
  registry's version, which register, unregister and reset change. A backend's
  ``available()`` and ``supports()`` are taken to answer alike for problems of one static key:
  they read shapes and options, never an array's contents (the contract's Backend plugins section).

Only successes are stored, so a wrong call always meets every check and raises as before.
Calls with array options (masks, seqlens, ...) are validated every time, since their
contents matter, and so are calls that draw a dropout seed, which must be fresh; decoding calls
with ``validate=True`` are validated every time, since they read lengths and tables on the host.
"""

from __future__ import annotations

from flashx import arrays, dispatch, registry
from flashx.backend import Backend
from flashx.problem import BaseProblem, DecodeProblem, Problem
from flashx.validation import build_decode_problem, build_problem, decode_arrays

_SCALARS = frozenset({type(None), bool, int, float, str})  # str: out_dtype by name
_PAIRS = ("window", "dropout_offsets")  # options given as a tuple of two ints
_LIMIT = 256  # distinct calls remembered; past it the cache starts again empty

_plans: dict[tuple, tuple[Problem, Backend]] = {}
_decode_plans: dict[tuple, tuple[DecodeProblem, Backend]] = {}
_choices: dict[tuple, Backend] = {}


def plan(q, k, v, backend, options: dict) -> tuple[Problem, Backend]:
    """``build_problem`` then ``dispatch.choose``, or their result for an identical earlier call.

    ``options`` holds every option (``flashx.options.complete``), in the declared order.
    """
    key = _key(q, k, v, backend, options)
    found = _plans.get(key) if key is not None else None
    if found is not None:
        return found
    problem = build_problem(q, k, v, **options)
    found = problem, choose(problem, backend)
    if key is not None:
        _remember(_plans, key, found)
    return found


def plan_decode(q, k_cache, v_cache, backend, keywords: dict) -> tuple[DecodeProblem, Backend]:
    """``build_decode_problem`` then ``choose``: the keywords of ``attention_with_kvcache``; with
    ``validate=False``, an earlier call's plan of the same key holding this call's arrays."""
    key = _decode_key(q, k_cache, v_cache, backend, keywords)
    found = _decode_plans.get(key) if key is not None else None
    if found is None:
        problem = build_decode_problem(q, k_cache, v_cache, **keywords)
        found = problem, choose(problem, backend)
        if key is not None:
            _remember(_decode_plans, key, found)
        return found
    template, impl = found
    return template.holding(**decode_arrays(template, **{name: keywords[name] for name in DecodeProblem.ARRAYS})), impl


def choose(problem: BaseProblem, backend) -> Backend:
    """``dispatch.choose``, remembered per requested backend, registry version and static key."""
    key = (dispatch.requested(backend), registry.version(), problem.static_key)
    impl = _choices.get(key)
    if impl is None:
        impl = _remember(_choices, key, dispatch.choose(problem, backend))
    return impl


def _decode_key(q, k_cache, v_cache, backend, keywords: dict):
    """What a decoding call's plan depends on but its auxiliary arrays' contents, or None when
    the call is validated in full (``validate=True`` reads the lengths and tables)."""
    if keywords["validate"] is not False or not isinstance(backend, str):
        return None
    if any(arrays.resolved(cache) is not cache for cache in (k_cache, v_cache)):
        return None  # a lazily negated cache cannot be written in place: validation says so
    arrays_given = (q, k_cache, v_cache, *(keywords[name] for name in _DECODE_ARRAYS))
    signatures = tuple(None if x is None else arrays.signature(x) for x in arrays_given)
    if any(s is None for s, x in zip(signatures, arrays_given) if x is not None):
        return None  # not an array: validation says what is wrong
    options = tuple(keywords[name] for name in _DECODE_SCALARS)
    window = keywords["window"]
    if not _SCALARS.issuperset(map(type, options)) or not (
            window is None or (type(window) is tuple and all(type(side) is int for side in window))):
        return None
    return (dispatch.requested(backend), registry.version(), signatures, window, options,
            tuple(map(type, options)))


_DECODE_ARRAYS = ("k_new", "v_new", *DecodeProblem.ARRAYS)
_DECODE_SCALARS = ("causal", "softmax_scale", "softcap", "num_splits")


def _remember(memory: dict, key, value):
    if len(memory) >= _LIMIT:
        memory.clear()
    memory[key] = value
    return value


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
