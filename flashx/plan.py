"""Planning a call of either operation: its validated problem and its chosen backend, remembered.

Four memories, each keyed on what its outcome depends on, never on an object's identity:

- the choice of a backend, for every operation: keyed on the requested backend, the registry's
  version and the problem's ``static_key`` (what runs, not what it runs on: no array contents,
  no dropout seed), so calls with masks, lengths, drawn seeds or a KV cache choose once;
- the plan (problem and backend) of an attention call, keyed on all of it but the call's own
  fields: a repeated call without array options or dropout reuses the plan as it is; one with
  them (masks, lengths, offsets, slopes, sinks, descales; with dropout its seed, given or to
  draw, and RNG offset, which a training loop changes every step) checks and converts just
  those (``validation.attention_fields``, shared with ``build_problem``), reading lengths and
  offsets on the host as every call does, and draws a seed not given afresh;
- the plan of a decoding call with ``validate=False`` but for its auxiliary arrays (lengths,
  tables, masks, slopes, sinks, descales): a decoding loop's steps differ in those alone, so a
  step checks and converts just them (``validation.decode_arrays``);
- an attention call whole, when its problem holds no fields of its own (no array options, no
  dropout) and it takes its tensors as they are (no autograd, autocast, tracing or lazy
  negation): keyed on its keywords as given (names, values, types), the requested backend, the
  registry's version and the metadata of q, k and v, strides included (``call_key``), it keeps
  the function that ``execute.prepare_forward`` made for it (``prepare``), which has the
  backend's launch arguments worked out (``Backend.prepare_forward``). A later call of the key
  runs that function alone on its own arrays: none of the checks, planning or preparation,
  each of which read nothing but what the key holds; what depends on the arrays' addresses
  (alignment) is worked out by the function on every call. A decoding step of transformers'
  ``generate()`` calls attention once per layer with one query row: this is its path.

Benchmarks and training loops call ``attention`` again and again with arrays of the same
shapes and the same options; at short sequences, validating and dispatching each time
would cost more than the kernel. An attention plan depends only on what its key holds:

- of q, k, v and each array option: type, shape, dtype and device (validation and dispatch read
  nothing else of q, k and v, and check an array option's contents with each call; strides and
  contents reach the backend with each call's own arrays), and a block mask's block size,
- the scalar options with their types (``causal=1`` is an error where ``causal=True`` is
  not, and ``1 == True`` in Python),
- the backend name once ``use_backend`` and ``FLASHX_BACKEND`` are applied, and the
  registry's version, which register, unregister and reset change. A backend's
  ``available()`` and ``supports()`` are taken to answer alike for problems of one static key:
  they read shapes and options, never an array's contents (the contract's Backend plugins section).

The exception is packed sequences (cu_seqlens) whose longest lengths, read from the offsets,
differ from the plan's: those lengths are part of what runs, so such a call's problem is the
plan's with its own lengths, remembered under the key and those lengths, its backend chosen once.

Only successes are stored (a whole call once it has returned), so a wrong call always meets
every check and raises as before, and a repeated call's own fields meet the checks a first call's
do, but for those whose outcome the key fixes (a mask's type, shape, dtype and device; without
dropout, the seed and RNG offset). Decoding calls with ``validate=True`` are validated every
time, since they read lengths and tables on the host.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

from flashx import arrays, dispatch, registry
from flashx.backend import Backend
from flashx.execute import prepare_forward
from flashx.options import OPTIONS
from flashx.problem import BaseProblem, BlockMask, DecodeProblem, Problem
from flashx.validation import ARRAY_OPTIONS, attention_fields, build_decode_problem, build_problem, decode_arrays

_SCALARS = frozenset({type(None), bool, int, float, str})  # str: out_dtype by name
_LIMIT = 256  # distinct calls remembered; past it the cache starts again empty
#: Whole calls remembered (``remember``): two for each call through ``compat.sdpa_as_flashx``
#: (its own and ``flashx.attention``'s), so as many calls as the other memories hold.
_CALLS_LIMIT = 2 * _LIMIT

_plans: dict[tuple, tuple[Problem, Backend, bool]] = {}  # _template's
_decode_plans: dict[tuple, tuple[DecodeProblem, Backend]] = {}
_choices: dict[tuple, Backend] = {}
_calls: dict[tuple, Callable] = {}  # prepare's


def call_key(q, k, v, backend, given: dict, function: str = "attention") -> tuple | None:
    """Everything a call of ``flashx.attention`` (or of another ``function`` on its way there,
    ``compat.sdpa_as_flashx``) that takes its arrays as they are (``api.as_given``: no autograd,
    autocast, tracing or lazy negation) depends on but its arrays' contents and addresses: the
    requested backend, the registry's version, the keywords given (names, values and types) and
    the metadata of q, k and v (``arrays.metadata``: type, shape, strides, dtype, device). None
    for a call whose problem holds fields of its own (array options; dropout, whose seed is each
    call's) or that gives a keyword as other than a plain value (a NumPy scalar, a list): those
    are planned on every call."""
    if type(backend) is not str:
        return None
    values = tuple(given.values())
    types = tuple(map(type, values))
    if not _SCALARS.issuperset(types) and not all(
            kind in _SCALARS or (kind is tuple and all(type(side) is int for side in value))
            for kind, value in zip(types, values)):
        return None
    if given.get("dropout_p"):
        return None
    operands = (arrays.metadata(q), arrays.metadata(k), arrays.metadata(v))
    if None in operands:
        return None
    return function, dispatch.requested(backend), registry.version(), tuple(given), values, types, operands


def prepared(key: tuple) -> Callable | None:
    """The function remembered under ``key`` (``prepare``, ``remember``), or None."""
    return _calls.get(key)


def remember(key: tuple, run: Callable) -> None:
    """Remember ``run`` as the whole of the later calls of ``key`` (``call_key``): for a call that
    has returned, whose every check, choice and preparation read nothing but what the key holds."""
    _remember(_calls, key, run, _CALLS_LIMIT)


def prepare(key, impl: Backend, problem: Problem, q, k, v) -> tuple:
    """(o, lse) of a call of ``key`` (``call_key``) and its plan, through the function of
    ``execute.prepare_forward``, remembered under the key once it has returned: a later call of
    the key runs that function alone, since every check, choice and launch preparation this call
    made read nothing but what the key holds."""
    run = prepare_forward(impl, problem, q, k, v)
    outputs = run(q, k, v)
    remember(key, run)
    return outputs


def plan(q, k, v, backend, options: dict) -> tuple[Problem, Backend]:
    """``build_problem`` then ``dispatch.choose``, or for a call of the same key as an earlier one,
    that call's plan holding this call's own fields (``validation.attention_fields``).

    ``options`` holds every option (``flashx.options.complete``), in the declared order.
    """
    key = _key(q, k, v, backend, options)
    found = _plans.get(key) if key is not None else None
    if found is None:
        problem = build_problem(q, k, v, **options)
        impl = choose(problem, backend)
        if key is not None:
            _remember(_plans, key, _template(problem, impl, options))
        return problem, impl
    template, impl, owns_fields = found
    if not owns_fields:
        return template, impl
    fields = attention_fields(template, options, key_checked=True)
    lengths = (fields["seqlen_q"], fields["seqlen_k"])
    if lengths != (template.seqlen_q, template.seqlen_k):
        # packed sequences of other longest lengths: another static problem, remembered under the
        # key and those lengths, so that a training loop's batches plan once per longest lengths
        found = _plans.get((key, lengths))
        if found is None:
            problem = dataclasses.replace(template, **fields)
            found = _remember(_plans, (key, lengths), _template(problem, choose(problem, backend), options))
        template, impl, _ = found
    return template.holding(**fields), impl


def _template(problem: Problem, impl: Backend, options: dict) -> tuple[Problem, Backend, bool]:
    """What ``plan`` remembers of a call: its problem, its backend, and whether a call of its key
    brings fields of its own (arrays; with dropout, its seed and RNG offset). Such a problem is
    kept without its arrays, so that the memory holds on to none of a caller's data; its derived
    values (``static_key``, ``features``, shapes), worked out before its arrays are dropped, stay
    with the signatures of the arrays it had, and reach each call's copy (``Problem.holding``)."""
    owns_fields = problem.dropout_p > 0 or any(getattr(problem, name) is not None for name in Problem.ARRAYS)
    if owns_fields:
        problem = problem.with_derived_values().holding(**dict.fromkeys(Problem.ARRAYS))
    return problem, impl, owns_fields


def plan_decode(q, k_cache, v_cache, backend, keywords: dict) -> tuple[DecodeProblem, Backend]:
    """``build_decode_problem`` then ``choose``: the keywords of ``attention_with_kvcache``; with
    ``validate=False``, an earlier call's plan of the same key holding this call's arrays."""
    key = _decode_key(q, k_cache, v_cache, backend, keywords)
    found = _decode_plans.get(key) if key is not None else None
    if found is None:
        problem = build_decode_problem(q, k_cache, v_cache, **keywords)
        impl = choose(problem, backend)
        if key is not None:  # kept without the call's arrays, as ``_template`` keeps a prefill problem
            _remember(_decode_plans, key, (problem.with_derived_values().holding(**dict.fromkeys(DecodeProblem.ARRAYS)),
                                           impl))
        return problem, impl
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


def _remember(memory: dict, key, value, limit: int = _LIMIT):
    if len(memory) >= limit:
        memory.clear()
    memory[key] = value
    return value


def _key(q, k, v, backend, options):
    """Everything the outcome depends on but the call's own fields (``validation.attention_fields``),
    arrays by their signatures; None when the call must be checked in full."""
    values = [*options.values()]
    types = tuple(map(type, values))
    if not isinstance(backend, str) or not _SCALARS.issuperset(_scalar_types(types)):
        return None  # a number of another type: checked in full, it may be an error
    for position in _ARRAY_POSITIONS:
        x = values[position]
        if x is not None:
            values[position] = signature = arrays.signature(x)
            if signature is None:
                return None  # not an array: validation says what is wrong
    block_mask = values[_BLOCK_MASK_POSITION]
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask) or arrays.signature(block_mask.blocks) is None:
            return None
        values[_BLOCK_MASK_POSITION] = arrays.signature(block_mask.blocks), block_mask.block_size
    for position in _PAIR_POSITIONS:
        pair = values[position]
        if not (pair is None or (type(pair) is tuple and all(type(side) is int for side in pair))):
            return None
    dropout_p = values[_DROPOUT_POSITION]
    if type(dropout_p) in (int, float) and dropout_p > 0:  # the seed and offset are the call's own
        for position in _DROPOUT_STATE_POSITIONS:
            values[position] = None
    operands = (arrays.signature(q), arrays.signature(k), arrays.signature(v))
    return dispatch.requested(backend), registry.version(), operands, tuple(values), types


_NAMES = list(OPTIONS)
_ARRAY_POSITIONS = tuple(map(_NAMES.index, ARRAY_OPTIONS))
_BLOCK_MASK_POSITION = _NAMES.index("block_mask")
_PAIR_POSITIONS = tuple(map(_NAMES.index, ("window", "dropout_offsets")))  # options given as two ints
_DROPOUT_POSITION = _NAMES.index("dropout_p")
_DROPOUT_STATE_POSITIONS = tuple(map(_NAMES.index, ("seed", "rng_offset")))
#: The types of the options that ``_key`` holds as they are, from the types of all of them.
_scalar_types = operator.itemgetter(*sorted(set(range(len(_NAMES))) - {*_ARRAY_POSITIONS, _BLOCK_MASK_POSITION,
                                                                         *_PAIR_POSITIONS}))
