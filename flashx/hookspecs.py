"""The pluggy hook a backend plugin implements (the contract's Backend plugins section, docs/contract.md)."""

from __future__ import annotations

import pluggy

PROJECT = "flashx"
ENTRY_POINT_GROUP = "flashx.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def flashx_backends():
    """Return a list of backend objects this plugin provides.

    Keep it cheap: do not import GPU libraries here; import them inside the
    backend's ``available()`` / ``forward()`` so that discovery stays fast and a
    missing library shows up as a reason, not as a crash.
    """
