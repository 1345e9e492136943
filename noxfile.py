"""Sessions run in the current environment and install nothing (CI installs flashx-attention[dev] first).

    nox -s tests          the unit tests of the core, the plugins machinery and the backends
    nox -s conformance    the conformance suite once per registered backend, then the summary

Without a GPU the GPU backends run on their CPU stand-ins (Triton's interpreter, Numba's CUDA
simulator) at the small tier; a backend that cannot run here at all is reported as skipped
with its reason. The run ends with a few lines per backend (counts, failed cases by name); the
case x backend table is written to .nox/conformance/summary.{md,json}.
"""

from __future__ import annotations

import json
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["tests", "conformance"]

REPORTS = Path(".nox") / "conformance"
#: The CPU stand-in of each GPU backend, used when there is no GPU.
SIMULATORS = {"triton": {"TRITON_INTERPRET": "1"}, "numba": {"NUMBA_ENABLE_CUDASIM": "1"}}


def _backend_names() -> list[str]:
    import flashx

    return [info.name for info in flashx.backends()]


@nox.session(python=False)
def tests(session):
    # The Triton interpreter is chosen when triton is first imported: its tests get a process of their own.
    session.run("pytest", "tests", "--ignore-glob=tests/test_triton_*.py", *session.posargs)
    triton_tests = sorted(str(path) for path in Path("tests").glob("test_triton_*.py"))
    session.run("pytest", *triton_tests, *session.posargs, env={"TRITON_INTERPRET": "1"})


@nox.session(python=False)
@nox.parametrize("backend", _backend_names())
def conformance(session, backend):
    from flashx.devices import cuda_present

    env = {} if cuda_present() else SIMULATORS.get(backend, {})
    report = REPORTS / f"{backend}.json"
    report.unlink(missing_ok=True)
    command = ["pytest", "--pyargs", "flashx_conformance", "--flashx-backend", backend, "--flashx-report", str(report)]
    # exit code 1 (failed cases) still writes the report: the summary must show the failures
    session.run(*command, "-p", "no:cacheprovider", *session.posargs, env=env, success_codes=[0, 1])
    session.notify("conformance_summary")
    failed = [r["case"] for r in json.loads(report.read_text())["results"] if r["outcome"] == "failed"]
    if failed:
        session.error(f"{len(failed)} conformance cases failed on {backend}: {', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''}")


@nox.session(python=False)
def conformance_summary(session):
    reports = sorted(str(path) for path in REPORTS.glob("*.json") if path.stem != "summary")
    if not reports:
        session.error(f"no reports under {REPORTS}: run `nox -s conformance` first")
    summary = REPORTS / "summary"
    session.run("python", "-m", "flashx_conformance.summary", *reports, "--markdown", f"{summary}.md", "--json", f"{summary}.json", success_codes=[0, 1])
