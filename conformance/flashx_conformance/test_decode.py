"""Decoding with a KV cache (``flashx.attention_with_kvcache``): contiguous and paged caches, the
in-place append, splits, tree masks, the score modifications, poison and malformed tables and lengths.

Every case holds o and lse to the dense float64 oracle (``oracle.kvcache`` lays each call out as
dense attention: the sequence's keys gathered in order, seqlens_k = Lk, the tree mask over the last
Nq keys), rows with no allowed key to o = 0 and lse = -inf (the head's sink with sinks) exactly,
and the caches after the call to the caches with the new tokens written in, bit for bit: nothing
is written anywhere else. Every slot a sequence does not hold (past its length, in pages no
sequence uses) is NaN before the call, so a kernel that reads one leaks NaN into the outputs.

The score modifications run the values of ``test_score_mods`` over decoding's own contexts
(``DECODE_CONTEXTS``), where a backend that gets one rule wrong fails: ALiBi measured from a
split's last key instead of the sequence's, or from the top-left; the sink counted in every split,
or not in a row without keys; the cap applied before the scale.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import pytest

import flashx
import flashx.kvcache
from flashx_conformance import oracle
from flashx_conformance.harness import diagonal, full_only, subnormal_terms
from flashx_conformance.test_score_mods import ALIBI, SINKS, SOFTCAPS
from flashx_conformance.tolerance import judge, judge_exact, reference_precision, round_to

AXES = {"o": "bihd", "lse": "bhi"}


@dataclass
class DecodeCase:
    """One call: float64 arrays holding values of ``dtype`` (caches with their poison), and keywords."""

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    cache_seqlens: np.ndarray  # int32
    dtype: str
    k_new: np.ndarray | None = None
    v_new: np.ndarray | None = None
    block_table: np.ndarray | None = None  # int32; -1 in entries that hold no token
    options: dict = field(default_factory=dict)  # causal, window, softmax_scale, the modifications, mask, num_splits
    cache_dtype: str | None = None  # an FP8 cache's dtype (its descales among the options); None: the caches are q's

    @property
    def needs_torch(self) -> bool:
        """Whether every array is a torch tensor: an FP8 cache is one, whatever the backend's kind."""
        return self.cache_dtype is not None

    @property
    def output_dtype(self) -> str:
        """o's dtype, which ``Target.check_kinds`` reads: q's."""
        return self.dtype

    @property
    def arrays(self) -> dict:
        names = ("k_new", "v_new", "block_table")
        return {"cache_seqlens": self.cache_seqlens, **{n: getattr(self, n) for n in names if getattr(self, n) is not None}}

    def oracle_keywords(self) -> dict:
        keywords = {name: value for name, value in self.options.items() if name != "num_splits"}
        return {**self.arrays, **keywords, "cache_dtype": self.cache_dtype}

    def describe(self) -> str:
        layout = "contiguous" if self.block_table is None else f"paged, page_size {self.k_cache.shape[1]}"
        new = 0 if self.k_new is None else self.k_new.shape[1]
        options = ", ".join(f"{name}={np.shape(value) if isinstance(value, np.ndarray) else value!r}"
                            for name, value in self.options.items())
        cache = f" {self.cache_dtype}" if self.cache_dtype else ""
        return (f"case: q{self.q.shape} {self.dtype}, {layout}{cache} cache {self.k_cache.shape}, "
                f"cache_seqlens={self.cache_seqlens.tolist()}, {new} new; {options}")


