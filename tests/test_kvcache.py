"""attention_with_kvcache in the core: validation, host reads, dispatch, empty calls; the NumPy
reference against dense attention; the Triton backend's split count (the core's rule with its tiles).

The contract's cases (every layout, splits, tree masks, poison, malformed tables) are in the
conformance suite (``flashx_conformance/test_decode.py``), run against every backend.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashx
from flashx import arrays, dispatch, kvcache, registry, validation
from flashx.problem import FEATURES

RNG = np.random.default_rng(27)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def paged_call(batch=2, seqlen_q=1, heads_q=4, heads_k=2, dim=8, page_size=4, lengths=(5, 2), new=1):
    """Arguments of a valid paged call: pages handed out in order, one spare table column."""
    pages = [-(-(length + new) // page_size) for length in lengths]
    table = np.full((batch, max(pages) + 1), -1, np.int32)
    for b, count in enumerate(pages):
        table[b, :count] = np.arange(sum(pages[:b]), sum(pages[: b + 1]))
    caches = [randn(sum(pages) + 1, page_size, heads_k, dim) for _ in range(2)]
    return dict(q=randn(batch, seqlen_q, heads_q, dim), k_cache=caches[0], v_cache=caches[1],
                cache_seqlens=np.array(lengths, np.int32), k_new=randn(batch, new, heads_k, dim),
                v_new=randn(batch, new, heads_k, dim), block_table=table)


def dense(q, k, v, causal=True):
    """Plain float64 attention, bottom-right causal: (o, lse)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(q.shape[-1])
    if causal:
        scores[:, np.arange(k.shape[0])[None, :] > np.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]] = -np.inf
    lse = np.logaddexp.reduce(scores, axis=-1)
    return np.einsum("hij,jhd->ihd", np.exp(scores - lse[..., None]), v), lse


class Recorder(flashx.Backend):
    """Decodes to constants and keeps what it received."""

    devices = frozenset({"cpu"})

    def __init__(self, name="recorder"):
        self.name, self.received = name, []

    def priority(self, problem):
        return 50

    def decode(self, problem, q, k_cache, v_cache, k_new, v_new):
        self.received.append(problem)
        return np.zeros(problem.o_shape, np.float32), np.zeros(problem.lse_shape, np.float32)


class AttentionOnly(flashx.Backend):
    name = "attention-only"
    devices = frozenset({"cpu"})


@pytest.fixture
def only(monkeypatch):
    """Only the backends a test registers."""
    registry.reset()
    for name in list(registry.backends()):
        registry.unregister(name)
    monkeypatch.delenv("FLASHX_BACKEND", raising=False)

    def register(*backends):
        for backend in backends:
            registry.register(backend)
        return backends[0]

    yield register
    registry.reset()


