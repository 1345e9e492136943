"""Properties (hypothesis): any small problem the backend says it supports matches the oracle.

The fixed cases of the other modules pin the edges users have hit; here hypothesis combines
them: batch, lengths (Nq != Nk both ways, 1, zero-length sequences), GQA ratios, Dv != D,
dtypes, causal, windows, seqlens, varlen, random boolean and block masks, scales and dropout.
Each draw is limited to the dtypes and features the backend declares, so an unsupported
combination is drawn rarely (and then rejected, never counted as a pass).

In CI (hypothesis sees ``CI=true``) or with ``--hypothesis-profile ci``, hypothesis' built-in
``ci`` profile applies: derandomised, no deadline, no example database, so every run checks
the same examples. The number of examples follows the suite's tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import flashx
from flashx_conformance.harness import DTYPES, make_case, make_varlen_case


@dataclass(frozen=True)
class Sizes:
    examples: int
    max_len: int  # of a sequence, and of a window side
    max_batch: int
    max_heads: int  # of kv heads, and of query heads per kv head
    head_dims: tuple[int, ...]


# small: kernels run under an interpreter or a simulator, where every program instance costs
SIZES = {"small": Sizes(6, 16, 1, 2, (8, 16, 32)), "full": Sizes(40, 24, 3, 4, (8, 16, 24, 32, 40, 64))}


@st.composite
def cases(draw, backend, sizes: Sizes, dropout: bool):
    """A ``harness.Case`` using only the dtypes and features ``backend`` declares."""
    features = backend.features

    def maybe(feature, strategy, default=None):
        return draw(strategy) if feature in features and draw(st.booleans()) else default

    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    heads_k = draw(st.integers(1, sizes.max_heads))
    heads_q = heads_k * maybe("gqa", st.integers(2, sizes.max_heads), 1)
    head_dim = draw(st.sampled_from(sizes.head_dims))
    shape = dict(
        dtype=draw(st.sampled_from([d for d in DTYPES if d in backend.dtypes])),
        heads_q=heads_q,
        heads_k=heads_k,
        head_dim=head_dim,
        head_dim_v=maybe("dv_ne_d", st.sampled_from(sizes.head_dims), head_dim),
    )
    sides = st.integers(-1, sizes.max_len)  # -1: unbounded
    options = dict(
        causal=maybe("causal", st.just(True), False),
        window=maybe("window", st.tuples(sides, sides)),
        # 0 and negative scales are valid; magnitudes below 1e-3 only measure float32 underflow
        softmax_scale=draw(st.none() | st.just(0.0) | st.floats(1e-3, 2.0) | st.floats(-2.0, -1e-3)),
    )
    if dropout:
        options.update(
            dropout_p=draw(st.sampled_from([0.1, 0.5, 0.9])),
            seed=draw(st.integers(0, 2**64 - 1)),
            rng_offset=draw(st.integers(0, 2**33)),
        )

    if "varlen" in features and draw(st.booleans()):
        batch = draw(st.integers(1, sizes.max_batch))
        lengths = st.lists(st.integers(0, sizes.max_len), min_size=batch, max_size=batch)
        return make_varlen_case(
            rng, lengths_q=draw(lengths), lengths_k=draw(lengths), spare_rows=draw(st.integers(0, 3)), **shape, **options
        )

    lengths = st.integers(1, sizes.max_len)
    batch, seqlen_q, seqlen_k = draw(st.integers(1, sizes.max_batch)), draw(lengths), draw(lengths)
    if maybe("seqlens", st.just(True)):
        options["seqlens_q"] = rng.integers(0, seqlen_q, size=batch, endpoint=True).astype(np.int32)
        options["seqlens_k"] = rng.integers(0, seqlen_k, size=batch, endpoint=True).astype(np.int32)
    # masks: broadcast over batch and heads or not, dense or sparse
    leading = st.sampled_from([(1, 1), (batch, 1), (1, heads_q), (batch, heads_q)])
    density = st.sampled_from([0.2, 0.6, 0.95])
    if maybe("mask", st.just(True)):
        options["mask"] = rng.random(draw(leading) + (seqlen_q, seqlen_k)) < draw(density)
    if maybe("block_mask", st.just(True)):
        block_q, block_k = draw(st.sampled_from([1, 2, 3, 16])), draw(st.sampled_from([1, 4, 5, 16]))
        tiles = (-(-seqlen_q // block_q), -(-seqlen_k // block_k))
        options["block_mask"] = flashx.BlockMask(rng.random(draw(leading) + tiles) < draw(density), (block_q, block_k))
    return make_case(rng, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, **shape, **options)


def check_all(target, dropout: bool):
    sizes = SIZES[target.tier]

    @settings(max_examples=sizes.examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(cases(target.backend, sizes, dropout))
    def matches_oracle(case):
        try:
            target.check(case)
        except pytest.skip.Exception:  # a limit the declarations do not show (head dim, device)
            reject()

    matches_oracle()


def test_masks_and_shapes_match_oracle(flashx_target):
    check_all(flashx_target, dropout=False)


def test_dropout_with_masks_matches_oracle(flashx_target):
    if "dropout" not in flashx_target.backend.features:
        pytest.skip(f"{flashx_target.name} does not declare dropout")
    check_all(flashx_target, dropout=True)