def make_decode_case(rng, *, lengths, new=0, seqlen_q=1, heads_q=4, heads_k=2, head_dim=32, head_dim_v=None,
                     page_size=None, dtype="float32", cache_dtype=None, poison=math.nan, **options) -> DecodeCase:
    """Sequences of ``lengths`` cached tokens (standard normal) in a contiguous cache with 3 spare
    slots, or in pages of ``page_size`` handed out in a random order, with 2 pages no sequence
    uses and a table column past the longest sequence; every slot no token holds is ``poison``.
    With ``cache_dtype`` (FP8) the cached tokens are values of that dtype."""
    lengths = np.asarray(lengths, dtype=np.int64)
    batch, head_dim_v = len(lengths), head_dim_v or head_dim
    total = lengths + new

    def normal(*shape, rounded_to=dtype):
        return round_to(rng.standard_normal(shape), rounded_to)

    longest = int(total.max(initial=0))
    tokens = {"k": normal(batch, longest, heads_k, head_dim, rounded_to=cache_dtype or dtype),
              "v": normal(batch, longest, heads_k, head_dim_v, rounded_to=cache_dtype or dtype)}
    if page_size is None:
        slots = int(total.max(initial=0)) + 3
        caches = {name: np.full((batch, slots) + x.shape[2:], poison) for name, x in tokens.items()}
        for b in range(batch):
            for name, x in tokens.items():
                caches[name][b, : lengths[b]] = x[b, : lengths[b]]
        table = None
    else:
        pages = -(-total // page_size)
        order = rng.permutation(int(pages.sum()) + 2)
        table = np.full((batch, int(pages.max(initial=0)) + 1), -1, dtype=np.int32)
        table[np.arange(table.shape[1])[None, :] < pages[:, None]] = order[: pages.sum()]
        caches = {name: np.full((len(order), page_size) + x.shape[2:], poison) for name, x in tokens.items()}
        for b in range(batch):
            positions = np.arange(lengths[b])
            for name, x in tokens.items():
                caches[name][table[b, positions // page_size], positions % page_size] = x[b, : lengths[b]]
    return DecodeCase(
        q=normal(batch, seqlen_q, heads_q, head_dim),
        k_cache=caches["k"],
        v_cache=caches["v"],
        cache_seqlens=lengths.astype(np.int32),
        dtype=dtype,
        k_new=normal(batch, new, heads_k, head_dim) if new else None,
        v_new=normal(batch, new, heads_k, head_dim_v) if new else None,
        block_table=table,
        options=options,
        cache_dtype=cache_dtype,
    )


def call(target, case: DecodeCase, **extra):
    """o, lse and the caches after the call, as float64 NumPy arrays (skips what the backend declines)."""
    caches = {name: target.array(getattr(case, name), case.cache_dtype or case.dtype, torch=case.needs_torch)
              for name in ("k_cache", "v_cache")}
    keywords = _keywords(target, case, extra)
    q = target.array(case.q, case.dtype, torch=case.needs_torch)
    skip_unless_supported(target, q, caches["k_cache"], caches["v_cache"], **keywords)
    o, lse = flashx.attention_with_kvcache(q, caches["k_cache"], caches["v_cache"], **keywords, return_lse=True,
                                           backend=target.name)
    target.check_kinds(case, q, {"o": o, "lse": lse})
    return {name: target.numpy(x) for name, x in (("o", o), ("lse", lse), *caches.items())}


def skip_unless_supported(target, q, k_cache, v_cache, **keywords):
    """Skip with the backend's own reasons where it declines the call."""
    for row in flashx.kvcache.explain(q, k_cache, v_cache, **keywords).rows:
        if row.name == target.name and row.reasons:
            pytest.skip(f"{target.name}: " + "; ".join(row.reasons))


def _keywords(target, case, extra) -> dict:
    # NumPy arrays become the backend's (slopes and sinks in float32); others are a test's own views
    keywords = target.auxiliary({**case.options, **extra}, case.dtype, torch=case.needs_torch)
    return {**{name: target.array(x, case.dtype, torch=case.needs_torch) for name, x in case.arrays.items()}, **keywords}


def failures(case: DecodeCase, got: dict) -> list[str]:
    """Everything in ``got`` that breaks the contract for ``case``."""
    keywords = case.oracle_keywords()
    k_cache, v_cache, k, v, options = oracle.kvcache(case.q, case.k_cache, case.v_cache, **keywords)
    found = [f"{name}: the cache after the call differs from the cache with the new tokens written in at "
             f"{int((~_same(got[name], expected)).sum())} elements, first at {tuple(np.argwhere(~_same(got[name], expected))[0])}"
             for name, expected in (("k_cache", k_cache), ("v_cache", v_cache)) if not _same(got[name], expected).all()]
    precision = reference_precision(case.dtype)
    do = np.ones(case.q.shape[:3] + (v.shape[-1],))
    expected = oracle.forward(*(x.astype(precision) for x in (case.q, k, v)), **options)
    naive = oracle.naive(do, case.q, k, v, case.dtype, backward="rowsum", **options)
    terms = oracle.term_magnitudes(do, case.q, k, v, **options)
    subnormal = subnormal_terms(case.dtype, len(terms), do, case.q, k, v, **options)
    lse = np.asarray(expected[1], dtype=np.float64)
    lse_magnitude = float(np.abs(lse[np.isfinite(lse)]).max(initial=0.0))
    for n, name in enumerate(("o", "lse")):
        found.append(judge(name, got[name], expected[n], [naive[n]], terms[n], case.dtype, AXES[name],
                           lse_magnitude=lse_magnitude, subnormal=subnormal[n]))
    empty = oracle.empty_rows(case.q, k, v, **options)
    sinks = options["sinks"]
    empty_lse = -math.inf if sinks is None else np.asarray(sinks, dtype=np.float64)[:, None]  # lse: (B, Hq, Nq)
    found.append(judge_exact("o", got["o"], 0.0, empty.swapaxes(1, 2)[..., None], AXES["o"], "rows with no allowed key"))
    found.append(judge_exact("lse", got["lse"], empty_lse, empty, AXES["lse"], "rows with no allowed key"))
    return [failure for failure in found if failure]


def _same(a, b) -> np.ndarray:
    return (a == b) | (np.isnan(a) & np.isnan(b))


def check(target, case: DecodeCase, **extra) -> dict:
    got = call(target, case, **extra)
    found = failures(dataclasses.replace(case, options={**case.options, **extra}), got)
    assert not found, case.describe() + "\n" + "\n".join(found)
    return got


# ---------------------------------------------------------------------------------- cases

PAGE_SIZES = [None, 1, 5, 16, 256]


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: "contiguous" if p is None else f"page{p}")
def test_decode_cache_layouts(flashx_target, flashx_rng, page_size):
    """The same tokens in a contiguous cache and in pages of 1, 5, 16 and 256 slots, handed out in
    a random order: each call appends one token and matches the oracle."""
    lengths = [300, 17, 0] if flashx_target.full or page_size == 256 else [40, 17, 0]
    case = make_decode_case(flashx_rng, lengths=lengths, new=1, page_size=page_size, dtype=flashx_target.dtype)
    check(flashx_target, case)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, pytest.param(64, marks=full_only), 0])
