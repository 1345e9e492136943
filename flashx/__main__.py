"""``python -m flashx``: the ``flashx`` command, for environments whose scripts are not on PATH."""

from flashx.cli import main

raise SystemExit(main())
