"""The keywords of the attention functions, declared once.

``flashx.attention``, ``attention_forward``, ``attention_backward`` and ``explain`` take these
keywords (the contract's API section); validation reads them from here, and the plan cache keys
on them in this order. NumPy scalars (``np.True_``, ``np.float32(0.1)``) are accepted wherever a
Python scalar is, and are taken as that Python scalar. An unknown keyword is a ``TypeError``, as
Python's own, that names the flashx keyword it likely means.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

#: name -> default, in the order of the public signature.
OPTIONS: dict[str, Any] = {
    "causal": False,
    "window": None,
    "softmax_scale": None,
    "softcap": None,
    "alibi_slopes": None,
    "sinks": None,
    "mask": None,
    "block_mask": None,
    "seqlens_q": None,
    "seqlens_k": None,
    "cu_seqlens_q": None,
    "cu_seqlens_k": None,
    "max_seqlen_q": None,
    "max_seqlen_k": None,
    "dropout_p": 0.0,
    "seed": None,
    "rng_offset": 0,
    "dropout_offsets": None,
    "deterministic": False,
    # FP8 inputs (the contract's FP8 section)
    "q_descale": None,
    "k_descale": None,
    "v_descale": None,
    "out_dtype": None,
    # False: the caller vouches for the auxiliary arrays' values, which are then not read on the host
    "validate": True,
}

#: Keywords of other attention libraries that flashx spells differently -> the flashx keywords
#: meant (an unknown keyword's error names them). Names flashx shares (dropout_p, softmax_scale,
#: causal, ...) need no entry.
ALIASES: dict[str, tuple[str, ...]] = {
    "is_causal": ("causal",),  # torch SDPA
    "attn_mask": ("mask",),  # torch SDPA
    "scale": ("softmax_scale",),  # torch SDPA, xformers
    "window_size": ("window",),  # flash-attn
    "attn_bias": ("mask", "causal"),  # xformers: a tensor, or LowerTriangularMask for causal
    "p": ("dropout_p",),  # xformers
}


def complete(function: str, given: dict[str, Any]) -> dict[str, Any]:
    """Every option, the given ones as Python scalars, the rest at their defaults."""
    unknown = given.keys() - OPTIONS.keys()
    if unknown:
        what = "an unexpected keyword argument" if len(unknown) == 1 else "unexpected keyword arguments"
        raise TypeError(f"{function}() got {what} {', '.join(map(_with_suggestion, sorted(unknown)))}; "
                        f"known: {', '.join(OPTIONS)}")
    completed = OPTIONS.copy()  # the defaults, Python scalars already; a given option keeps its place
    for name, value in given.items():
        completed[name] = python_scalar(value)
    return completed


def _with_suggestion(name: str) -> str:
    meant = ALIASES.get(name) or difflib.get_close_matches(name, OPTIONS, n=2)
    return f"{name!r} (did you mean {' or '.join(map(repr, meant))}?)" if meant else repr(name)


def python_scalar(value: Any) -> Any:
    """A NumPy scalar as the Python scalar it holds; anything else as it is (tuples element-wise)."""
    if type(value) in _PYTHON_SCALARS:
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ != "ndarray":
        return value.item()
    if type(value) in (tuple, list):
        return type(value)(map(python_scalar, value))
    return value


_PYTHON_SCALARS = frozenset({type(None), bool, int, float, str})


def signature(*leading: str, **trailing: Any) -> inspect.Signature:
    """The signature a public function shows: positional ``leading``, the options, then ``trailing``."""
    positional = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in leading]
    keywords = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for name, default in {**OPTIONS, **trailing}.items()
    ]
    return inspect.Signature(positional + keywords)
