"""The conformance suite names what it lacks in one line, before any case runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_missing_requirement_is_one_line_not_failed_cases(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        import pytest
        import flashx_conformance.plugin as plugin

        plugin.REQUIREMENTS += ("flashx_no_such_module",)
        sys.exit(pytest.main(["--pyargs", "flashx_conformance", "--flashx-backend", "numpy", "-q", "-p", "no:cacheprovider"]))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 4, output  # pytest's usage error: nothing was collected or run
    assert "needs flashx_no_such_module: pip install 'flashx-attention[conformance]'" in output
    assert "passed" not in output and "failed" not in output