def test_decode_num_splits(flashx_target, flashx_rng, num_splits):
    """Keys split into n parts merged by LSE meet the oracle for every n, more parts than key tiles
    included (empty parts weigh 0); a fixed n gives the same bits on every call; 0 lets the backend choose."""
    lengths = [700, 1, 77] if flashx_target.full else [50, 1, 20]
    case = make_decode_case(flashx_rng, lengths=lengths, seqlen_q=2, page_size=16, dtype=flashx_target.dtype,
                            num_splits=num_splits)
    first = check(flashx_target, case)
    again = call(flashx_target, case)
    for name in ("o", "lse"):
        assert np.array_equal(first[name], again[name], equal_nan=True), f"{name} changed between two calls"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("new", [0, 2])
def test_decode_ragged(flashx_target, flashx_rng, new, causal):
    """Lengths 0, 1, either side of the key tiles' edges (16 to 128 rows) and longer in one batch;
    with no new token a sequence of length 0 has no key at all: its rows are empty (o = 0, lse = -inf)."""
    edges = [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 250]
    lengths = edges if flashx_target.full else [0, 1, 15, 16, 17, 40]
    case = make_decode_case(flashx_rng, lengths=lengths, new=new, seqlen_q=2, page_size=16, dtype=flashx_target.dtype,
                            num_splits=2, causal=causal)
    check(flashx_target, case)


@pytest.mark.parametrize("page_size", [None, 1, 16], ids=lambda p: "contiguous" if p is None else f"page{p}")
@pytest.mark.parametrize("new", [1, 4])
def test_decode_append(flashx_target, flashx_rng, page_size, new):
    """Chunked prefill: the Nq = Nn new tokens are written into their slots (one page boundary
    crossed) and attended to causally; the caches change there and nowhere else."""
    case = make_decode_case(flashx_rng, lengths=[14, 0, 31], new=new, seqlen_q=new, page_size=page_size,
                            dtype=flashx_target.dtype, causal=True)
    check(flashx_target, case)


def draft_tree_mask(parents: list[int]) -> np.ndarray:
    """(Nq, Nq) bool: draft token i attends to itself and to its ancestors (``parents[i]``, -1 at the root)."""
    mask = np.eye(len(parents), dtype=bool)
    for i, parent in enumerate(parents):
        while parent != -1:
            mask[i, parent] = True
            parent = parents[parent]
    return mask


