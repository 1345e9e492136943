"""Backend discovery through pluggy and the ``flashx.backends`` entry points.

Discovery is lazy (first use) and happens once. Unlike pluggy's own
``load_setuptools_entrypoints``, every plugin is loaded and asked for its backends on
its own, so one that fails is recorded with its error and never hides the others.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass
from importlib.metadata import entry_points

from flashx.backend import Backend
from flashx.errors import UnsupportedError


@dataclass(frozen=True)
class BackendInfo:
    """What ``flashx.backends()`` reports for one backend or for a plugin that failed to load."""

    name: str
    version: str
    devices: tuple[str, ...]
    available: bool
    reason: str | None  # why it is not available
    plugin: str  # the entry point (or "<registered>") it came from
    load_error: str | None = None  # the traceback of a plugin that failed to load


class _Registry:
    def __init__(self):
        self._lock = threading.Lock()
        self._backends: dict[str, Backend] | None = None
        self._origins: dict[str, str] = {}
        self._failures: list[BackendInfo] = []
        self._version = 0  # counts changes, so that the calls cached in flashx.plan follow them

    def version(self) -> int:
        return self._version

    def backends(self) -> dict[str, Backend]:
        with self._lock:
            if self._backends is None:
                self._discover()
            return self._backends

    def reset(self) -> None:
        """Forget everything; the next use discovers the entry points again (for tests)."""
        with self._lock:
            self._backends, self._origins, self._failures = None, {}, []
            self._version += 1

    def _discover(self):
        import pluggy

        from flashx import hookspecs

        self._backends = {}
        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        for entry in entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            try:
                manager.register(entry.load(), name=entry.name)
            except Exception as error:  # noqa: BLE001 - a broken plugin is reported, not raised
                self._fail(entry.name, f"{entry.name} = {entry.value}", error)
        for impl in manager.hook.flashx_backends.get_hookimpls():
            try:
                for backend in impl.function():
                    self._add(backend, impl.plugin_name)
            except Exception as error:  # noqa: BLE001
                self._fail(impl.plugin_name, impl.plugin_name, error)

    def _fail(self, name, plugin, error):
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        self._failures.append(
            BackendInfo(
                name=name,
                version="?",
                devices=(),
                available=False,
                reason=f"plugin failed to load: {detail}",
                plugin=plugin,
                load_error="".join(traceback.format_exception(error)),
            )
        )

    def _add(self, backend, origin):
        if not isinstance(getattr(backend, "name", None), str) or not backend.name:
            raise TypeError(f"{backend!r} has no name")
        if backend.name in self._backends or backend.name == "auto":
            raise ValueError(f"backend name {backend.name!r} is taken (by {self._origins.get(backend.name, 'flashx')})")
        self._backends[backend.name] = backend
        self._origins[backend.name] = origin

    def register(self, backend: Backend, *, replace: bool = False) -> None:
        backends = self.backends()
        with self._lock:
            if replace:
                backends.pop(backend.name, None)
            self._add(backend, "<registered>")
            self._version += 1

    def unregister(self, name: str) -> None:
        self.backends()
        with self._lock:
            self._backends.pop(name, None)
            self._origins.pop(name, None)
            self._version += 1

    def get(self, name: str) -> Backend:
        backends = self.backends()
        if name in backends:
            return backends[name]
        failed = [f.name for f in self._failures]
        known = ", ".join(sorted(backends)) or "none"
        extra = f"; plugins that failed to load: {', '.join(failed)} (see flashx.backends())" if failed else ""
        raise UnsupportedError(f"backend: no backend named {name!r}; registered: {known}{extra}")

    def failures(self) -> list[BackendInfo]:
        """Plugins that failed to load, with their errors."""
        self.backends()
        return list(self._failures)

    def infos(self) -> list[BackendInfo]:
        rows = []
        for name, backend in sorted(self.backends().items()):
            reason = backend.available()
            rows.append(
                BackendInfo(
                    name=name,
                    version=str(backend.version),
                    devices=tuple(backend.device_names() if reason is None else sorted(backend.devices)),
                    available=reason is None,
                    reason=reason,
                    plugin=self._origins[name],
                )
            )
        return rows + self.failures()


_registry = _Registry()

backends = _registry.backends
get = _registry.get
register = _registry.register
unregister = _registry.unregister
infos = _registry.infos
failures = _registry.failures
reset = _registry.reset
version = _registry.version
