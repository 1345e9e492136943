"""Choosing a backend: explicit names never fall back; "auto" picks by declared priority.

"auto" considers a backend only through ``available()`` and ``supports()``: it never
retries another backend after a runtime error, and when nothing fits it raises one
``UnsupportedError`` that lists every backend with all of its reasons.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass

from flashx import registry
from flashx.backend import Backend
from flashx.errors import DTypeError, UnsupportedError
from flashx.problem import Problem

ENV_VAR = "FLASHX_BACKEND"
_default_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("flashx_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, ``backend="auto"`` means ``name`` (as ``FLASHX_BACKEND`` does globally)."""
    if not isinstance(name, str):
        raise DTypeError(f"use_backend: expected a backend name, got {name!r}")
    if name != "auto":
        registry.get(name)
    token = _default_backend.set(name)
    try:
        yield
    finally:
        _default_backend.reset(token)


def requested(backend: str) -> str:
    """The name a call asks for once the context manager and the environment are applied."""
    if not isinstance(backend, str):
        raise DTypeError(f"backend: expected a backend name or 'auto', got {backend!r}")
    if backend != "auto":
        return backend
    return _default_backend.get() or os.environ.get(ENV_VAR) or "auto"


def reasons(backend: Backend, problem: Problem) -> list[str]:
    unavailable = backend.available()
    return [unavailable] if unavailable else list(dict.fromkeys(backend.supports(problem)))


@dataclass(frozen=True)
class Row:
    name: str
    priority: int | None  # None when the backend cannot run the problem
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Explanation:
    """For every backend: could it run this problem, and if not, why. ``chosen`` is auto's pick."""

    problem: Problem
    rows: tuple[Row, ...]
    chosen: str | None

    def __str__(self) -> str:
        lines = [self.problem.describe()]
        width = max((len(row.name) for row in self.rows), default=0)
        for row in self.rows:
            if row.reasons:
                status = "no: " + "; ".join(row.reasons)
            else:
                status = f"yes (priority {row.priority})" + ("  <- auto" if row.name == self.chosen else "")
            lines.append(f"  {row.name:<{width}}  {status}")
        return "\n".join(lines)


def explain(problem: Problem) -> Explanation:
    rows = []
    for name, backend in sorted(registry.backends().items()):
        why = reasons(backend, problem)
        rows.append(Row(name, None if why else int(backend.priority(problem)), tuple(why)))
    rows += [Row(info.name, None, (info.reason,)) for info in registry.failures()]
    runnable = [row for row in rows if row.priority is not None]
    chosen = max(runnable, key=lambda row: row.priority).name if runnable else None
    return Explanation(problem, tuple(rows), chosen)


def choose(problem: Problem, backend: str = "auto") -> Backend:
    name = requested(backend)
    if name != "auto":
        chosen = registry.get(name)
        why = reasons(chosen, problem)
        if why:
            raise UnsupportedError(f"backend {name!r} cannot run {problem.describe()}: " + "; ".join(why))
        return chosen
    explanation = explain(problem)
    if explanation.chosen is None:
        raise UnsupportedError("no flashx backend can run this problem:\n" + str(explanation))
    return registry.get(explanation.chosen)