#: A draft tree as speculative decoding builds it: the top 2 continuations of the root, the top
#: 2 of the first and 1 of the second, then a chain under the most likely leaf.
DRAFT_TREE = [-1, 0, 0, 1, 1, 2, 3, 6]


@pytest.mark.parametrize("broadcast", ["shared", "per-sequence"])
def test_decode_tree_mask(flashx_target, flashx_rng, broadcast):
    """Verifying a draft tree: its 8 tokens are appended and each attends to the cache and to its
    ancestors in the tree (the mask over the last Nq keys); causal holds as well. Draft token 2
    of the first sequence holds a NaN value: only the rows of tokens 2 and 5 (its descendant)
    read it, and only they may be NaN."""
    mask = draft_tree_mask(DRAFT_TREE)
    if broadcast == "per-sequence":  # the second sequence verifies a chain instead
        mask = np.stack([mask, np.tril(np.ones_like(mask)), mask])[:, None]
    case = make_decode_case(flashx_rng, lengths=[37, 0, 20], new=len(DRAFT_TREE), seqlen_q=len(DRAFT_TREE),
                            page_size=16, dtype=flashx_target.dtype, mask=mask, causal=True, num_splits=2)
    case.v_new[0, 2, 0, 3] = math.nan
    got = check(flashx_target, case)
    assert np.isnan(got["o"][0, [2, 5], :2]).any(axis=-1).all() and np.isfinite(np.delete(got["o"][0], [2, 5], 0)).all()


WINDOWS = {
    "left": dict(window=(9, -1), causal=True),
    "left-right": dict(window=(9, 2), causal=False),
    "right-only": dict(window=(-1, 1), causal=False),
    "none-non-causal": dict(causal=False),
}


@pytest.mark.parametrize("name", WINDOWS)
def test_decode_window(flashx_target, flashx_rng, name):
    """Causal and window at each sequence's own length (query i at key Lk - Nq + i). The keys that
    no row's window reaches are NaN: a kernel must not read them."""
    options = WINDOWS[name]
    case = make_decode_case(flashx_rng, lengths=[60, 3, 0], new=2, seqlen_q=3, page_size=16,
                            dtype=flashx_target.dtype, num_splits=3, **options)
    left = options.get("window", (-1, -1))[0]
    if left != -1:
        for b, length in enumerate(case.cache_seqlens):
            unreached = np.arange(max(0, length + 2 - 3 - left))
            where = (case.block_table[b, unreached // 16], unreached % 16)
            case.k_cache[where] = case.v_cache[where] = math.nan
    check(flashx_target, case)


@pytest.mark.parametrize("poison", [math.inf, -math.inf, math.nan], ids=str)
def test_decode_poison(flashx_target, flashx_rng, poison):
    """Infinities and NaN in every unused slot and page, and table entries past each sequence
    pointing nowhere (2**30): none reaches an output."""
    case = make_decode_case(flashx_rng, lengths=[23, 0, 16], new=1, page_size=16, dtype=flashx_target.dtype,
                            poison=poison, num_splits=2)
    case.block_table[case.block_table == -1] = 2**30
    check(flashx_target, case)


def test_decode_nan_propagation(flashx_target, flashx_rng):
    """A NaN in a cached key that the rows of a sequence attend to makes those rows NaN (and only
    those: the other sequence's rows and the rows of the other kv head stay finite)."""
    case = make_decode_case(flashx_rng, lengths=[30, 30], new=1, page_size=16, dtype=flashx_target.dtype,
                            num_splits=2)
    case.k_cache[case.block_table[0, 1], 3, 0, 5] = math.nan  # sequence 0, token 19, kv head 0
    got = check(flashx_target, case)
    assert np.isnan(got["o"][0, :, :2]).all() and np.isfinite(got["o"][0, :, 2:]).all() and np.isfinite(got["o"][1]).all()


@pytest.mark.parametrize("page_size", [None, 16, 256], ids=lambda p: "contiguous" if p is None else f"page{p}")
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 64), ("float16", 64)] + [
    pytest.param(dtype, 128, marks=full_only) for dtype in ("bfloat16", "float16")])
