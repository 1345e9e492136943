"""The log-sum-exp of the contract: natural log ("Scores and masking"), merged over key splits ("Merging partial results")."""

from __future__ import annotations

import numpy as np
import pytest

import flashx
from flashx_conformance import oracle
from flashx_conformance.harness import Case, make_case, merged_failures


def test_lse_is_natural_logsumexp(flashx_target, flashx_rng):
    """lse[b, h, i] = ln sum_j exp(S[b, h, i, j]), computed here from the scores directly."""
    case = make_case(flashx_rng, batch=2, heads_q=2, seqlen_q=31, seqlen_k=47, head_dim=32, dtype=flashx_target.dtype)
    got = flashx_target.check(case)
    rounded = case.rounded()
    scores = np.einsum("bihd,bjhd->bhij", rounded["q"], rounded["k"]) / np.sqrt(32)
    direct = np.logaddexp.reduce(scores, axis=-1)
    assert np.allclose(oracle.forward(rounded["q"], rounded["k"], rounded["v"])[1], direct, rtol=0, atol=1e-12)
    log2 = direct / np.log(2)
    assert np.abs(got["lse"] - direct).max() < np.abs(got["lse"] - log2).max() / 100, "lse is not in natural log"


MERGES = {
    "full": {},
    "causal-empty-part": {"causal": True},  # the first rows see none of the second half
    "masked-empty-rows": {"mask": True},
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", MERGES)
def test_merge_states(flashx_target, flashx_rng, name, dtype):
    """Attention over keys [0, s) and [s, Nk) merged with flashx.merge_states is attention over all keys."""
    seqlen_q, seqlen_k, split = 29, 50, 21
    options = dict(MERGES[name])
    if options.pop("mask", False):
        mask = flashx_rng.random((seqlen_q, seqlen_k)) < 0.7
        mask[3, :] = False  # empty in both parts
        mask[5, :split] = False  # empty in the first
        mask[7, split:] = False  # empty in the second
        options["mask"] = mask
    case = make_case(flashx_rng, batch=2, heads_q=4, heads_k=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=32, dtype=dtype, **options)
    parts = []
    for keys in (slice(0, split), slice(split, seqlen_k)):
        part_options = dict(case.options)
        if "mask" in part_options:
            part_options["mask"] = part_options["mask"][:, keys]
        if part_options.get("causal"):  # causal is bottom-right aligned: keep the whole key range's diagonal
            part_options.pop("causal")
            part_options["mask"] = (np.arange(seqlen_k)[None, :] <= np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q)[:, keys]
        inputs = {n: x[:, keys] if n in ("k", "v") else x for n, x in case.inputs.items()}
        o, res, *_ = flashx_target.call(Case(inputs, dtype, part_options))
        parts += [o, res.lse]
    o, lse = flashx.merge_states(*parts)
    failures = merged_failures(case, flashx_target.numpy(o), flashx_target.numpy(lse))
    assert not failures, case.describe() + "\n" + "\n".join(failures)
