"""The pytest plugin of the conformance suite (entry point ``pytest11``: loaded by every pytest run).

Nothing here imports flashx, NumPy or a GPU library until a backend is named with
``--flashx-backend NAME`` (or ``FLASHX_CONFORMANCE_BACKEND``). Without one only the options,
the markers and two fixtures exist, and the conformance tests skip, saying how to name one;
with one, a ``_Run`` plugin adds the report header, the tier skips, the skip summary and
the JSON report.

    pytest --pyargs flashx_conformance --flashx-backend numpy [--flashx-device cuda]
           [--flashx-tier small|full] [--flashx-arrays numpy|torch|cupy] [--flashx-report results.json]
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import time
import zlib
from collections import Counter

import pytest

ENV_VAR = "FLASHX_CONFORMANCE_BACKEND"
#: Set by the CPU stand-ins of GPU backends; their kernels run thousands of times slower.
SIMULATORS = ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")
#: NumPy's floating-point warnings (0 * inf, x / 0) from the code that runs GPU kernels on the CPU
#: under each stand-in: a GPU computes those masked-out lanes silently in IEEE arithmetic, so the
#: warnings say nothing about the backend. Each is filtered only while its stand-in is on.
SIMULATOR_WARNINGS = {
    "TRITON_INTERPRET": r"ignore::RuntimeWarning:triton\.runtime\.interpreter",
    "NUMBA_ENABLE_CUDASIM": r"ignore::RuntimeWarning:flashx_numba\.",
}
FULL_ONLY = "flashx_full"
#: Libraries named in the report header, with the distributions that provide them (read, not imported).
LIBRARIES = {
    "numpy": ("numpy",),
    "torch": ("torch",),
    "triton": ("triton",),
    "cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy"),
    "numba": ("numba-cuda", "numba"),
}


#: The devices each kind of array the suite can pass lives on.
ARRAY_DEVICES = {"numpy": ("cpu",), "torch": ("cpu", "cuda"), "cupy": ("cuda",)}

#: What the suite imports besides flashx (the oracle's naive baselines run in torch).
REQUIREMENTS = ("numpy", "torch", "hypothesis")


def pytest_addoption(parser):
    group = parser.getgroup("flashx", "flashx conformance suite")
    group.addoption(
        "--flashx-backend",
        default=os.environ.get(ENV_VAR),
        metavar="NAME",
        help=f"the flashx backend to test (default: ${ENV_VAR}); without one the suite skips",
    )
    group.addoption(
        "--flashx-device",
        default=None,
        metavar="DEVICE",
        help='"cpu", "cuda" or "cuda:N" (default: cuda when the backend runs there and a GPU is present, else cpu)',
    )
    group.addoption(
        "--flashx-tier",
        choices=("small", "full"),
        default=None,
        help=f"case sizes (default: small when {' or '.join(SIMULATORS)} is set, else full)",
    )
    group.addoption(
        "--flashx-arrays",
        choices=tuple(ARRAY_DEVICES),
        default=None,
        help="the kind of arrays the suite passes, which the core converts for the backend (default: the "
        "backend's own array_kind; torch wherever the kind lacks the case's dtype, as bfloat16 in NumPy and CuPy)",
    )
    group.addoption("--flashx-report", default=None, metavar="PATH", help="write every case's outcome as JSON to PATH")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long or memory-hungry GPU cases (deselect with -m 'not slow')")
    config.addinivalue_line("markers", f"{FULL_ONLY}: a case too big for the small tier (interpreters, simulators)")
    for variable, warning_filter in SIMULATOR_WARNINGS.items():
        if os.environ.get(variable, "0") not in ("", "0"):
            config.addinivalue_line("filterwarnings", warning_filter)
    if config.getoption("flashx_backend"):
        missing = [name for name in REQUIREMENTS if importlib.util.find_spec(name) is None]
        if missing:
            raise pytest.UsageError(
                f"the flashx conformance suite needs {', '.join(missing)}: pip install 'flashx-attention[conformance]'"
            )
        run = _Run(config)
        if run.arrays and run.device.partition(":")[0] not in ARRAY_DEVICES[run.arrays]:
            raise pytest.UsageError(f"--flashx-arrays {run.arrays}: {run.arrays} arrays live on "
                                    f"{' or '.join(ARRAY_DEVICES[run.arrays])}, not on {run.device}")
        config.stash[_RUN] = run
        config.pluginmanager.register(run, "flashx_conformance_run")


@pytest.fixture
def flashx_target(request):
    """The backend under test (``harness.Target``, built once per run); skips when none is named
    or it cannot run here."""
    run = request.config.stash.get(_RUN, None)
    if run is None:
        pytest.skip(f"no flashx backend named: pass --flashx-backend NAME or set {ENV_VAR}")
    return run.target()


@pytest.fixture
def flashx_rng(request):
    """A NumPy generator seeded from the test's id: every case draws the same inputs on every run."""
    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