def test_decode_16bit(flashx_target, flashx_rng, dtype, head_dim, page_size):
    """16-bit caches, the decoding shapes of the benchmarks (GQA 4) at small lengths, in each kind
    of cache the kernels tile differently."""
    lengths = [1000, 517, 3] if flashx_target.full else [70, 33, 3]
    case = make_decode_case(flashx_rng, lengths=lengths, new=1, heads_q=8, heads_k=2, head_dim=head_dim,
                            page_size=page_size, dtype=dtype, num_splits=0 if page_size else 3)
    check(flashx_target, case)


def test_decode_validate_false(flashx_target, flashx_rng):
    """validate=False (no host checks) computes the very same bits as validate=True."""
    case = make_decode_case(flashx_rng, lengths=[33, 0, 8], new=1, page_size=5, dtype=flashx_target.dtype)
    checked = check(flashx_target, case)
    unchecked = call(flashx_target, case, validate=False)
    for name in ("o", "lse"):
        assert np.array_equal(checked[name], unchecked[name], equal_nan=True), f"{name} differs with validate=False"


@pytest.mark.parametrize("shape", ["B=0", "Nq=0", "no-keys"])
def test_decode_empty(flashx_target, flashx_rng, shape):
    """No sequence; no query row (the new tokens are still written); no key at all (empty rows)."""
    if shape == "B=0":
        case = make_decode_case(flashx_rng, lengths=[], new=1, page_size=16, dtype=flashx_target.dtype)
    elif shape == "Nq=0":
        case = make_decode_case(flashx_rng, lengths=[5, 0], new=2, seqlen_q=0, dtype=flashx_target.dtype)
    else:
        case = make_decode_case(flashx_rng, lengths=[0, 0], seqlen_q=2, page_size=1, dtype=flashx_target.dtype)
    got = check(flashx_target, case)
    assert got["o"].shape == case.q.shape[:3] + (case.v_cache.shape[-1],)


# ---------------------------------------------------------------------------------- score modifications

#: Where each modification must hold in decoding: name -> build(rng, dtype, mods), ``mods(batch,
#: heads_q)`` giving the modification's keywords (``test_score_mods``'s families). GQA 2 throughout.
DECODE_CONTEXTS = {
    # one new token per sequence in a contiguous cache, three splits
    "contiguous": lambda rng, dtype, mods: make_decode_case(rng, lengths=[45, 17, 3], new=1, dtype=dtype,
                                                            num_splits=3, **mods(3, 4)),
    # chunked prefill: Nq = Nn = 4 new tokens attended causally across a page boundary, the
    # empty second sequence holding only them
    "paged-causal-append": lambda rng, dtype, mods: make_decode_case(rng, lengths=[14, 0, 31], new=4, seqlen_q=4,
                                                                     page_size=16, dtype=dtype, causal=True,
                                                                     num_splits=2, **mods(3, 4)),
    # a draft tree: the tree mask removes pairs, it does not move the bias
    "tree-mask": lambda rng, dtype, mods: make_decode_case(rng, lengths=[37, 0, 20], new=len(DRAFT_TREE),
                                                           seqlen_q=len(DRAFT_TREE), page_size=5, dtype=dtype,
                                                           mask=draft_tree_mask(DRAFT_TREE), causal=True,
                                                           num_splits=2, **mods(3, 4)),
    # keys on both sides of each row's position, in pages of one slot
    "window": lambda rng, dtype, mods: make_decode_case(rng, lengths=[60, 3, 0], new=2, seqlen_q=3, page_size=1,
                                                        dtype=dtype, window=(9, 2), causal=False, num_splits=3,
                                                        **mods(3, 4)),
    # more splits than keys: an empty split adds nothing, not even the sink
    "many-splits": lambda rng, dtype, mods: make_decode_case(rng, lengths=[70, 1, 5], seqlen_q=2, page_size=16,
                                                             dtype=dtype, causal=False, num_splits=7, **mods(3, 4)),
    # an empty cache without new tokens: the first sequence's rows have no key (o = 0, lse = sink)
    "empty-cache": lambda rng, dtype, mods: make_decode_case(rng, lengths=[0, 23], seqlen_q=2, page_size=16,
                                                             dtype=dtype, causal=True, num_splits=2, **mods(2, 4)),
}


