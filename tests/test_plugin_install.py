"""Plugin installation end to end, as a user would do it.

A throwaway venv that sees this environment's packages (torch, the editable flashx) gets,
through pip, the out-of-tree example ``examples/flashx-sdpa``, a plugin whose module raises
on import, and a plugin that adds a command to ``flashx``. flashx must find the first and the
last through their entry points alone, report the second with its error without losing any
other backend or command, and the conformance suite must grade SDPA.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flashx-sdpa"

BROKEN_PLUGIN = {
    "pyproject.toml": """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "flashx-broken"
version = "0.0.1"

[project.entry-points."flashx.backends"]
broken = "flashx_broken"

[tool.setuptools]
packages = ["flashx_broken"]
""",
    "flashx_broken/__init__.py": 'raise RuntimeError("flashx_broken: this accelerator has no driver")\n',
}

COMMAND_PLUGIN = {
    "pyproject.toml": """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "flashx-hello"
version = "0.0.1"

[project.entry-points."flashx.plugins"]
hello = "flashx_hello"

[tool.setuptools]
packages = ["flashx_hello"]
""",
    "flashx_hello/__init__.py": """\
from flashx.hookspecs import Command, hookimpl


def hello(args):
    print(f"hello from a plugin, {args.name}")
    return 0


@hookimpl
def flashx_commands():
    return [Command("hello", "say hello", run=hello, add_arguments=lambda parser: parser.add_argument("name"))]
""",
}

LIST_BACKENDS = "import dataclasses, json, flashx; print(json.dumps([dataclasses.asdict(i) for i in flashx.backends()]))"


def run(python, *args, cwd, timeout=120):
    result = subprocess.run([str(python), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory):
    """The venv's python, with flashx-sdpa, flashx-broken and flashx-hello installed (offline, no build isolation)."""
    root = tmp_path_factory.mktemp("plugin-install")
    try:
        venv.create(root / "venv", with_pip=False)
    except OSError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"cannot create a venv here: {error}")
    python = root / "venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # The new venv sees this environment's site-packages, .pth files included (an editable
    # install is one): `system_site_packages` would show the base interpreter's instead, which
    # lacks what a virtual environment running these tests installed.
    inner = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root).strip()
    outer = [path for path in site.getsitepackages() if Path(path).is_dir()]
    lines = "".join(f"import site; site.addsitedir({path!r})\n" for path in outer)
    Path(inner, "outer-environment.pth").write_text(lines)
    # Copies: setuptools builds in the source tree and would leave build/ and egg-info behind.
    sdpa = shutil.copytree(EXAMPLE, root / "flashx-sdpa")
    for folder, files in (("flashx-broken", BROKEN_PLUGIN), ("flashx-hello", COMMAND_PLUGIN)):
        for relative, text in files.items():
            (root / folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / folder / relative).write_text(text)
    pip = ["-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--disable-pip-version-check", "-q"]
    run(python, *pip, sdpa, root / "flashx-broken", root / "flashx-hello", cwd=root)
    return python


@pytest.fixture(scope="module")
def listings(plugin_venv):
    """flashx.backends() as rows keyed by name, from this interpreter and from the venv."""
    cwd = plugin_venv.parents[2]

    def listing(python):
        return {row["name"]: row for row in json.loads(run(python, "-c", LIST_BACKENDS, cwd=cwd))}

    here = listing(sys.executable)
    here.pop("sdpa", None)  # a developer may have installed the example here too
    return here, listing(plugin_venv)


def test_installed_plugin_is_found_through_its_entry_point(listings):
    sdpa = listings[1]["sdpa"]
    assert sdpa["plugin"] == "sdpa"  # the entry point's name, not an in-process registration
    assert sdpa["available"] and sdpa["load_error"] is None
    assert sdpa["version"] == metadata.version("torch")


def test_plugin_failing_on_import_is_reported_and_hides_nothing(listings):
    here, there = listings
    broken = there.pop("broken")
    assert not broken["available"]
    assert "this accelerator has no driver" in broken["reason"]
    assert "RuntimeError" in broken["load_error"] and "flashx_broken" in broken["load_error"]
    there.pop("sdpa")
    assert there == here


def test_installed_plugin_adds_a_command_beside_a_broken_plugin(plugin_venv):
    cwd = plugin_venv.parents[2]
    assert run(plugin_venv, "-m", "flashx", "hello", "world", cwd=cwd) == "hello from a plugin, world\n"
    assert "    hello               say hello\n" in run(plugin_venv, "-m", "flashx", cwd=cwd)
    info = run(plugin_venv, "-m", "flashx", "info", cwd=cwd)
    assert "\nplugin broken = flashx_broken failed to load:\n" in info and "this accelerator has no driver" in info


# What the SDPA peer fails, and why (docs/sdpa-conformance.md tells users the same).
SDPA_FAILS = {
    "test_dropout_matches_oracle": "torch draws dropout from its own generator, not the contract's Philox mask",
    "test_padding_poison": "NaN or inf in a masked key's v reaches o as 0 * NaN (pytorch#101967)",
    "test_nan_propagation": "its backward spreads one NaN to keys the poisoned row never reads",
}
# Those, and cases it passes, in the suite's small tier; the full grading is the doc's.
GRADED = [
    *SDPA_FAILS,
    "test_causal",
    "test_gqa",
    "test_bool_mask",
    "test_block_mask",
    "test_seqlens",
    "test_empty_rows",
    "test_scale",
    "test_lse_is_natural_logsumexp",
    "test_varlen",
]


def test_conformance_suite_grades_sdpa(plugin_venv, tmp_path):
    report = tmp_path / "sdpa.json"
    args = ["--pyargs", "flashx_conformance", "--flashx-backend", "sdpa", "--flashx-tier", "small", "--flashx-report", report]
    args += ["-k", " or ".join(GRADED)]
    result = subprocess.run(
        [plugin_venv, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 1: some case failed, as expected
    graded = json.loads(report.read_text())
    assert graded["backend"] == "sdpa" and graded["available"] and graded["version"] == metadata.version("torch")
    outcomes = {}
    for case in graded["results"]:
        function = case["nodeid"].rpartition("::")[2].partition("[")[0]
        if function in GRADED:  # -k matches substrings: test_varlen also selects the oracle's test_varlen_is_...
            outcomes.setdefault(function, set()).add(case["outcome"])
    assert outcomes.keys() == set(GRADED), f"no parametrization ran of {set(GRADED) - outcomes.keys()}"
    failing = {function for function, seen in outcomes.items() if "failed" in seen}
    assert failing == set(SDPA_FAILS), f"expected to fail only {SDPA_FAILS}\n{result.stdout}"
    assert outcomes.pop("test_varlen") == {"skipped"}  # SDPA has no cu_seqlens; the adapter does not claim it
    passing = {function: seen for function, seen in outcomes.items() if function not in SDPA_FAILS}
    assert all("passed" in seen and seen <= {"passed", "skipped"} for seen in passing.values()), passing  # skipped: full tier