class _Run:
    """The named backend, its device and tier, and the outcomes recorded for the report."""

    def __init__(self, config):
        self.config = config
        self.name = config.getoption("flashx_backend")
        self.arrays = config.getoption("flashx_arrays")
        simulated = [var for var in SIMULATORS if os.environ.get(var, "0") not in ("", "0")]
        self.tier = config.getoption("flashx_tier") or ("small" if simulated else "full")
        self.simulators = simulated
        self.results: list[dict] = []
        self._target = None
        self._skip_reason = None
        self._device = None

    @property
    def device(self) -> str:
        if self._device is None:
            chosen = self.config.getoption("flashx_device")
            if chosen is None:
                from flashx.devices import cuda_present

                chosen = "cuda" if self._backend_runs_on_cuda() and cuda_present() else "cpu"
            self._device = chosen
        return self._device

    def _backend_runs_on_cuda(self) -> bool:
        import flashx

        try:
            return "cuda" in flashx.registry.get(self.name).devices
        except flashx.UnsupportedError:
            return False

    def _declared_arrays(self) -> str:
        import flashx

        try:
            return flashx.registry.get(self.name).array_kind
        except flashx.UnsupportedError:
            return "?"

    def target(self):
        if self._target is None and self._skip_reason is None:
            import flashx
            from flashx_conformance.harness import Target

            failed = {info.name: info.reason for info in flashx.registry.failures()}
            # a plugin that failed to load is reported like an unavailable backend; an unknown name is an error
            unavailable = failed.get(self.name) or flashx.registry.get(self.name).available()
            if unavailable:
                self._skip_reason = f"backend {self.name!r} is not available here: {unavailable}"
            else:
                self._target = Target(self.name, self.device, self.tier, self.arrays)
        if self._skip_reason:
            pytest.skip(self._skip_reason)
        return self._target

    def describe(self) -> dict:
        import flashx

        info = next((i for i in flashx.backends() if i.name == self.name), None)
        versions = {"python": platform.python_version(), "flashx": flashx.__version__}
        for library, distributions in LIBRARIES.items():
            found = [_version(d) for d in distributions if _version(d)]
            if found:
                versions[library] = found[0]
        return {
            "backend": self.name,
            # the summary's column: one per backend and kind of arrays named
            "label": f"{self.name} ({self.arrays} arrays)" if self.arrays else self.name,
            "version": info.version if info else "?",
            "available": info.reason is None if info else False,
            "reason": info.reason if info else "not registered",
            "device": self.device + (f" ({_device_name(self.device)})" if self.device.startswith("cuda") else ""),
            "tier": self.tier,
            "arrays": self.arrays or self._declared_arrays(),
            "simulators": self.simulators,
            "versions": versions,
        }

    # -- hooks: registered as a plugin only when a backend is named ---------------------------
    def pytest_report_header(self) -> list[str]:
        d = self.describe()
        status = "available" if d["available"] else f"NOT available: {d['reason']}"
        simulated = f" under {', '.join(f'{v}=1' for v in d['simulators'])}" if d["simulators"] else ""
        return [
            f"flashx conformance: backend {d['backend']} {d['version']} ({status}) on {d['device']}{simulated}, "
            f"tier {d['tier']}, {d['arrays']} arrays",
            "flashx conformance: " + ", ".join(f"{k} {v}" for k, v in d["versions"].items()),
        ]

    def pytest_runtest_setup(self, item):
        if item.get_closest_marker(FULL_ONLY) and self.tier != "full":
            pytest.skip("full tier only (--flashx-tier full): too big for the small tier of interpreters and simulators")

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            reason = None
            if report.skipped:
                reason = report.longrepr[2].removeprefix("Skipped: ") if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.results.append(
                {
                    "nodeid": report.nodeid,
                    "case": report.nodeid.rpartition("/")[2],
                    "outcome": "xfailed" if hasattr(report, "wasxfail") else report.outcome,
                    "reason": reason,
                    "duration": round(report.duration, 4),
                }
            )

    def pytest_terminal_summary(self, terminalreporter):
        """Skips are never silent: every distinct reason with its count."""
        if not self.results:
            return
        counts = Counter(result["outcome"] for result in self.results)
        skipped = Counter(result["reason"] for result in self.results if result["outcome"] == "skipped")
        terminal = terminalreporter
        terminal.section(f"flashx conformance: {self.name} on {self.device}, tier {self.tier}")
        terminal.line(", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no cases ran")
        for reason, n in skipped.most_common():
            terminal.line(f"  skipped {n:4d} x  {reason}")

    def pytest_unconfigure(self):
        path = self.config.getoption("flashx_report")
        # A pytest-xdist worker holds only its share of the cases; every outcome also reaches the
        # controller (its logreport hook), which writes the whole report.
        if not path or hasattr(self.config, "workerinput"):
            return
        report = {**self.describe(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": self.results}
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


_RUN = pytest.StashKey[_Run]()


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _device_name(device: str) -> str:
    try:
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    except Exception as error:  # noqa: BLE001 - only a label
        return f"unknown: {type(error).__name__}"