@pytest.mark.parametrize("cap, context", diagonal(list(SOFTCAPS), list(DECODE_CONTEXTS)), ids=str)
def test_decode_softcap(flashx_target, flashx_rng, cap, context):
    """S = c * tanh(S / c) on the scaled scores of every split."""
    check(flashx_target, DECODE_CONTEXTS[context](flashx_rng, flashx_target.dtype, SOFTCAPS[cap]))


@pytest.mark.parametrize("slopes, context", diagonal(list(ALIBI), list(DECODE_CONTEXTS)), ids=str)
def test_decode_alibi(flashx_target, flashx_rng, slopes, context):
    """S -= a * |Lk - Nq + i - j|: the distance from each row's own position, whatever split holds the key."""
    check(flashx_target, DECODE_CONTEXTS[context](flashx_rng, flashx_target.dtype, ALIBI[slopes]))


@pytest.mark.parametrize("sinks, context", diagonal(list(SINKS), list(DECODE_CONTEXTS)), ids=str)
def test_decode_sinks(flashx_target, flashx_rng, sinks, context):
    """exp(sink) once in every row's denominator, however many splits; lse holds it; a row with no key
    has o = 0 and lse = sink."""
    check(flashx_target, DECODE_CONTEXTS[context](flashx_rng, flashx_target.dtype, SINKS[sinks]))


def _all_three(batch, heads):
    return {"softcap": 2.0, "alibi_slopes": 2.0 ** -np.arange(1.0, batch * heads + 1).reshape(batch, heads),
            "sinks": np.resize([1.5, -0.5, 4.0, 0.25], heads)}


@pytest.mark.parametrize("context", list(DECODE_CONTEXTS))
def test_decode_score_mods_combined(flashx_target, flashx_rng, context):
    """softcap, ALiBi per sequence and head, and sinks in one decoding call, in the contract's order."""
    check(flashx_target, DECODE_CONTEXTS[context](flashx_rng, flashx_target.dtype, _all_three))


@pytest.mark.parametrize("page_size", [None, 16], ids=lambda p: "contiguous" if p is None else f"page{p}")
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=full_only)])
def test_decode_score_mods_16bit(flashx_target, flashx_rng, dtype, page_size):
    """All three in 16 bits at the benchmarks' decoding shapes (GQA 4, d64), where GPU kernels take
    their tensor-core paths, with the backend's own choice of splits."""
    lengths = [600, 131, 0] if flashx_target.full else [70, 33, 0]
    case = make_decode_case(flashx_rng, lengths=lengths, heads_q=8, heads_k=2, head_dim=64, page_size=page_size,
                            dtype=dtype, **_all_three(3, 8))
    check(flashx_target, case)


def test_decode_score_mods_nan_and_inf(flashx_target, flashx_rng):
    """A NaN sink (head 0) and a +inf sink (head 1) make the rows of their head that have a key NaN;
    the rows of the empty sequence keep o = 0 and lse = sink. A NaN slope (sequence 0, head 2) makes
    that sequence's head NaN; head 3 is untouched. Split in three, the sink still counts once."""
    slopes = np.full((2, 4), 0.25)
    slopes[0, 2] = np.nan
    case = make_decode_case(flashx_rng, lengths=[30, 0], seqlen_q=2, page_size=16, dtype=flashx_target.dtype,
                            num_splits=3, softcap=3.0, sinks=np.array([np.nan, np.inf, 0.5, -1.0]), alibi_slopes=slopes)
    got = check(flashx_target, case)
    assert np.isnan(got["o"][0, :, :2]).all() and np.isnan(got["o"][0, :, 2]).all() and np.isfinite(got["o"][0, :, 3]).all()
    assert (got["o"][1] == 0).all()


def _wrong_table(case):
    case.block_table[1, 0] = case.k_cache.shape[0]  # past the last page
    return {}


def _negative_page(case):
    case.block_table[0, 1] = -1
    return {}


def _shared_slot(case):  # sequence 2 writes its new token where sequence 0 writes its own
    case.block_table[2, 0] = case.block_table[0, 1]
    case.cache_seqlens[2] = case.cache_seqlens[0] - 16
    return {}


def _past_capacity(case):
    case.cache_seqlens[1] = case.block_table.shape[1] * 16
    return {}


def _set(**keywords):
    return lambda case: keywords


