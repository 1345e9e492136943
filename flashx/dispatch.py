"""Choosing a backend: explicit names never fall back; "auto" picks by declared priority.

"auto" considers a backend only through ``available()`` and ``supports()``: it never
retries another backend after a runtime error, and when nothing fits it raises one
``UnsupportedError`` that lists every backend with all of its reasons. A name no backend has,
given as ``backend=``, to ``use_backend`` or in ``FLASHX_BACKEND``, is an
``UnknownBackendError`` that says where the name came from and which registered name is closest.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import os
from dataclasses import dataclass

from flashx import registry
from flashx.backend import Backend
from flashx.errors import DTypeError, UnknownBackendError, UnsupportedError
from flashx.problem import Problem

ENV_VAR = "FLASHX_BACKEND"
_default_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("flashx_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, ``backend="auto"`` means ``name`` (as ``FLASHX_BACKEND`` does globally)."""
    if not isinstance(name, str):
        raise DTypeError(f"use_backend: expected a backend name, got {name!r}")
    if name != "auto":
        _check_known(name, f"use_backend({name!r})")
    token = _default_backend.set(name)
    try:
        yield
    finally:
        _default_backend.reset(token)


def requested(backend: str) -> str:
    """The name a call asks for once the context manager and the environment are applied."""
    return _request(backend)[0]


def _request(backend: str) -> tuple[str, str]:
    """(name, where it was asked for): the argument, ``use_backend`` or the environment, as messages quote it."""
    if not isinstance(backend, str):
        raise DTypeError(f"backend: expected a backend name or 'auto', got {backend!r}")
    if backend != "auto":
        return backend, f"backend={backend!r}"
    in_context = _default_backend.get()
    if in_context is not None:
        return in_context, f"use_backend({in_context!r})"
    in_environment = os.environ.get(ENV_VAR)
    if in_environment:
        return in_environment, f"{ENV_VAR}={in_environment}"
    return "auto", "auto"


def _check_known(name: str, origin: str) -> None:
    """Raise ``UnknownBackendError`` unless a backend, or a plugin that failed to load, has this name."""
    registered = sorted(registry.backends())
    failed = [info.name for info in registry.failures()]
    if name in registered or name in failed:
        return
    message = f"{origin}: no backend named {name!r}; registered: {', '.join(registered) or 'none'}"
    if failed:
        message += f"; plugins that failed to load: {', '.join(failed)} (see flashx.backends())"
    closest = difflib.get_close_matches(name, registered + failed, n=1)
    if closest:
        message += f"; did you mean {closest[0]!r}?"
    raise UnknownBackendError(message)


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
    """For every backend: could it run this problem, and if not, why.

    ``chosen`` is the backend the call would run. When a backend was requested (``requested``, by
    ``requested_by``: ``backend=``, ``use_backend`` or ``FLASHX_BACKEND``), that one, or None when it
    cannot run the problem (its row says why); otherwise auto's pick, None when nothing fits.
    """

    problem: Problem
    rows: tuple[Row, ...]
    chosen: str | None
    requested: str | None = None
    requested_by: str | None = None

    def __str__(self) -> str:
        lines = [self.problem.describe()]
        width = max((len(row.name) for row in self.rows), default=0)
        for row in self.rows:
            status = "no: " + "; ".join(row.reasons) if row.reasons else f"yes (priority {row.priority})"
            if row.name == self.requested:
                status += f"  <- requested by {self.requested_by}"
            elif row.name == self.chosen:
                status += "  <- auto"
            lines.append(f"  {row.name:<{width}}  {status}")
        return "\n".join(lines)


def explain(problem: Problem, backend: str = "auto") -> Explanation:
    """Every backend's answer for ``problem``, and the one a call with this ``backend`` would run."""
    name, origin = _request(backend)
    if name != "auto":
        _check_known(name, origin)
    rows = _rows(problem)
    if name == "auto":
        return Explanation(problem, rows, _auto_pick(rows))
    runs = any(row.name == name and row.priority is not None for row in rows)
    return Explanation(problem, rows, name if runs else None, name, origin)


def choose(problem: Problem, backend: str = "auto") -> Backend:
    name, origin = _request(backend)
    if name == "auto":
        rows = _rows(problem)
        chosen = _auto_pick(rows)
        if chosen is None:
            raise UnsupportedError("no flashx backend can run this problem:\n" + str(Explanation(problem, rows, None)))
        return registry.get(chosen)
    _check_known(name, origin)
    backends = registry.backends()
    if name not in backends:  # known, so the name of a plugin that failed to load
        reason = next(info.reason for info in registry.failures() if info.name == name)
        raise UnsupportedError(f"backend {name!r} cannot run here: {reason} (see flashx.backends())")
    impl = backends[name]
    why = reasons(impl, problem)
    if why:
        raise UnsupportedError(f"backend {name!r} cannot run {problem.describe()}: " + "; ".join(why))
    return impl


def _rows(problem: Problem) -> tuple[Row, ...]:
    rows = []
    for name, backend in sorted(registry.backends().items()):
        why = reasons(backend, problem)
        rows.append(Row(name, None if why else int(backend.priority(problem)), tuple(why)))
    rows += [Row(info.name, None, (info.reason,)) for info in registry.failures()]
    return tuple(rows)


def _auto_pick(rows: tuple[Row, ...]) -> str | None:
    runnable = [row for row in rows if row.priority is not None]
    return max(runnable, key=lambda row: row.priority).name if runnable else None
