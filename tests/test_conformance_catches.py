"""The conformance suite catches what it names.

Each toy in ``toys`` breaks plain attention in one way. The suite, run against it as a
backend author runs it (``--pyargs flashx_conformance --flashx-backend NAME -k CASE``),
must fail the case meant for that flaw, and pass the same selection for the flawless toy:
the control shows that the failure is the flaw's, not the harness's.
"""

from __future__ import annotations

import pytest
import toys

import flashx

# The case meant to catch each flaw, narrowed to a few cheap parametrizations of it.
CAUGHT_BY = {
    toys.UnmaskedTail: "test_exactness and Nq17-Nk17 and float32",
    toys.TopLeftCausal: "test_causal and 5-2",
    toys.NanEmptyRows: "test_empty_rows and (all-masked or zero-seqlens)",
    toys.GqaFirstHeadOnly: "test_gqa and Hq4-Hk2 and float32",
    toys.Base2Lse: "test_lse_is_natural_logsumexp",
    toys.UnscaledDropout: "test_dropout_matches_oracle and padded-p0.5",
}


class Outcomes:
    """A pytest plugin keeping {test id: "passed" | "failed" | "skipped"} of a run."""

    def __init__(self):
        self.by_test = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.by_test[report.nodeid.rpartition("::")[2]] = report.outcome


def run_conformance(toy, selection, directory, *options) -> dict[str, str]:
    """The suite's cases ``-k selection`` run on ``toy``, in this process (pytester's fresh
    imports per run would import torch twice, which its C extension does not survive)."""
    outcomes = Outcomes()
    flashx.registry.register(toy, replace=True)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(directory)  # away from this repository's pytest configuration
            # the full tier explicitly: other test modules may set TRITON_INTERPRET, which defaults it to small
            args = ["--pyargs", "flashx_conformance", "--flashx-backend", toy.name, "--flashx-tier", "full", "-k", selection]
            pytest.main([*args, *options, "-q", "-p", "no:cacheprovider"], plugins=[outcomes])
    finally:
        flashx.registry.unregister(toy.name)
    return outcomes.by_test


@pytest.mark.parametrize("flawed, selection", list(CAUGHT_BY.items()), ids=[toy.name for toy in CAUGHT_BY])
def test_case_fails_the_flaw_and_passes_the_control(flawed, selection, tmp_path):
    case = selection.split()[0]
    control = run_conformance(toys.Correct(), selection, tmp_path)
    assert any(test.partition("[")[0] == case for test in control), f"-k {selection!r} selected no {case}: {control}"
    assert set(control.values()) == {"passed"}, f"the flawless toy does not pass {case}: {control}"
    caught = run_conformance(flawed(), selection, tmp_path)
    assert caught.keys() == control.keys() and "failed" in caught.values(), f"{case} does not catch {flawed.name}: {caught}"


# The properties are told nothing about where these flaws hide (Nq != Nk under causal, a
# GQA group); a fixed hypothesis seed makes their search the same on every run.
PROPERTY = "test_masks_and_shapes_match_oracle"
SEEDED = ("--hypothesis-seed", "0")


@pytest.fixture(scope="module")
def property_on_control(tmp_path_factory):
    return run_conformance(toys.Correct(), PROPERTY, tmp_path_factory.mktemp("control"), *SEEDED)


@pytest.mark.parametrize("flawed", [toys.TopLeftCausal, toys.GqaFirstHeadOnly], ids=lambda toy: toy.name)
def test_properties_find_the_flaw_unaided(flawed, property_on_control, tmp_path):
    assert property_on_control == {PROPERTY: "passed"}
    assert run_conformance(flawed(), PROPERTY, tmp_path, *SEEDED) == {PROPERTY: "failed"}