#: name -> (change to a valid paged case, error class, the argument the message names)
MALFORMED = {
    "table-entry-past-the-pages": (_wrong_table, flashx.ShapeError, "block_table"),
    "table-entry-negative": (_negative_page, flashx.ShapeError, "block_table"),
    "two-sequences-write-one-slot": (_shared_slot, flashx.ShapeError, "block_table"),
    "length-negative": (lambda case: case.cache_seqlens.__setitem__(0, -1) or {}, flashx.ShapeError, "cache_seqlens"),
    "length-past-capacity": (_past_capacity, flashx.ShapeError, "cache_seqlens"),
    "lengths-float": (lambda case: {"cache_seqlens": case.cache_seqlens.astype(np.float32)}, flashx.DTypeError,
                      "cache_seqlens"),
    "lengths-shape": (lambda case: {"cache_seqlens": np.zeros(4, np.int32)}, flashx.ShapeError, "cache_seqlens"),
    "table-float": (lambda case: {"block_table": case.block_table.astype(np.float32)}, flashx.DTypeError, "block_table"),
    "table-shape": (lambda case: {"block_table": case.block_table[:2]}, flashx.ShapeError, "block_table"),
    "table-1d": (lambda case: {"block_table": case.block_table[0]}, flashx.ShapeError, "block_table"),
    "k_new-without-v_new": (lambda case: {"v_new": None}, flashx.ShapeError, "v_new"),
    "k_new-shape": (lambda case: {"k_new": case.k_new[:, :, :1]}, flashx.ShapeError, "k_new"),
    "v_new-shape": (lambda case: {"v_new": case.v_new[:, :, :, :3]}, flashx.ShapeError, "v_new"),
    "mask-shape": (_set(mask=np.ones((2, 3), bool)), flashx.ShapeError, "mask"),
    "mask-dtype": (_set(mask=np.ones((1, 1), np.float32)), flashx.DTypeError, "mask"),
    "num_splits-negative": (_set(num_splits=-1), flashx.OptionError, "num_splits"),
    "num_splits-float": (_set(num_splits=2.0), flashx.DTypeError, "num_splits"),
    "validate-int": (_set(validate=1), flashx.DTypeError, "validate"),
    "causal-int": (_set(causal=1), flashx.DTypeError, "causal"),
    "window": (_set(window=(-2, 0)), flashx.OptionError, "window"),
    "softcap-zero": (_set(softcap=0.0), flashx.OptionError, "softcap"),
    "softcap-string": (_set(softcap="1"), flashx.DTypeError, "softcap"),
    "alibi-shape": (_set(alibi_slopes=np.ones((3, 2))), flashx.ShapeError, "alibi_slopes"),
    "alibi-int": (lambda case: {"alibi_slopes": np.ones(4, np.int32)}, flashx.DTypeError, "alibi_slopes"),
    "sinks-shape": (_set(sinks=np.ones((3, 4))), flashx.ShapeError, "sinks"),
    "sinks-int": (lambda case: {"sinks": np.ones(4, np.int64)}, flashx.DTypeError, "sinks"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_decode_malformed(flashx_target, flashx_rng, name):
    """Each malformed table, length or keyword gets its error class, naming the argument."""
    case = make_decode_case(flashx_rng, lengths=[20, 3, 20], new=1, page_size=16, dtype=flashx_target.dtype)
    change, error, argument = MALFORMED[name]
    replaced = change(case)  # changes the case's lengths or table in place, or gives keywords to pass instead
    keywords = _keywords(flashx_target, case, {})
    for key, value in replaced.items():
        keywords[key] = flashx_target.array(value, case.dtype) if isinstance(value, np.ndarray) else value
    arrays = {name: flashx_target.array(getattr(case, name), case.dtype) for name in ("q", "k_cache", "v_cache")}
    with pytest.raises(error) as caught:
        flashx.attention_with_kvcache(arrays["q"], arrays["k_cache"], arrays["v_cache"], **keywords,
                                      backend=flashx_target.name)
    assert str(caught.value).startswith(f"{argument}:"), f"{name}: {caught.value}"


MALFORMED_CACHES = {
    "k_cache-head-dim": (lambda kc, vc: (kc[..., :8], vc), flashx.ShapeError, "k_cache"),
    "v_cache-heads": (lambda kc, vc: (kc, vc[:, :, :1]), flashx.ShapeError, "v_cache"),
    "k_cache-3d": (lambda kc, vc: (kc[0], vc), flashx.ShapeError, "k_cache"),
    "page_size-0": (lambda kc, vc: (kc[:, :0], vc[:, :0]), flashx.ShapeError, "k_cache"),
    "heads-not-dividing": (lambda kc, vc: (np.concatenate([kc, kc[:, :, :1]], 2), np.concatenate([vc, vc[:, :, :1]], 2)),
                           flashx.ShapeError, "k_cache"),
}


@pytest.mark.parametrize("name", MALFORMED_CACHES)
def test_decode_malformed_cache(flashx_target, flashx_rng, name):
    """Caches of the wrong shape get a ShapeError naming the cache."""
    case = make_decode_case(flashx_rng, lengths=[5, 3], page_size=16, dtype=flashx_target.dtype)
    change, error, argument = MALFORMED_CACHES[name]
    k_cache, v_cache = change(case.k_cache, case.v_cache)
    array = flashx_target.array
    with pytest.raises(error) as caught:
        flashx.attention_with_kvcache(array(case.q, case.dtype), array(k_cache, case.dtype), array(v_cache, case.dtype),
                                      **_keywords(flashx_target, case, {}), backend=flashx_target.name)
    assert str(caught.value).startswith(f"{argument}:"), f"{name}: {caught.value}"


def test_decode_contiguous_batch(flashx_target, flashx_rng):
    """A contiguous cache (no block_table) must hold one row of slots per sequence of q."""
    case = make_decode_case(flashx_rng, lengths=[5, 3], dtype=flashx_target.dtype)
    array = flashx_target.array
    with pytest.raises(flashx.ShapeError, match="^k_cache: expected batch 2"):
        flashx.attention_with_kvcache(array(case.q, case.dtype), array(case.k_cache[:1], case.dtype),
                                      array(case.v_cache[:1], case.dtype), **_keywords(flashx_target, case, {}),
                                      backend=flashx_target.name)


def test_decode_cuda_graph(flashx_target, flashx_rng):
    """With validate=False a call is captured in a CUDA graph (a host synchronization would fail the
    capture); replayed on new queries, new tokens and advanced lengths, it computes what an eager call does."""
    if not (flashx_target.device.startswith("cuda") and flashx_target.caller_kind(flashx_target.dtype) == "torch"):
        pytest.skip("CUDA graphs: torch tensors on a CUDA device only")
    import torch

    case = make_decode_case(flashx_rng, lengths=[40, 7, 0], new=1, page_size=16, dtype=flashx_target.dtype)
    array = flashx_target.array
    static = {name: array(x, case.dtype) for name, x in (("q", case.q), ("k_cache", case.k_cache),
                                                         ("v_cache", case.v_cache), *case.arrays.items())}

    skip_unless_supported(flashx_target, static["q"], static["k_cache"], static["v_cache"],
                          cache_seqlens=static["cache_seqlens"], k_new=static["k_new"], v_new=static["v_new"],
                          block_table=static["block_table"], validate=False)

    def step():
        return flashx.attention_with_kvcache(static["q"], static["k_cache"], static["v_cache"],
                                             cache_seqlens=static["cache_seqlens"], k_new=static["k_new"],
                                             v_new=static["v_new"], block_table=static["block_table"], validate=False,
                                             return_lse=True, backend=flashx_target.name)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = step()
    later = make_decode_case(flashx_rng, lengths=[41, 8, 1], new=1, page_size=16, dtype=flashx_target.dtype)
    for name in ("q", "k_new", "v_new", "cache_seqlens"):
        static[name].copy_(array(getattr(later, name), case.dtype))
    graph.replay()
    torch.cuda.synchronize()
    replayed = {"o": flashx_target.numpy(o), "lse": flashx_target.numpy(lse)}
    # The caches the graph wrote to are the case's, with both steps' new tokens written in.
    expected = dataclasses.replace(later, k_cache=flashx_target.numpy(static["k_cache"]),
                                   v_cache=flashx_target.numpy(static["v_cache"]), block_table=case.block_table)
    eager = call(flashx_target, expected)
    for name in ("o", "lse"):
        assert np.array_equal(replayed[name], eager[name], equal_nan=True), f"{name}: the replay differs from eager"
    found = failures(expected, {**eager, "k_cache": expected.k_cache, "v_cache": expected.v_cache})
    assert not [f for f in found if not f.startswith(("k_cache", "v_cache"))], "\n".join(found)
