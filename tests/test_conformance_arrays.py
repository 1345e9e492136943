"""``--flashx-arrays``: the suite calls a backend with another kind of array than its own, which the
core converts both ways; the outputs must come back as the caller's kind."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")


def _suite(tmp_path, *options):
    command = [sys.executable, "-m", "pytest", "--pyargs", "flashx_conformance", "--flashx-backend", "numpy",
               "-p", "no:cacheprovider", "-q", *options]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr


def test_numpy_backend_graded_through_torch_tensors(tmp_path):
    report = tmp_path / "report.json"
    code, output = _suite(tmp_path, "--flashx-arrays", "torch", "--flashx-report", str(report),
                          "-k", "test_masking and causal and not bfloat16")
    assert code == 0, output
    results = json.loads(report.read_text())
    assert results["arrays"] == "torch"
    assert results["results"] and {r["outcome"] for r in results["results"]} == {"passed"}


def test_report_is_written_by_the_xdist_controller_alone(tmp_path):
    """A worker's unconfigure ran after the controller's on an interrupted run and left the
    report with that worker's 86 of 497 cases."""
    from flashx_conformance import plugin

    path = tmp_path / "report.json"
    options = {"flashx_backend": "numpy", "flashx_arrays": None, "flashx_tier": "full", "flashx_device": "cpu",
               "flashx_report": str(path)}
    worker = SimpleNamespace(getoption=options.get, workerinput={"workerid": "gw0"})
    run = plugin._Run(worker)
    run.results.append({"nodeid": "x", "case": "x", "outcome": "passed", "reason": None, "duration": 0.0})
    run.pytest_unconfigure()
    assert not path.exists()
    run.config = SimpleNamespace(getoption=options.get)  # the controller, or a run without xdist
    run.pytest_unconfigure()
    assert len(json.loads(path.read_text())["results"]) == 1


def test_arrays_on_a_device_they_cannot_live_on_are_refused(tmp_path):
    code, output = _suite(tmp_path, "--flashx-arrays", "cupy", "--flashx-device", "cpu")
    assert code == 4, output  # pytest's usage error: nothing collected or run
    assert "--flashx-arrays cupy: cupy arrays live on cuda, not on cpu" in output


def test_summary_keeps_a_column_per_kind_of_arrays(tmp_path):
    from flashx_conformance import summary

    def report(name, label, outcome):
        header = {"backend": "cupy", "version": "1", "device": "cuda", "tier": "full"}
        results = [{"case": "test_causal[x]", "outcome": outcome, "reason": None, "duration": 1.0}]
        path = tmp_path / name
        path.write_text(json.dumps({**header, **({"label": label} if label else {}), "results": results}))
        return path

    paths = [report("own.json", None, "passed"), report("cupy.json", "cupy (cupy arrays)", "failed"),
             report("slow.json", None, "passed")]
    merged = summary.merge(summary.load(paths))
    assert list(merged["backends"]) == ["cupy", "cupy (cupy arrays)"]
    assert merged["cases"]["test_causal[x]"] == {"cupy": {"outcome": "passed", "reason": None},
                                                  "cupy (cupy arrays)": {"outcome": "failed", "reason": None}}
    assert merged["backends"]["cupy"]["counts"] == {"passed": 2}
