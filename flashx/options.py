"""The keywords of the attention functions, declared once.

``flashx.attention``, ``attention_forward``, ``attention_backward`` and ``explain`` take these
keywords (the contract's API section); validation reads them from here, and the plan cache keys
on them in this order. NumPy scalars (``np.True_``, ``np.float32(0.1)``) are accepted wherever a
Python scalar is, and are taken as that Python scalar.
"""

from __future__ import annotations

import inspect
from typing import Any

#: name -> default, in the order of the public signature.
OPTIONS: dict[str, Any] = {
    "causal": False,
    "window": None,
    "softmax_scale": None,
    "softcap": None,
    "alibi_slopes": None,
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
}


def complete(function: str, given: dict[str, Any]) -> dict[str, Any]:
    """Every option, the given ones as Python scalars, the rest at their defaults."""
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{function}() got unexpected keyword arguments {unknown}; known: {', '.join(OPTIONS)}")
    return {name: python_scalar(given.get(name, default)) for name, default in OPTIONS.items()}


def python_scalar(value: Any) -> Any:
    """A NumPy scalar as the Python scalar it holds; anything else as it is (tuples element-wise)."""
    if type(value).__module__ == "numpy" and type(value).__name__ != "ndarray":
        return value.item()
    if type(value) in (tuple, list):
        return type(value)(map(python_scalar, value))
    return value


def signature(*leading: str, **trailing: Any) -> inspect.Signature:
    """The signature a public function shows: positional ``leading``, the options, then ``trailing``."""
    positional = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in leading]
    keywords = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for name, default in {**OPTIONS, **trailing}.items()
    ]
    return inspect.Signature(positional + keywords)
