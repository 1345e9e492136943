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

# The conformance case meant to catch each flaw.
CAUGHT_BY = {
    toys.UnmaskedTail: "test_exactness",
    toys.TopLeftCausal: "test_causal",
    toys.NanEmptyRows: "test_empty_rows",
    toys.GqaFirstHeadOnly: "test_gqa",
    toys.Base2Lse: "test_lse_is_natural_logsumexp",
    toys.UnscaledDropout: "test_dropout_matches_oracle",
    toys.LossyBackwardLse: "test_negative_scale_wide_scores",
}


class Outcomes:
    """A pytest plugin keeping {test id: "passed" | "failed" | "skipped"} of a run."""

    def __init__(self):
        self.by_test = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.by_test[report.nodeid.rpartition("::")[2]] = report.outcome


def run_conformance(toy, case, directory, *options) -> dict[str, str]:
    """The suite's ``case`` (its small tier: a few parametrizations) run on ``toy``, in this
    process (pytester's fresh imports per run would import torch twice, which its C
    extension does not survive)."""
    outcomes = Outcomes()
    flashx.registry.register(toy, replace=True)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(directory)  # away from this repository's pytest configuration
            args = ["--pyargs", "flashx_conformance", "--flashx-backend", toy.name, "--flashx-tier", "small", "-k", case]
            pytest.main([*args, *options, "-q", "-p", "no:cacheprovider"], plugins=[outcomes])
    finally:
        flashx.registry.unregister(toy.name)
    return outcomes.by_test


@pytest.mark.parametrize("flawed, case", list(CAUGHT_BY.items()), ids=[toy.name for toy in CAUGHT_BY])
def test_case_fails_the_flaw_and_passes_the_control(flawed, case, tmp_path):
    control = run_conformance(toys.Correct(), case, tmp_path)
    assert "passed" in control.values(), f"{case} ran nothing on the control: {control}"
    assert set(control.values()) <= {"passed", "skipped"}, f"the flawless toy does not pass {case}: {control}"
    caught = run_conformance(flawed(), case, tmp_path, "-x")
    assert "failed" in caught.values(), f"{case} does not catch {flawed.name}: {caught}"


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


def test_a_backward_from_the_float32_lse_passes_wide_scores(tmp_path):
    """Scores hundreds apart round the float32 lse by a relative error of P past 1e-5: the
    contract's own storage, which the bound must allow."""
    outcomes = run_conformance(toys.StoredLse(), "test_negative_scale_wide_scores", tmp_path)
    assert "passed" in outcomes.values() and set(outcomes.values()) <= {"passed", "skipped"}, outcomes
