"""flashx.distributed: ring attention against flashx and the oracle on the gathered sequence.

The process-group tests start 2, 3 and 4 processes of a gloo group on CPU, once per size, and
run every case in them: each rank runs the ring forward and backward on its shards, the shards
of o, lse, dq, dk and dv are gathered (and each rank's dsinks, its rows' part, summed), and one
rank grades them by the contract's exactness rule
against the float64 oracle on the whole sequence (``harness.conformance_failures``), compares
float64 results with ``flashx.attention`` on the whole sequence, and reads the dropout mask out
bit for bit. A case whose backward runs in head groups is run in one group too, and each rank's
shards must equal its bit for bit. Ranks collect failures and report them at the end, so that no
rank leaves the others waiting in a message.

The same steps run in one process by ``simulate_ring_attention``; ``test_simulated_ring_on_cuda``
is the GPU check (Triton kernels, 2, 4 and 8 simulated ranks), skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
import re
import weakref
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from flashx_conformance import oracle  # noqa: E402
from flashx_conformance.harness import (OUTPUTS, Case, conformance_failures, make_case,  # noqa: E402
                                        make_varlen_case, outputs_of)

import flashx  # noqa: E402
from flashx.distributed import (peak_bytes_per_token, ring_attention, shard,  # noqa: E402
                                simulate_ring_attention, unshard)
from flashx.errors import DTypeError, OptionError, ShapeError, UnsupportedError  # noqa: E402
from flashx.ring.sequences import pair_call  # noqa: E402
from tests.script_modules import load_script  # noqa: E402

LAYOUTS = ("contiguous", "zigzag")  # the layouts of padded and packed input ("document_zigzag": packed only)
SEQLEN = 24  # divisible by 2W for W = 2, 3, 4: every layout fits every group size


# ---------------------------------------------------------------- one backend call per chunk pair


def _band_allowed(band, i, j):
    left, right = band or (-1, -1)
    return (left == -1 or j - i >= -left) & (right == -1 or j - i <= right)


@pytest.mark.parametrize("band", [None, (-1, 0), (3, 0), (0, 0), (2, 5), (0, -1), (7, 1), (1, 9)], ids=str)
def test_pair_call_reads_exactly_the_pairs_the_band_allows(band):
    """The rows, keys and window of ``pair_call``, read with the contract's bottom-right band, allow
    exactly the pairs the whole sequence's band allows between the query and key positions given
    (of one length, as the chunks of a ring, or of two, as a document's fragments)."""
    lengths = [(1, 1), (3, 3), (5, 5), (2, 5), (5, 1), (4, 7)]
    for (rows_in, keys_in), query_start, key_start in itertools.product(lengths, range(16), range(16)):
        i, j = np.arange(rows_in)[:, None], np.arange(keys_in)[None, :]
        expected = _band_allowed(band, query_start + i, key_start + j) & np.ones((rows_in, keys_in), bool)
        found = pair_call(band, query_start, rows_in, key_start, keys_in)
        if found is None:
            assert not expected.any(), (rows_in, keys_in, query_start, key_start)
            continue
        rows, keys, window, offsets = found
        local_i, local_j = np.arange(rows.stop - rows.start)[:, None], np.arange(keys.stop - keys.start)[None, :]
        diagonal = (keys.stop - keys.start) - (rows.stop - rows.start)
        allowed = np.zeros((rows_in, keys_in), bool)
        allowed[rows, keys] = _band_allowed(window, local_i + diagonal, local_j)
        assert (allowed == expected).all(), (rows_in, keys_in, query_start, key_start, found)
        assert offsets == (query_start + rows.start, key_start + keys.start)
        assert expected[rows].any(axis=1).all() and expected[:, keys].any(axis=0).all()  # nothing read in vain


# ---------------------------------------------------------------- the dropout_offsets option


@pytest.mark.parametrize("offsets", [(0, 0), (5, 3), (1, 6), (17, 30)])
def test_oracle_mask_at_offsets_is_a_slice_of_the_whole(offsets):
    row0, key0 = offsets
    x = np.random.default_rng(0).standard_normal((2, 48, 3, 4))
    q, k = x[:, :11], x[:, :13]
    whole = oracle.keep_mask(x, x, x, dropout_p=0.4, seed=2**40 + 7, rng_offset=3)
    part = oracle.keep_mask(q, k, k, dropout_p=0.4, seed=2**40 + 7, rng_offset=3, dropout_offsets=offsets)
    assert (part == whole[:, :, row0 : row0 + 11, key0 : key0 + 13]).all()


def test_numpy_backend_draws_at_offsets():
    case = make_case(np.random.default_rng(1), batch=2, seqlen_q=19, seqlen_k=26, heads_q=4, heads_k=2, head_dim=8,
                     dtype="float64", causal=True, dropout_p=0.3, seed=99, dropout_offsets=(7, 13))
    x = {name: torch.from_numpy(value).requires_grad_(name != "do") for name, value in case.inputs.items()}
    o, lse = flashx.attention(x["q"], x["k"], x["v"], return_lse=True, backend="numpy", **case.options)
    grads = torch.autograd.grad(o, (x["q"], x["k"], x["v"]), x["do"])
    got = dict(zip(OUTPUTS, (t.detach().numpy() for t in (o, lse, *grads))))
    assert not conformance_failures(case, got)
    unshifted = flashx.attention(x["q"], x["k"], x["v"], backend="numpy", **{**case.options, "dropout_offsets": None})
    assert (unshifted - o).abs().max() > 0.1  # the offsets move the mask


def test_a_backend_that_does_not_declare_offsets_declines():
    class Plain(flashx.Backend):  # the default declaration: every feature but the opt-in ones
        name, devices = "plain-offsets-test", frozenset({"cpu"})

    flashx.registry.register(Plain())
    try:
        q = np.ones((1, 4, 1, 8))
        offset = flashx.explain(q, q, q, dropout_p=0.5, seed=1, dropout_offsets=(4, 0))
        row = next(row for row in offset.rows if row.name == "plain-offsets-test")
        assert row.reasons == ("does not support " + flashx.problem.FEATURES["dropout_offsets"],)
        for options in ({"dropout_p": 0.5, "seed": 1}, {"dropout_offsets": (4, 0)}):  # offsets that change nothing
            row = next(row for row in flashx.explain(q, q, q, **options).rows if row.name == "plain-offsets-test")
            assert row.reasons == ()
    finally:
        flashx.registry.unregister("plain-offsets-test")


@pytest.mark.parametrize("offsets, error", [((1,), OptionError), ((1, -1), OptionError), ((0, 2**31), OptionError),
                                            ((1.0, 2), DTypeError), ("12", DTypeError), (3, DTypeError)])
def test_dropout_offsets_are_checked(offsets, error):
    q = np.ones((1, 4, 1, 8))
    with pytest.raises(error, match="dropout_offsets: expected"):
        flashx.attention(q, q, q, dropout_p=0.5, seed=1, dropout_offsets=offsets)


# ---------------------------------------------------------------- shards and arguments


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shards_cover_the_sequence_once(layout):
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    shards = [shard(x, 3, rank, layout) for rank in range(3)]
    assert torch.equal(unshard(shards, layout), x)
    positions = [shard(torch.arange(24)[None], 3, rank, layout)[0].tolist() for rank in range(3)]
    if layout == "zigzag":
        assert positions[0] == [0, 1, 2, 3, 20, 21, 22, 23] and positions[1] == [4, 5, 6, 7, 16, 17, 18, 19]
    else:
        assert positions[1] == list(range(8, 16))


def test_document_zigzag_shards_zigzag_every_document():
    """Documents of 8, 0 and 4 rows and 4 rows of padding on two ranks: rank r holds quarters r and
    3 - r of each, its first quarters of every one, then its last."""
    x = torch.arange(16)
    cu = torch.tensor([0, 8, 8, 12])
    shards = [shard(x, 2, rank, "document_zigzag", dim=0, cu_seqlens=cu) for rank in range(2)]
    assert shards[0].tolist() == [0, 1, 8, 12, 6, 7, 11, 15]
    assert shards[1].tolist() == [2, 3, 9, 13, 4, 5, 10, 14]
    assert torch.equal(unshard(shards, "document_zigzag", dim=0, cu_seqlens=[0, 8, 8, 12]), x)
    lse = torch.arange(3 * 16).reshape(3, 16)  # (Hq, T): the sequence axis is 1
    parts = [shard(lse, 2, rank, "document_zigzag", dim=1, cu_seqlens=cu) for rank in range(2)]
    assert torch.equal(parts[1][0], shards[1]) and torch.equal(unshard(parts, "document_zigzag", 1, cu), lse)


def _causal_work(lengths: list[int], world_size: int, layout: str) -> list[int]:
    """Each rank's causal work on packed documents of ``lengths``: over its rows, the keys each
    attends, a row at position x of a document starting at b attending x - b + 1."""
    cu = np.concatenate([[0], np.cumsum(lengths)])
    positions = torch.arange(int(cu[-1]))
    starts = torch.from_numpy(cu[np.searchsorted(cu, positions.numpy(), side="right") - 1])
    return [int((shard(positions, world_size, rank, layout, dim=0, cu_seqlens=cu) + 1
                 - shard(starts, world_size, rank, layout, dim=0, cu_seqlens=cu)).sum()) for rank in range(world_size)]


def _benchmark_documents() -> list[int]:
    """The documents of scripts/ring_gpus.py's packed part: 262,144 tokens in documents of 1k to 64k."""
    return load_script("ring_gpus").document_lengths(262144, 1024, 65536)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_document_zigzag_balances_the_causal_work(world_size):
    """On the benchmark's documents each rank holds exactly 1/W of the causal work in
    document_zigzag; zigzag, cutting the packed axis as one sequence, leaves the busiest rank
    1.39x the mean on 2 ranks, 1.85x on 4 and on 8 (an efficiency of at most 0.72, 0.54, 0.54).
    Random mixes of lengths, empty documents among them, balance exactly too."""
    lengths = _benchmark_documents()
    balanced = _causal_work(lengths, world_size, "document_zigzag")
    assert balanced == [balanced[0]] * world_size
    assert sum(balanced) == sum(n * (n + 1) // 2 for n in lengths)
    zigzag = _causal_work(lengths, world_size, "zigzag")
    assert sum(zigzag) == sum(balanced)
    assert max(zigzag) / np.mean(zigzag) == pytest.approx({2: 1.395, 4: 1.847, 8: 1.851}[world_size], abs=1e-3)
    rng = np.random.default_rng(world_size)
    for _ in range(5):
        lengths = (2 * world_size * rng.integers(0, 20, size=rng.integers(1, 12))).tolist()
        padding = [0] if sum(lengths) else [2 * world_size]
        work = _causal_work(lengths + padding, world_size, "document_zigzag")
        assert work == [work[0]] * world_size, lengths


def test_bad_arguments_are_refused():
    q = torch.randn(1, 12, 2, 8)
    with pytest.raises(ShapeError, match="layout: expected one of 'contiguous', 'zigzag', 'document_zigzag', got "
                                         "'ring'"):
        shard(q, 2, 0, "ring")
    with pytest.raises(ShapeError, match="into 8 equal chunks: expected a length divisible by that, got 12"):
        shard(q, 4, 0, "zigzag")
    with pytest.raises(ShapeError, match="rank: expected an int in"):
        shard(q, 2, 2)
    with pytest.raises(DTypeError, match="q: expected a torch tensor"):
        simulate_ring_attention(q.numpy(), q.numpy(), q.numpy(), 1)
    with pytest.raises(ShapeError, match="into 4 equal chunks: expected a length divisible by that, got 6"):
        simulate_ring_attention(torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8), 2)
    with pytest.raises(OptionError, match="window: expected"):
        simulate_ring_attention(q, q, q, 2, window=(-2, 0))
    with pytest.raises(UnsupportedError, match="^alibi_slopes: ring attention does not take ALiBi. Each ring step is a "
                                               "backend call on a pair of chunks, which measures ALiBi's distance from "
                                               "its own bottom-right diagonal"):
        simulate_ring_attention(q, q, q, 2, alibi_slopes=torch.ones(2))
    with pytest.raises(ShapeError, match="sinks: expected shape"):
        simulate_ring_attention(q, q, q, 2, sinks=torch.ones(3))
    with pytest.raises(OptionError, match="exchange: expected one of 'ring', 'all_gather', got 'ring_of_rings'"):
        simulate_ring_attention(q, q, q, 2, exchange="ring_of_rings")
    with pytest.raises(ShapeError, match="seqlens: indexes the padded layout and cannot be combined with cu_seqlens"):
        simulate_ring_attention(q[0], q[0], q[0], 2, seqlens=torch.tensor([4]), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ShapeError, match=r"^cu_seqlens: expected offsets starting at 0, non-decreasing, ending at "
                                         r"most at 12"):
        simulate_ring_attention(q[0], q[0], q[0], 2, cu_seqlens=torch.tensor([0, 5, 13]))
    with pytest.raises(ShapeError, match=r"^seqlens: expected lengths in \[0, 12\]"):
        simulate_ring_attention(q, q, q, 2, seqlens=torch.tensor([13]))
    with pytest.raises(ShapeError, match=r"q: expected a shard of shape \(T/W, H, D\) with cu_seqlens"):
        simulate_ring_attention(q.expand(4, -1, -1, -1), q.expand(4, -1, -1, -1), q.expand(4, -1, -1, -1), 2,
                                cu_seqlens=torch.tensor([0, 4]))


def test_document_zigzag_refuses_documents_it_cannot_cut():
    packed = torch.randn(16, 2, 8)
    needs = ("^cu_seqlens: layout 'document_zigzag' cuts each document of a packed sequence and needs its "
             "cu_seqlens, got none; padded \\(B, N\\) input is cut sequence by sequence by layout 'zigzag' already$")
    with pytest.raises(ShapeError, match=needs):
        shard(packed, 2, 0, "document_zigzag", dim=0)
    with pytest.raises(ShapeError, match=needs):
        simulate_ring_attention(packed[None], packed[None], packed[None], 2, layout="document_zigzag")
    odd = (r"^cu_seqlens: layout 'document_zigzag' over 2 ranks cuts each document into 4 equal pieces: expected "
           r"document lengths that are multiples of 4, got document 2 of length 6 \(pad documents to a multiple of "
           r"4\)$")
    cu = torch.tensor([0, 4, 4, 10, 12])
    with pytest.raises(ShapeError, match=odd):
        shard(packed, 2, 1, "document_zigzag", dim=0, cu_seqlens=cu)
    with pytest.raises(ShapeError, match=odd):
        simulate_ring_attention(packed, packed, packed, 2, layout="document_zigzag", cu_seqlens=cu, causal=True)
    with pytest.raises(ShapeError, match=odd):
        unshard([packed[:8], packed[8:]], "document_zigzag", dim=0, cu_seqlens=cu)
    with pytest.raises(ShapeError, match=r"^cu_seqlens: expected offsets starting at 0, non-decreasing, ending at "
                                         r"most at 16, got \[0, 8, 20\]"):
        shard(packed, 2, 0, "document_zigzag", dim=0, cu_seqlens=[0, 8, 20])
    with pytest.raises(ShapeError, match="into 4 equal chunks: expected a length divisible by that, got 14"):
        shard(packed[:14], 2, 0, "document_zigzag", dim=0, cu_seqlens=[0, 4])


# ---------------------------------------------------------------- ring cases


@dataclasses.dataclass(frozen=True)
class RingCase:
    """One ring call: its keywords, shapes and what else is checked. ``seed=None`` with dropout
    checks that rank 0's drawn seed reaches every rank. ``documents`` packs documents of these
    lengths into ``seqlen`` rows (the rest padding; ``batch`` unused); ``seqlens`` gives the
    padded layout's lengths."""

    layout: str
    options: dict
    heads_k: int = 4
    dtype: str = "float64"
    head_dim_v: int = 8
    backend: str = "numpy"
    read_mask: bool = False  # v is one-hot per key: o != 0 exactly where a key is kept
    seqlen: int = SEQLEN
    batch: int = 2
    heads_q: int = 4
    poison: bool = False  # NaN in one key of k and another of v
    documents: tuple[int, ...] | None = None
    seqlens: tuple[int, ...] | None = None
    exchange: str = "ring"
    head_groups: int | None = None  # None: the ring's default

    def __str__(self):
        extras = [name for name in ("read_mask", "poison") if getattr(self, name)]
        extras += [f"{name}={getattr(self, name)}" for name in ("documents", "seqlens", "head_groups")
                   if getattr(self, name)]
        return (f"{self.layout} {self.exchange} {self.options} Hk={self.heads_k} {self.dtype} {self.backend} "
                f"{' '.join(extras)}")

    @property
    def axis(self) -> int:
        """The sequence axis of q, k, v and o (lse's is the next)."""
        return 0 if self.documents else 1

    @property
    def cu_seqlens(self) -> np.ndarray | None:
        """The documents' offsets, packed (which "document_zigzag" shards by)."""
        return np.concatenate([[0], np.cumsum(self.documents)]) if self.documents else None

    def case(self, seed: int) -> Case:
        options = dict(self.options)
        if options.get("seed", 0) is None:
            options["seed"] = seed  # the seed rank 0 drew, found by the caller
        head_dim_v = self.seqlen if self.read_mask else self.head_dim_v
        # the same inputs in every process, and in every head grouping of the case
        rng = np.random.default_rng(zlib.crc32(str(dataclasses.replace(self, head_groups=None)).encode()))
        shapes = dict(heads_q=self.heads_q, heads_k=self.heads_k, head_dim=8, head_dim_v=head_dim_v, dtype=self.dtype)
        if self.documents:
            case = make_varlen_case(rng, lengths_q=list(self.documents), lengths_k=list(self.documents),
                                    spare_rows=self.seqlen - sum(self.documents), **shapes, **options)
        else:
            if self.seqlens:
                options.update(seqlens_q=np.array(self.seqlens), seqlens_k=np.array(self.seqlens))
            case = make_case(rng, batch=self.batch, seqlen_q=self.seqlen, **shapes, **options)
        before = (None,) * self.axis  # the batch axis, padded
        if self.read_mask:
            one_hot = np.broadcast_to(np.eye(self.seqlen)[(*before, slice(None), None, slice(None))], case.inputs["v"].shape)
            case = dataclasses.replace(case, inputs={**case.inputs, "v": one_hot.copy()})
        if self.poison:
            key = np.zeros(self.seqlen, bool)
            key[self.seqlen // 2 + 1] = True
            where = (*before, slice(None), None, None)
            case = case.with_poison("k", key[where])
            case = case.with_poison("v", np.roll(key, -5)[where])
        return case


def ring_cases(world_size: int) -> list[RingCase]:
    cases = []
    for layout in LAYOUTS:
        cases += [
            RingCase(layout, {}),
            RingCase(layout, {"causal": True}, heads_k=2),
            RingCase(layout, {"window": (3, 2)}, heads_k=1, head_dim_v=12),
            RingCase(layout, {"causal": True, "window": (5, 3)}),
            RingCase(layout, {"window": (0, 7)}, heads_k=2),
            RingCase(layout, {"causal": True, "dropout_p": 0.3, "seed": 2**63 + 5}, heads_k=2, read_mask=True),
            RingCase(layout, {"window": (4, 4), "dropout_p": 0.25, "seed": 77, "rng_offset": 2**33 + 1},
                     read_mask=True),
            RingCase(layout, {"causal": True, "window": (6, -1)}, heads_k=2, poison=True),
            RingCase(layout, {"causal": True, "softcap": 0.5}, heads_k=2),
            RingCase(layout, {"window": (3, 2), "sinks": SINKS}, heads_k=2),
            RingCase(layout, {"causal": True, "window": (5, -1), "softcap": 2.0, "sinks": SINKS, "dropout_p": 0.3,
                              "seed": 2**40 + 3}, heads_k=1, read_mask=True),
        ]
    documents = [(5, 0, 9, 1, 6), (17, 2, 0, 5)]  # spanning ranks, empty, and (the first) padding rows
    cases += [
        RingCase("zigzag", {"causal": True}, heads_k=2, documents=documents[0], poison=True),
        RingCase("contiguous", {"window": (3, 2)}, heads_k=1, documents=documents[1]),
        RingCase("zigzag", {"causal": True, "dropout_p": 0.3, "seed": 2**50 + 1}, heads_k=2, read_mask=True,
                 documents=documents[1]),
        RingCase("zigzag", {"causal": True, "window": (5, -1), "softcap": 2.0, "sinks": SINKS, "dropout_p": 0.3,
                            "seed": 4}, heads_k=1, read_mask=True, documents=documents[0], exchange="all_gather"),
        RingCase("contiguous", {}, heads_k=2, documents=documents[0], exchange="all_gather", dtype="float32"),
        RingCase("zigzag", {"causal": True, "window": (6, 1)}, heads_k=2, seqlens=(24, 0, 13), batch=3),
        RingCase("contiguous", {"window": (4, 4), "dropout_p": 0.25, "seed": 8}, read_mask=True, seqlens=(7, 24),
                 exchange="all_gather"),
        RingCase("zigzag", {"causal": True, "sinks": SINKS}, heads_k=2, seqlens=(19, 2), exchange="all_gather"),
        RingCase("zigzag", {"causal": True}, heads_k=2, dtype="float32"),
        RingCase("contiguous", {"window": (5, 1)}, dtype="bfloat16"),
        RingCase("zigzag", {"causal": True, "dropout_p": 0.2, "seed": None}, heads_k=2),
        RingCase("zigzag", {"causal": True, "softcap": 1.0, "softmax_scale": 2.0, "sinks": SINKS}, dtype="float32"),
        RingCase("contiguous", {"sinks": np.array([-np.inf, 1.0, np.nan, np.inf])}, heads_k=2),
    ]
    unit = 2 * world_size  # document_zigzag's documents: multiples of 2W, from none to the whole sequence
    mixed, whole = tuple(unit * n for n in (1, 0, 4, 2, 0)), (0, 8 * unit, 0)  # mixed: one unit of padding after
    cases += [  # head groups: each also run in one group, which it must equal bit for bit
        RingCase("zigzag", {"causal": True, "softcap": 2.0, "sinks": SINKS}, heads_k=2, head_groups=2),
        RingCase("contiguous", {"window": (3, 2)}, seqlens=(19, 2), exchange="all_gather", head_groups=4),
        RingCase("contiguous", {"window": (5, 1)}, dtype="bfloat16", head_groups=2),
        RingCase("zigzag", {"causal": True, "dropout_p": 0.3, "seed": 2**50 + 1}, heads_k=2, read_mask=True,
                 documents=documents[1], head_groups=2),
        RingCase("contiguous", {"window": (4, 4), "dropout_p": 0.25, "seed": 77, "rng_offset": 2**33 + 1},
                 read_mask=True, seqlens=(24, 11), head_groups=4),
        RingCase("document_zigzag", {"causal": True, "window": (5, -1), "dropout_p": 0.3, "seed": 4}, heads_k=2,
                 read_mask=True, documents=mixed, seqlen=8 * unit, exchange="all_gather", head_groups=2),
    ]
    cases += [
        RingCase("document_zigzag", {"causal": True}, heads_k=2, documents=mixed, poison=True, seqlen=8 * unit),
        RingCase("document_zigzag", {"window": (3, 2)}, heads_k=1, documents=mixed, seqlen=8 * unit),
        RingCase("document_zigzag", {"causal": True, "dropout_p": 0.3, "seed": 2**50 + 1}, heads_k=2, read_mask=True,
                 documents=mixed, seqlen=8 * unit),
        RingCase("document_zigzag", {"causal": True, "window": (5, -1), "softcap": 2.0, "sinks": SINKS,
                                     "dropout_p": 0.3, "seed": 4}, heads_k=1, read_mask=True, documents=mixed,
                 seqlen=8 * unit, exchange="all_gather"),
        RingCase("document_zigzag", {}, heads_k=2, documents=mixed, seqlen=8 * unit, exchange="all_gather",
                 dtype="float32"),
        RingCase("document_zigzag", {"causal": True, "softcap": 1.0, "sinks": SINKS}, heads_k=2, documents=whole,
                 seqlen=8 * unit),
        RingCase("document_zigzag", {"window": (4, 4), "dropout_p": 0.25, "seed": 8}, read_mask=True, documents=whole,
                 seqlen=8 * unit, exchange="all_gather"),
    ]
    if world_size == 2:  # Triton's kernels, interpreted: slow, so one small case
        cases.append(RingCase("zigzag", {"causal": True, "dropout_p": 0.3, "seed": 123}, heads_k=1, dtype="float32",
                              backend="triton", read_mask=True, seqlen=8, batch=1, heads_q=2))
        cases.append(RingCase("zigzag", {"causal": True, "softcap": 2.0, "sinks": SINKS[:2]}, heads_k=1,
                              dtype="float32", backend="triton", seqlen=8, batch=1, heads_q=2))
        cases.append(RingCase("zigzag", {"causal": True, "dropout_p": 0.3, "seed": 123}, heads_k=2, dtype="float32",
                              backend="triton", read_mask=True, seqlen=8, batch=1, heads_q=2, head_groups=2))
    return cases


#: Sinks of the four query heads: beside the scores, far above them, far below, and exactly none.
SINKS = np.array([0.75, 6.5, -45.0, -np.inf])


def _torch_options(options: dict, dtype: str) -> dict:
    """A case's keywords for torch calls: lengths as tensors, sinks as a tensor in the lse's dtype
    (float64 for float64 inputs, else float32), so that the gradient it receives is dsinks in the
    contract's precision."""
    lengths = {name: torch.from_numpy(np.asarray(options[name])) for name in LENGTHS if options.get(name) is not None}
    sinks = options.get("sinks")
    if sinks is None:
        return {**options, **lengths}
    precision = torch.float64 if dtype == "float64" else torch.float32
    return {**options, **lengths, "sinks": torch.tensor(sinks, dtype=precision, requires_grad=True)}


LENGTHS = ("seqlens_q", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k")


def _ring_options(options: dict) -> dict:
    """flashx.attention's keywords as ring attention takes them: one array of lengths for both sides."""
    ring = {name: value for name, value in options.items() if name not in LENGTHS}
    for name in ("seqlens", "cu_seqlens"):
        if options.get(f"{name}_q") is not None:
            ring[name] = options[f"{name}_q"]
    return ring


def _gradients(o, x: dict, options: dict) -> tuple:
    """dq, dk, dv (and dsinks, with sinks) of ``o`` for the upstream gradient x["do"]."""
    leaves = [x["q"], x["k"], x["v"]] + ([options["sinks"]] if options.get("sinks") is not None else [])
    return torch.autograd.grad(o, leaves, x["do"])


def _tensor(x: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(getattr(torch, dtype))


def run_ring_case(ring: RingCase, rank: int, world_size: int, run) -> dict[str, torch.Tensor]:
    """This rank's shards of o, lse, dq, dk, dv in one case; ``run`` is the ring call. A world of
    one holds the whole sequence (``simulate_ring_attention``'s input; "document_zigzag" would
    reorder it)."""
    drawn = ring.options.get("seed", 0) is None and ring.options.get("dropout_p", 0) > 0
    case = ring.case(seed=0)
    x = {name: _tensor(value, ring.dtype) for name, value in case.rounded().items()}
    if world_size > 1:
        x = {name: shard(value, world_size, rank, ring.layout, dim=ring.axis, cu_seqlens=ring.cu_seqlens)
             for name, value in x.items()}
    mine = {name: value.detach().requires_grad_(name != "do") for name, value in x.items()}
    options = _torch_options({**case.options, "seed": None} if drawn else case.options, ring.dtype)
    if drawn:
        torch.manual_seed(1000 + rank)  # every rank would draw another seed
    o, lse = run(mine["q"], mine["k"], mine["v"], layout=ring.layout, exchange=ring.exchange, return_lse=True,
                 head_groups=ring.head_groups, backend=ring.backend, **_ring_options(options))
    return dict(zip(outputs_of(case), (o.detach(), lse, *_gradients(o, mine, options))))


def differences(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """The outputs of ``got`` that are not ``expected``'s bit for bit."""
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    return [f"{name}: {int((got[name].view(bits[x.itemsize]) != x.view(bits[x.itemsize])).sum())} of {x.numel()} "
            f"values differ from head_groups=1's" for name, x in expected.items()
            if not torch.equal(got[name].view(bits[x.itemsize]), x.view(bits[x.itemsize]))]


def grade(ring: RingCase, got: dict[str, torch.Tensor]) -> list[str]:
    """Everything in the gathered outputs that differs from the whole-sequence contract."""
    seed = 0
    if ring.options.get("seed", 0) is None:
        x = {name: _tensor(value, ring.dtype) for name, value in ring.case(0).rounded().items()}
        torch.manual_seed(1000)  # rank 0's generator when it drew
        seed = flashx.attention_forward(x["q"], x["k"], x["v"], dropout_p=ring.options["dropout_p"])[1].seed
    case = ring.case(seed)
    got = {name: value.double().numpy() for name, value in got.items()}
    failures = conformance_failures(case, got)
    x = {name: _tensor(value, ring.dtype).requires_grad_(name != "do") for name, value in case.rounded().items()}
    options = _torch_options(case.options, ring.dtype)
    o, lse = flashx.attention(x["q"], x["k"], x["v"], return_lse=True, backend="numpy", **options)
    if ring.dtype == "float64":
        for name, single in zip(outputs_of(case), (o, lse, *_gradients(o, x, options))):
            single = single.detach().numpy()
            if not np.allclose(got[name], single, rtol=1e-12, atol=1e-12, equal_nan=True):
                failures.append(f"{name}: {np.nanmax(np.abs(got[name] - single)):.3g} from flashx.attention")
    if ring.read_mask:
        shapes = {name: case.rounded()[name] for name in ("q", "k", "v")}
        kept = oracle.keep_mask(**shapes, **case.options) & oracle.allowed(**shapes, **case.options)
        for name, read in (("the oracle's", kept), ("flashx.attention's", _pairs_read(case, o.detach().numpy()))):
            if not np.array_equal(_pairs_read(case, got["o"]), read):
                failures.append(f"dropout mask differs from {name}")
    return failures


def _pairs_read(case: Case, o: np.ndarray) -> np.ndarray:
    """Which keys an o of one-hot values read, on the oracle's score grid (B, Hq, Nq, Nk): packed,
    one entry per document, positions within it."""
    if not case.varlen:
        return o.transpose(0, 2, 1, 3) != 0
    cu = case.options["cu_seqlens_q"]
    longest = int(np.diff(cu).max())
    read = np.zeros((len(cu) - 1, o.shape[1], longest, longest), bool)
    for document, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        read[document, :, : end - start, : end - start] = o[start:end, :, start:end].transpose(1, 0, 2) != 0
    return read


def _ranks(rank: int, world_size: int, init_file: str):
    """One process of the group: every case, graded by one rank in turn; failures raised at the end
    (ranks stay in step)."""
    os.environ["TRITON_INTERPRET"] = "1"  # before the Triton backend compiles: its kernels on CPU
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    failures = []
    try:
        odd = torch.randn(1, 5, 2, 8)  # refused on every rank alike, before any message
        with pytest.raises(ShapeError, match="q: layout 'zigzag' holds 2 equal chunks per rank"):
            ring_attention(odd, odd, odd)
        with pytest.raises(ShapeError, match="k: expected a shard as long as q's"):
            ring_attention(odd[:, :4], odd, odd, layout="contiguous")
        with pytest.raises(UnsupportedError, match="^alibi_slopes: ring attention does not take ALiBi"):
            ring_attention(odd[:, :4], odd[:, :4], odd[:, :4], alibi_slopes=torch.ones(2))
        with pytest.raises(ShapeError, match="^cu_seqlens: layout 'document_zigzag' cuts each document of a packed "
                                             "sequence and needs its cu_seqlens, got none; padded"):
            ring_attention(odd[:, :4], odd[:, :4], odd[:, :4], layout="document_zigzag")
        packed = odd[0, :4]  # 4 rows of 4W, documents of 2W and 3 rows
        with pytest.raises(ShapeError, match=f"got document 1 of length 3 \\(pad documents to a multiple of "
                                             f"{2 * world_size}\\)$"):
            ring_attention(packed, packed, packed, layout="document_zigzag", causal=True,
                           cu_seqlens=torch.tensor([0, 2 * world_size, 2 * world_size + 3]))
        for index, ring in enumerate(ring_cases(world_size)):
            mine = run_ring_case(ring, rank, world_size, ring_attention)
            if ring.head_groups not in (None, 1):
                failures += [f"W={world_size} {ring}: rank {rank}: {failure}"
                             for failure in differences(mine, run_ring_case(dataclasses.replace(ring, head_groups=1),
                                                                           rank, world_size, ring_attention))]
            gathered = {}
            for name, x in mine.items():
                if name == "dsinks":  # each rank's rows' part: their sum is the whole sequence's
                    dist.all_reduce(x)
                    gathered[name] = x
                    continue
                parts = [torch.empty_like(x) for _ in range(world_size)]
                dist.all_gather(parts, x.contiguous())
                gathered[name] = unshard(parts, ring.layout, dim=ring.axis + (name == "lse"),
                                         cu_seqlens=ring.cu_seqlens)
            if index % world_size == rank:
                failures += [f"W={world_size} {ring}: {failure}" for failure in grade(ring, gathered)]
        failures += ring_memory_failures(world_size, rank)
    finally:
        dist.destroy_process_group()
    assert not failures, "\n".join(failures)


class _LiveBytes(TorchDispatchMode):
    """The bytes of torch storage that ops allocate while the mode is on, live and at their peak.
    A storage counts from the op that makes it to the death of the tensor it was made for (the
    ring keeps no view of a buffer past its base). Arrays a NumPy backend allocates are not torch's."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _freed(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":  # messages write into buffers made before them, and keep work objects
            return out
        given = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and x._base is None and x.untyped_storage().data_ptr() not in given:
                size = x.untyped_storage().nbytes()
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(x, self._freed, size)
        return out


def ring_memory_failures(world_size: int, rank: int) -> list[str]:
    """The bytes per token the backward allocates beyond the caller's tensors, against the count of
    ``peak_bytes_per_token`` (its terms but the caller's tensors and the backend's parts, which are
    the NumPy backend's arrays here; at most, and no less than without the first call's sums):
    two dK/dV sets in flight, not three; packed documents in
    "document_zigzag"; in two head groups, one group's sums and shards beside the whole gradients."""
    failures = []
    tokens, heads, heads_k, dim = 512, 4, 2, 16
    generator = torch.Generator().manual_seed(rank)
    q, k, v, do = (torch.randn(1, tokens, h, dim, generator=generator).requires_grad_(i < 3)
                   for i, h in enumerate((heads, heads_k, heads_k, heads)))
    # The all-gather exchange is not counted here: a dispatch mode around gloo's asynchronous
    # all-gather aborts a process now and then (about one run in three), and its count adds only
    # the W gathered K/V shards and their dK/dV sums to the ring's terms.
    unit = 2 * world_size  # packed documents (one empty) and padding after them: W shards' rows
    documents = {"cu_seqlens": torch.tensor([0, 100 * unit, 156 * unit, 156 * unit, 250 * unit])}
    padded, packed = (q, k, v, do), [x.detach()[0].requires_grad_(x.requires_grad) for x in (q, k, v, do)]
    for exchange, layout, lengths, head_groups in (
            ("ring", "zigzag", {}, 1), ("ring", "contiguous", {}, 1), ("ring", "document_zigzag", documents, 1),
            ("ring", "zigzag", {}, 2), ("ring", "document_zigzag", documents, 2)):
        q, k, v, do = packed if lengths else padded
        o = ring_attention(q, k, v, causal=True, layout=layout, exchange=exchange, backend="numpy",
                           head_groups=head_groups, **lengths)
        with _LiveBytes() as allocated:
            torch.autograd.grad(o, (q, k, v), do)
        count = peak_bytes_per_token(heads, heads_k, dim, torch.float32, world_size=world_size, layout=layout,
                                     exchange=exchange, head_groups=head_groups)
        expected = sum(count["terms"].values()) - count["terms"]["q, o, do, k, v (the caller's)"] \
            - count["terms"]["a call's dq, dk, dv parts"]
        # the first call's sums may be made at a moment other than the peak's (with W = 2, when
        # fewer dK/dV sets are live): the count holds them, so it bounds the peak from above
        least = expected - count["terms"]["the first call's dK/dV, summed"]
        if not least <= allocated.peak / tokens <= expected:
            failures.append(f"W={world_size} {exchange} {layout} head_groups={head_groups}: the backward allocated "
                            f"{allocated.peak / tokens} bytes per token at its peak, counted {expected} "
                            f"(at least {least})")
    return failures


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the Triton interpreter's 1/0 on empty rows
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_attention_over_gloo(world_size, tmp_path):
    torch.multiprocessing.spawn(_ranks, args=(world_size, str(tmp_path / "rendezvous")), nprocs=world_size)


# ---------------------------------------------------------------- ranks simulated in one process


@pytest.mark.parametrize("world_size, layout", [(1, "zigzag"), (3, "contiguous"), (8, "zigzag")])
@pytest.mark.parametrize("mods", [{}, {"softcap": 1.5, "sinks": SINKS}], ids=["plain", "softcap-sinks"])
def test_simulated_ring_equals_single_device(world_size, layout, mods):
    """One sinks tensor serves every simulated rank: it receives the sum of their dsinks."""
    ring = RingCase(layout, {"causal": True, "window": (9, 2), "dropout_p": 0.2, "seed": 3, **mods}, heads_k=2,
                    read_mask=True, seqlen=6 * world_size)
    got = run_ring_case(ring, 0, 1, lambda *xs, **kw: simulate_ring_attention(*xs, world_size, **kw))
    assert not grade(ring, got)


@pytest.mark.parametrize("exchange", ["ring", "all_gather"])
def test_simulated_ring_of_eight_on_packed_documents(exchange):
    """Eight ranks, chunks of 3 rows: documents of 1 to 21 rows, one across six chunks."""
    ring = RingCase("zigzag", {"causal": True, "window": (9, -1), "dropout_p": 0.2, "seed": 3, "softcap": 1.5,
                               "sinks": SINKS}, heads_k=2, read_mask=True, seqlen=48,
                    documents=(1, 21, 0, 4, 3, 2, 11, 5), exchange=exchange)
    got = run_ring_case(ring, 0, 1, lambda *xs, **kw: simulate_ring_attention(*xs, 8, **kw))
    assert not grade(ring, got)


def test_a_packed_ring_reads_its_offsets_on_the_host_once(monkeypatch):
    """The ring reads cu_seqlens once; the lengths of its own calls, which it made from them, are
    vouched for (a read of each, on a GPU, would stall it while the host plans)."""
    from flashx import validation

    reads = []
    read_values = validation._int_vector
    monkeypatch.setattr(validation, "_int_vector",
                        lambda name, *args, read=True, **kw: (reads.append(name) if read else None,
                                                              read_values(name, *args, read=read, **kw))[1])
    x = torch.randn(128, 2, 16, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 24, 40, 64, 128], dtype=torch.int32)
    o = simulate_ring_attention(x, x, x, 4, layout="document_zigzag", causal=True, cu_seqlens=cu)
    o.sum().backward()
    assert reads == ["cu_seqlens_q"]
    assert torch.allclose(o, flashx.attention(x, x, x, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu))


def test_a_ring_call_of_a_planned_description_plans_nothing(monkeypatch):
    """Every layer of a training step calls the ring with the same documents: the first call plans
    its steps' calls, the later ones reuse them (``Rank.planned``) and compute the same; other
    documents, or another dropout seed, are planned afresh."""
    from flashx.ring import steps

    planned = []
    plan = steps.plan
    monkeypatch.setattr(steps, "plan", lambda *args: (planned.append(1), plan(*args))[1])
    monkeypatch.setattr(steps.Rank, "_kept", type(steps.Rank._kept)())
    x = torch.randn(128, 2, 16, dtype=torch.float64)
    counts = []
    for offsets, seed in (([0, 24, 40, 64, 128], 1), ([0, 24, 40, 64, 128], 1), ([0, 40, 64, 128], 1),
                          ([0, 24, 40, 64, 128], 2)):
        cu = torch.tensor(offsets, dtype=torch.int32)
        options = dict(causal=True, cu_seqlens=cu, dropout_p=0.25, seed=seed)
        o = simulate_ring_attention(x, x, x, 4, layout="document_zigzag", **options)
        expected = flashx.attention(x, x, x, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, dropout_p=0.25, seed=seed)
        assert torch.allclose(o, expected)
        counts.append(len(planned))
        planned.clear()
    assert counts[0] > 0 and counts[1] == 0 and counts[2] > 0 and counts[3] > 0


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("head_groups", [1, 2])
def test_the_ring_backward_sends_no_sums_after_its_last_step(monkeypatch, world_size, head_groups):
    """The backward reads each rank's own K/V shard last, so a shard's dK/dV sums end their turn at
    its owner: W - 1 hops of K/V (the first before the first step) and W - 1 of sums, none after
    the last step, where a backward that started from the rank's own shard sent the sums W times.
    In head groups, each group's traversal does so on its heads."""
    from flashx.ring import messages

    sent = []
    shift = messages.SimulatedMessages.shift
    monkeypatch.setattr(messages.SimulatedMessages, "shift",
                        lambda self, items: (sent.append((items[0][0].dtype, items[0][0].shape[2])),
                                             shift(self, items))[1])
    x = torch.randn(2, 8 * world_size, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    o = simulate_ring_attention(x, x, x, world_size, causal=True, head_groups=head_groups)
    sent.clear()
    o.float().sum().backward()
    heads = 2 // head_groups
    assert sent.count((torch.bfloat16, heads)) == sent.count((torch.float32, heads)) == head_groups * (world_size - 1)
    assert len(sent) == 2 * head_groups * (world_size - 1)
    reference = x.detach().requires_grad_()
    flashx.attention(reference, reference, reference, causal=True).float().sum().backward()
    assert (x.grad.float() - reference.grad.float()).norm() <= 1e-2 * reference.grad.float().norm()


@pytest.mark.parametrize("options, packed", [({}, False), ({"dropout_p": 0.2, "seed": 1}, False),
                                             ({"dropout_p": 0.2, "seed": 1}, True)], ids=str)
def test_the_default_head_groups_are_the_fewest_below_twice_one_device(monkeypatch, options, packed):
    """bfloat16, Hq = Hk = 4, D = 16, four ranks: one group counts 2.81x one device, two 2.09x,
    four 1.55x, so the backward traverses the ring four times, a group of one KV head each (its
    dK/dV sums sent W - 1 times per group), with dropout too."""
    from flashx.ring import messages

    counted = peak_bytes_per_token(4, 4, 16, torch.bfloat16, world_size=4)
    assert counted["head_groups"] == 4 and counted["ring"] < 2 * counted["single"]
    assert peak_bytes_per_token(4, 4, 16, torch.bfloat16, world_size=4, head_groups=2)["ring"] >= 2 * counted["single"]
    sums = []
    shift = messages.SimulatedMessages.shift
    monkeypatch.setattr(messages.SimulatedMessages, "shift",
                        lambda self, items: (sums.append(items[0][0].shape[2]) if items[0][0].dtype == torch.float32
                                             else None, shift(self, items))[1])
    x = torch.randn(1, 32, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    lengths = {"cu_seqlens": torch.tensor([0, 12, 32])} if packed else {}
    x = x[0].detach().requires_grad_() if packed else x
    o = simulate_ring_attention(x, x, x, 4, causal=True, backend="numpy", **options, **lengths)
    torch.autograd.grad(o.float().sum(), x)
    assert sums == [1] * (4 * 3)


@pytest.mark.parametrize("world_size, documents", [(1, (2, 0, 6, 4)), (8, (16, 48, 0, 32, 16, 80, 0)),
                                                  (8, (0, 192, 0))], ids=str)
def test_simulated_document_zigzag(world_size, documents):
    """Every document zigzagged over 1 or 8 ranks (pieces of 1 to 12 rows, 6 to 24 with the
    whole sequence one document): forward, backward and the dropout mask of flashx.attention."""
    ring = RingCase("document_zigzag", {"causal": True, "window": (9, -1), "dropout_p": 0.2, "seed": 3,
                                        "softcap": 1.5, "sinks": SINKS}, heads_k=2, read_mask=True,
                    seqlen=sum(documents), documents=documents)
    got = run_ring_case(ring, 0, 1, lambda *xs, **kw: simulate_ring_attention(*xs, world_size, **kw))
    assert not grade(ring, got)


CUDA_CASES = [
    ({"causal": True}, 2, "bfloat16"),
    ({"window": (100, 30)}, 4, "bfloat16"),
    ({"causal": True, "dropout_p": 0.2, "seed": 11}, 2, "bfloat16"),
    ({"causal": True, "window": (300, -1), "dropout_p": 0.1, "seed": 5}, 1, "float16"),
]


#: packed documents of 1024 rows, multiples of 16: every layout cuts them on up to 8 ranks
CUDA_DOCUMENTS = (64, 336, 0, 16, 400, 208)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU check of the simulated ring needs CUDA")
@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("layout, packed", [(layout, False) for layout in LAYOUTS]
                         + [("zigzag", True), ("document_zigzag", True)], ids=str)
@pytest.mark.parametrize("options, heads_k, dtype", CUDA_CASES, ids=str)
def test_simulated_ring_on_cuda(world_size, layout, packed, options, heads_k, dtype):
    """W ranks simulated on one GPU with the Triton backend, graded on the gathered sequence by the
    contract's rule; the same rule grades single-device flashx, whose errors are printed beside.
    Packed: documents of 16 to 400 rows and an empty one."""
    rng, shapes = np.random.default_rng(world_size), dict(heads_q=4, heads_k=heads_k, head_dim=64, dtype=dtype)
    if packed:
        case = make_varlen_case(rng, lengths_q=list(CUDA_DOCUMENTS), lengths_k=list(CUDA_DOCUMENTS), **shapes,
                                **options)
    else:
        case = make_case(rng, batch=1, seqlen_q=1024, **shapes, **options)
    x = {name: _tensor(value, dtype).cuda().requires_grad_(name != "do") for name, value in case.rounded().items()}
    single = {**case.options, **{name: torch.from_numpy(case.options[name]).cuda() for name in LENGTHS
                                 if name in case.options}}
    results = {}
    for name, call, keywords in (
            ("ring", lambda *xs, **kw: simulate_ring_attention(*xs, world_size, layout=layout, **kw),
             _ring_options(single)),
            ("single", flashx.attention, single)):
        o, lse = call(x["q"], x["k"], x["v"], return_lse=True, backend="triton", **keywords)
        grads = torch.autograd.grad(o, (x["q"], x["k"], x["v"]), x["do"])
        results[name] = {n: t.detach().double().cpu().numpy() for n, t in zip(OUTPUTS, (o, lse, *grads))}
    difference = max(np.abs(results["ring"][n] - results["single"][n]).max() for n in OUTPUTS)
    print(f"\nW={world_size} {layout:15} {'packed ' if packed else ''}{dtype} {options}: "
          f"max |ring - single| = {difference:.3g}")
    assert not conformance_failures(case, results["ring"])


@pytest.mark.parametrize("heads_k, with_parts, without_parts", [(16, 90, 84), (4, 39, 36)])
def test_the_count_leaves_out_the_parts_of_a_backend_that_adds_as_it_writes(heads_k, with_parts, without_parts):
    """The contract's figures (bfloat16, H = 16, D = 128, the zigzag ring, KiB per token): a backend
    without ``backward_into`` returns each call's dq, dk and dv parts, one with it (Triton's) adds
    them into the sums, as measured on the H200 (84.4 and 36.3 KiB at W = 4)."""
    counts = [peak_bytes_per_token(16, heads_k, 128, torch.bfloat16, world_size=4, backward_into=flag, head_groups=1)
              for flag in (False, True)]
    assert [count["ring"] / 1024 for count in counts] == [with_parts, without_parts]
    assert counts[0]["terms"]["a call's dq, dk, dv parts"] == counts[0]["ring"] - counts[1]["ring"]
    assert "a call's dq, dk, dv parts" not in counts[1]["terms"]


@pytest.mark.parametrize("world_size, exchange, heads_k, counts, default", [
    (2, "ring", 16, {1: 76, 2: 60, 4: 46}, 2), (4, "ring", 16, {1: 84, 2: 64, 4: 48}, 4),
    (4, "ring", 4, {1: 36, 2: 31, 4: 25.5}, 1), (4, "all_gather", 16, {1: 132, 2: 88, 4: 60}, 4)])
def test_head_groups_count_one_group_of_sums_and_shards(world_size, exchange, heads_k, counts, default):
    """The contract's figures (bfloat16, H = 16, D = 128, zigzag, backward_into, KiB per token): in
    G groups the sums and the K/V in flight are 1/G, beside the whole gradients (a + kv = 12 KiB
    at Hk = 16) the groups are written into. The default is the fewest groups below twice one
    device's 32 KiB (20 KiB at Hk = 4): two groups at W = 4 count exactly 64 KiB, not below."""
    shape = dict(world_size=world_size, exchange=exchange, backward_into=True)
    for groups, kib in counts.items():
        count = peak_bytes_per_token(16, heads_k, 128, torch.bfloat16, **shape, head_groups=groups)
        assert (count["ring"] / 1024, count["head_groups"]) == (kib, groups)
        assert ("dq, dk, dv (the results, written in group by group)" in count["terms"]) == (groups > 1)
    chosen = peak_bytes_per_token(16, heads_k, 128, torch.bfloat16, **shape)
    assert chosen["head_groups"] == default and chosen["ring"] == counts[default] * 1024
    assert chosen["ring"] < 2 * chosen["single"]


def test_the_forward_holds_every_head_of_the_gathered_shards():
    """The all-gather's forward holds every K/V shard of every head (bfloat16, H = 16, D = 128, KiB
    per token): at W = 8, q, k, v 12, o summed 8 and 8 shards 64 make 84, above the backward's 58
    in 8 groups, and no count of groups gets below twice one device's 32; the default, the fewest
    groups of the least count with every call's parts, is 8 (4 count 85.5 with the parts). In the
    ring the forward holds two shards: 36 at W = 4, below the backward's 48."""
    gathered = peak_bytes_per_token(16, 16, 128, torch.bfloat16, world_size=8, exchange="all_gather",
                                    backward_into=True)
    assert (gathered["head_groups"], gathered["ring"] / 1024, sum(gathered["terms"].values()) / 1024) == (8, 84, 58)
    assert gathered["forward"] == {"q, k, v (the caller's)": 12 * 1024, "o summed": 8 * 1024,
                                   "K/V of every shard, gathered": 64 * 1024}
    ring = peak_bytes_per_token(16, 16, 128, torch.bfloat16, world_size=4, backward_into=True)
    assert (sum(ring["forward"].values()) / 1024, ring["ring"] / 1024) == (36, 48)


def test_the_default_head_groups_read_only_what_every_rank_shares():
    """Every rank must traverse the ring as often, and whether a call's backend adds as it writes
    may differ between ranks: the default counts every call's parts. Contiguous, Hk = 4, W = 4
    (KiB per token): one group counts 38 with backward_into, below one device's 2 x 20, but 44
    with the parts, so the default is 2 groups (32 with backward_into), for either flag."""
    shape = dict(world_size=4, layout="contiguous")
    one, two = (peak_bytes_per_token(16, 4, 128, torch.bfloat16, **shape, backward_into=flag, head_groups=1)["ring"]
                / 1024 for flag in (True, False))
    assert (one, two) == (38, 44)
    for flag, kib in ((True, 32), (False, 35)):
        chosen = peak_bytes_per_token(16, 4, 128, torch.bfloat16, **shape, backward_into=flag)
        assert (chosen["head_groups"], chosen["ring"] / 1024) == (2, kib)


def test_head_groups_are_checked():
    with pytest.raises(OptionError, match=r"^head_groups: expected a positive int dividing Hk = 4, or None, got 3$"):
        peak_bytes_per_token(8, 4, 16, torch.float32, world_size=2, head_groups=3)
    q, kv = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
    for value, error in ((0, OptionError), (4, OptionError), (np.int64(-2), OptionError), (2.0, DTypeError),
                         (True, DTypeError), ("2", DTypeError)):
        with pytest.raises(error, match=f"^head_groups: expected a positive int dividing Hk = 2, or None, got "
                                        f"{re.escape(repr(value))}$"):
            simulate_ring_attention(q, kv, kv, 2, head_groups=value)
