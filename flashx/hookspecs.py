"""The pluggy hooks a plugin implements: backends (the contract's Backend plugins section,
docs/contract.md) and subcommands of the ``flashx`` command.

A plugin is a module named by an entry point of the group ``flashx.backends`` (a plugin that
provides backends, as every backend of this project does) or ``flashx.plugins`` (one that adds
something else, such as ``flashx_bench``'s command). Both groups feed one pluggy PluginManager
(``flashx.registry``), so a plugin of either group may implement either hook.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import pluggy

PROJECT = "flashx"
ENTRY_POINT_GROUPS = ("flashx.backends", "flashx.plugins")
#: The names of the core's own commands (flashx.cli), which no plugin may take.
CORE_COMMANDS = frozenset({"info", "demo"})

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class Command:
    """One subcommand, ``flashx NAME ...``; ``run`` returns the exit status.

    With ``own_arguments`` False, flashx builds the command's parser: ``add_arguments(parser)``
    adds its options to an ``argparse`` subparser (its description, too, if it sets one) and
    ``run(args)`` receives the parsed ``argparse.Namespace``. With ``own_arguments`` True, the
    command is a command line of its own: ``run(argv)`` receives the words after NAME unparsed,
    ``--help`` included.
    """

    name: str
    help: str  # one line, listed by `flashx --help`
    run: Callable[[argparse.Namespace | list[str]], int]
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    own_arguments: bool = False


@hookspec
def flashx_backends():
    """Return a list of backend objects this plugin provides.

    Keep it cheap: do not import GPU libraries here; import them inside the
    backend's ``available()`` / ``forward()`` so that discovery stays fast and a
    missing library shows up as a reason, not as a crash.
    """


@hookspec
def flashx_commands():
    """Return a list of ``Command``: the subcommands this plugin adds to ``flashx``
    (``flashx tune`` is the Triton backend's, ``flashx bench`` is flashx_bench's).

    Called whenever the ``flashx`` command starts, ``flashx --version`` included: build the
    ``Command`` objects without importing what they run, which ``run`` imports. A name already
    taken (``CORE_COMMANDS``, or another plugin's command) is refused; a refused command, or a
    hook that raises, is reported by ``flashx info`` and leaves every other command in place.
    """