def test_numpy_reference_matches_dense_attention_in_every_layout():
    """The new token lands in its slot, and each sequence attends to its own keys in order."""
    call = paged_call(lengths=(9, 0), new=2, seqlen_q=2, page_size=3)
    o, lse = flashx.attention_with_kvcache(**call, return_lse=True, num_splits=3, backend="numpy")
    for b, length in enumerate((9, 0)):
        positions = np.arange(length + 2)
        where = call["block_table"][b, positions // 3], positions % 3
        assert np.array_equal(call["k_cache"][where][length:], call["k_new"][b])
        expected_o, expected_lse = dense(call["q"][b], call["k_cache"][where], call["v_cache"][where])
        assert np.abs(o[b] - expected_o).max() < 1e-5 and np.abs(lse[b] - expected_lse).max() < 1e-5


def test_numpy_reference_is_bitwise_the_same_contiguous_and_paged():
    call = paged_call(lengths=(6, 3), new=1, page_size=2)
    contiguous = {name: np.zeros((2, 12) + call[name].shape[2:], np.float32) for name in ("k_cache", "v_cache")}
    for b in range(2):
        positions = np.arange(call["cache_seqlens"][b])
        for name in contiguous:
            contiguous[name][b, positions] = call[name][call["block_table"][b, positions // 2], positions % 2]
    paged = flashx.attention_with_kvcache(**call, backend="numpy")
    flat = flashx.attention_with_kvcache(**{**call, **contiguous, "block_table": None}, backend="numpy")
    assert np.array_equal(paged, flat)


def test_validate_false_reads_no_device_value(only, monkeypatch):
    """The caller's promise is taken: no length or table is read on the host, whatever it holds."""
    recorder = only(Recorder())
    monkeypatch.setattr(arrays, "to_host", lambda x: pytest.fail("validate=False read an array on the host"))
    call = paged_call()
    call["cache_seqlens"][0] = -7
    flashx.attention_with_kvcache(**call, validate=False)
    assert recorder.received[-1].validated is False


def test_validate_reads_lengths_and_table_once(only, monkeypatch):
    only(Recorder())
    reads = []
    to_host = arrays.to_host
    monkeypatch.setattr(arrays, "to_host", lambda x: reads.append(x.shape) or to_host(x))
    call = paged_call()
    flashx.attention_with_kvcache(**call)
    assert reads == [(2,), call["block_table"].shape]
    reads.clear()
    flashx.attention_with_kvcache(**{**call, "block_table": None, "k_cache": randn(2, 9, 2, 8), "v_cache": randn(2, 9, 2, 8)})
    assert reads == [(2,)]


def test_lengths_and_tables_reach_the_backend_as_int32(only):
    recorder = only(Recorder())
    call = paged_call()
    flashx.attention_with_kvcache(**{**call, "cache_seqlens": call["cache_seqlens"].astype(np.uint8),
                                     "block_table": call["block_table"].astype(np.int64)})
    problem = recorder.received[-1]
    assert problem.cache_seqlens.dtype == np.int32 and problem.block_table.dtype == np.int32
    assert (problem.page_size, problem.capacity, problem.new_tokens, problem.num_pages) == (4, 12, 1, 4)


def test_a_backend_without_decode_declines_with_its_reason(only):
    only(AttentionOnly())
    call = paged_call()
    with pytest.raises(flashx.UnsupportedError, match="attention-only.*does not implement decoding with a KV cache"):
        flashx.attention_with_kvcache(**call)
    assert kvcache.explain(**call).chosen is None
    only(Recorder())
    assert kvcache.explain(**call).chosen == "recorder"


def test_dispatch_is_remembered_per_static_description(only, monkeypatch):
    only(Recorder())
    choices = []
    choose = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda problem, backend: choices.append(problem) or choose(problem, backend))
    call = paged_call()
    for lengths in ((5, 2), (6, 3), (0, 0)):
        flashx.attention_with_kvcache(**{**call, "cache_seqlens": np.array(lengths, np.int32)})
    assert len(choices) == 1
    flashx.attention_with_kvcache(**call, causal=False)
    only(Recorder("later"))  # the registry changed: chosen again
    flashx.attention_with_kvcache(**call)
    assert len(choices) == 3


@pytest.mark.parametrize("batch, seqlen_q, new, calls", [(0, 1, 1, 0), (2, 0, 0, 0), (2, 0, 1, 1)])
def test_empty_calls(only, batch, seqlen_q, new, calls):
    """Nothing to compute and nothing to write: answered by the core; new tokens still go to the backend."""
    recorder = only(Recorder())
    call = paged_call(batch=2, new=max(new, 1))
    call = {**call, "q": call["q"][:batch, :seqlen_q], "cache_seqlens": call["cache_seqlens"][:batch],
            "block_table": call["block_table"][:batch]}
    call["k_new"], call["v_new"] = (call[name][:batch, :new] if new else None for name in ("k_new", "v_new"))
    o, lse = flashx.attention_with_kvcache(**call, return_lse=True)
    assert o.shape == (batch, seqlen_q, 4, 8) and lse.shape == (batch, 4, seqlen_q)
    assert len(recorder.received) == calls
    assert (lse == -np.inf).all()


def test_problem_description():
    problem = validation.build_decode_problem(**paged_call(), window=(3, 2), num_splits=2)
    assert problem.band == (3, 0) and problem.features == {"causal", "window", "gqa"}
    assert "paged cache of 4 pages x 4 slots" in problem.describe() and "num_splits=2" in problem.describe()


def test_score_modifications_reach_the_problem_and_are_declared():
    """softcap, ALiBi slopes and sinks reach the decoding problem checked as attention checks them
    (slopes and sinks of any floating dtype in the lse's), show in explain, and a backend that keeps
    the default declaration declines them with one reason each; the NumPy reference declares them."""
    call = paged_call()
    slopes, sinks = np.array([[0.5, 0.25, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]]), np.zeros(4, np.float16)
    registry.register(Recorder())
    try:
        explanation = kvcache.explain(**call, softcap=2, alibi_slopes=slopes, sinks=sinks)
    finally:
        registry.unregister("recorder")
    problem = explanation.problem
    assert problem.softcap == 2.0 and type(problem.softcap) is float
    assert problem.alibi_slopes.dtype == np.float32 and problem.sinks.dtype == np.float32
    assert problem.features == {"causal", "gqa", "softcap", "alibi", "sinks"}
    assert "softcap, alibi, sinks" in problem.describe()
    rows = {row.name: row.reasons for row in explanation.rows}
    assert rows["recorder"] == tuple(f"does not support {FEATURES[name]}" for name in ("alibi", "sinks", "softcap"))
    assert rows["numpy"] == () and explanation.chosen == "numpy"


def test_numpy_declines_writing_a_torch_bfloat16_cache():
    torch = pytest.importorskip("torch")
    call = {name: torch.from_numpy(x) for name, x in paged_call().items()}
    for name in ("q", "k_cache", "v_cache", "k_new", "v_new"):
        call[name] = call[name].bfloat16()
    with pytest.raises(flashx.UnsupportedError, match="cannot write new tokens into a torch bfloat16 cache"):
        flashx.attention_with_kvcache(**call, backend="numpy")
    o = flashx.attention_with_kvcache(**{**call, "k_new": None, "v_new": None}, backend="numpy")
    assert o.dtype == torch.bfloat16


@pytest.mark.parametrize("batch, paged, expected", [
    (1, False, 32),  # 8 programs, two an SM on 132 SMs: 32 splits make one wave of 256
    (16, False, 2),
    (32, False, 1),  # 256 programs fill the SMs alone
    (1, True, 32),  # paged: the same tiles, so the same splits
    (16, True, 2),
])
def test_triton_split_choice(monkeypatch, batch, paged, expected):
    """The core's rule (``flashx.splits``) with the Triton kernel's tiles and programs an SM, on an
    H100's 132 SMs of 227 KB, bf16 at d128 over a cache of 64k keys."""
    pytest.importorskip("triton")
    import torch

    from flashx_triton import decode

    monkeypatch.setattr(decode, "_interpreting", lambda: False)
    monkeypatch.setattr(decode, "_device_size", lambda device: (132, 227 * 1024))
    q = torch.zeros(batch, 1, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(batch * 65536 // 256 if paged else batch, 256 if paged else 65536, 8, 128, dtype=torch.bfloat16)
    table = torch.arange(batch * 256, dtype=torch.int32).view(batch, 256) if paged else None
    problem = validation.build_decode_problem(q, cache, cache, cache_seqlens=torch.zeros(batch, dtype=torch.int32),
                                              block_table=table, validate=False)
    assert decode.splits(problem, torch.device("cuda")) == expected


def test_the_demo_decodes_and_checks_itself(monkeypatch, capsys):
    from flashx import cli

    assert cli._decode_demo(use_cuda=False) == 0
    out = capsys.readouterr().out
    assert "greedy tokens agree at 64 of 64" in out and out.rstrip().endswith("OK")
    decode = flashx.attention_with_kvcache
    monkeypatch.setattr(flashx, "attention_with_kvcache", lambda *args, **kw: decode(*args, **kw) + np.float32(1e-3))
    assert cli._decode_demo(use_cuda=False) == 1
    assert "FAILED: error above" in capsys.readouterr().err


# -- decoding loops: a plan per static call ----------------------------------------------------


def test_a_decoding_loop_without_validation_plans_once_and_reads_each_steps_arrays():
    """validate=False calls of one static key share a plan, which holds each call's own lengths,
    tables, slopes and sinks: every step equals a fully validated call on the same arrays."""
    from flashx import plan

    base = paged_call(lengths=(5, 2), new=0)
    slopes, sinks = randn(4) ** 2, randn(4)
    plan._decode_plans.clear()
    for step, lengths in enumerate(((5, 2), (8, 4), (3, 1))):  # within the pages the table gives
        call = dict(base, cache_seqlens=np.array(lengths, np.int32), alibi_slopes=slopes + step, sinks=sinks - step)
        o, lse = flashx.attention_with_kvcache(**call, validate=False, return_lse=True)
        expected_o, expected_lse = flashx.attention_with_kvcache(**call, return_lse=True)
        np.testing.assert_array_equal(o, expected_o)
        np.testing.assert_array_equal(lse, expected_lse)
    assert len(plan._decode_plans) == 1


def test_a_remembered_decoding_plan_holds_no_callers_arrays():
    import weakref

    from flashx import plan

    plan._decode_plans.clear()
    call = paged_call(new=0)
    lengths, table = call.pop("cache_seqlens"), call.pop("block_table")
    flashx.attention_with_kvcache(**call, cache_seqlens=lengths, block_table=table, validate=False)
    held = weakref.ref(lengths), weakref.ref(table)
    del lengths, table
    assert [ref() for ref in held] == [None, None]
    assert len(plan._decode_plans) == 1


def test_a_remembered_decoding_plan_still_checks_each_calls_arrays():
    call = paged_call(new=0)
    flashx.attention_with_kvcache(**call, validate=False)
    with pytest.raises(flashx.DTypeError, match="cache_seqlens: expected an integer dtype, got float32"):
        flashx.attention_with_kvcache(**dict(call, cache_seqlens=call["cache_seqlens"].astype(np.float32)),
                                      validate=False)
    with pytest.raises(flashx.ShapeError, match=r"sinks: expected shape \(4,\), got \(3,\)"):
        flashx.attention_with_kvcache(**call, sinks=randn(3), validate=False)
    with pytest.raises(flashx.DTypeError, match="k_descale: only for an FP8 cache"):
        flashx.attention_with_kvcache(**call, k_descale=np.ones((2, 2), np.float32), validate=False)


def test_a_remembered_decoding_plan_still_refuses_a_negated_cache():
    torch = pytest.importorskip("torch")
    call = {name: torch.from_numpy(x) if isinstance(x, np.ndarray) else x for name, x in paged_call(new=0).items()}
    flashx.attention_with_kvcache(**call, validate=False)
    negated = torch.complex(torch.zeros_like(call["k_cache"]), -call["k_cache"]).conj().imag  # a lazy negation
    assert negated.is_neg() and negated.shape == call["k_cache"].shape
    with pytest.raises(flashx.DTypeError, match="k_cache: expected a tensor that can be written in place"):
        flashx.attention_with_kvcache(**dict(call, k_cache=negated), validate=False)
