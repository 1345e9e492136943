"""Plugin discovery through pluggy and the entry points of ``flashx.hookspecs.ENTRY_POINT_GROUPS``.

Discovery is lazy (first use) and happens once, into one PluginManager. Every hook is called
through pluggy one plugin at a time (``_each_plugin``), so a plugin that fails to load, or whose
hook raises, is recorded with its error and never hides the others. Backends are collected on
first use; commands only when the ``flashx`` command asks for them.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from flashx.backend import Backend
from flashx.errors import UnsupportedError

if TYPE_CHECKING:
    from flashx.hookspecs import Command


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


@dataclass(frozen=True)
class CommandFailure:
    """A plugin whose ``flashx_commands`` raised, or one of its commands that flashx refused."""

    plugin: str
    load_error: str  # the traceback


class _Registry:
    def __init__(self):
        self._lock = threading.Lock()
        self._backends: dict[str, Backend] | None = None
        self._origins: dict[str, str] = {}
        self._failures: list[BackendInfo] = []
        self._manager = None  # the pluggy PluginManager, once discovered
        self._commands: dict[str, Command] | None = None
        self._command_origins: dict[str, str] = {}
        self._command_failures: list[CommandFailure] = []
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
            self._backends, self._origins, self._failures, self._manager = None, {}, [], None
            self._commands, self._command_origins, self._command_failures = None, {}, []
            self._version += 1

    def _discover(self):
        import pluggy

        from flashx import hookspecs

        self._backends = {}
        self._manager = pluggy.PluginManager(hookspecs.PROJECT)
        self._manager.add_hookspecs(hookspecs)
        for group in hookspecs.ENTRY_POINT_GROUPS:
            for entry in entry_points(group=group):
                try:
                    self._manager.register(entry.load(), name=entry.name)
                except Exception as error:  # noqa: BLE001 - a broken plugin is reported, not raised
                    self._fail(entry.name, f"{entry.name} = {entry.value}", error)
        for plugin, hook in self._each_plugin("flashx_backends"):
            try:
                (backends,) = hook()
                for backend in backends:
                    self._add(backend, plugin)
            except Exception as error:  # noqa: BLE001
                self._fail(plugin, plugin, error)

    def _each_plugin(self, name: str):
        """(plugin name, a caller of the hook ``name`` for that plugin alone), for every plugin
        implementing it.

        pluggy runs a hook's implementations in one loop that ends at the first one to raise, and
        a hookwrapper around the call sees only that exception: the results of the others would
        be lost. Called through a subset caller that leaves out every other plugin, a plugin that
        raises loses only its own results."""
        implementations = getattr(self._manager.hook, name).get_hookimpls()
        for implementation in implementations:
            others = [other.plugin for other in implementations if other is not implementation]
            yield implementation.plugin_name, self._manager.subset_hook_caller(name, remove_plugins=others)

    def _fail(self, name, plugin, error):
        self._failures.append(
            BackendInfo(
                name=name,
                version="?",
                devices=(),
                available=False,
                reason=f"plugin failed to load: {_one_line(error)}",
                plugin=plugin,
                load_error=_traceback(error),
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

    def commands(self) -> dict[str, Command]:
        """Every plugin's commands (``flashx_commands``) by name, collected on first use."""
        with self._lock:
            if self._backends is None:
                self._discover()
            if self._commands is None:
                self._commands = {}
                for plugin, hook in self._each_plugin("flashx_commands"):
                    try:
                        (commands,) = hook()
                        commands = list(commands)
                    except Exception as error:  # noqa: BLE001 - the other plugins' commands stay
                        self._command_failures.append(CommandFailure(plugin, _traceback(error)))
                        continue
                    for command in commands:
                        try:
                            self._add_command(command, plugin)
                        except (TypeError, ValueError) as error:  # refused: the plugin's other commands stay
                            self._command_failures.append(CommandFailure(plugin, _traceback(error)))
            return self._commands

    def _add_command(self, command, origin):
        from flashx.hookspecs import CORE_COMMANDS, Command

        if not isinstance(command, Command):
            raise TypeError(f"{command!r} is not a flashx.hookspecs.Command")
        taken = "flashx" if command.name in CORE_COMMANDS else self._command_origins.get(command.name)
        if taken:
            raise ValueError(f"command name {command.name!r} is taken (by {taken})")
        self._commands[command.name] = command
        self._command_origins[command.name] = origin

    def command_failures(self) -> list[CommandFailure]:
        """Plugins whose commands were left out, with their errors."""
        self.commands()
        return list(self._command_failures)

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


def _one_line(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _traceback(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


_registry = _Registry()

backends = _registry.backends
get = _registry.get
register = _registry.register
unregister = _registry.unregister
infos = _registry.infos
failures = _registry.failures
commands = _registry.commands
command_failures = _registry.command_failures
reset = _registry.reset
version = _registry.version
