"""The core contract: validation errors, dispatch, plugin discovery, DLPack, autograd, merging."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import flashx
from flashx import registry
from flashx.problem import FEATURES
from flashx_conformance import oracle

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(1234)


def randn(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def qkv(batch=2, seqlen_q=5, seqlen_k=7, heads_q=4, heads_k=2, dim=8, dim_v=None, dtype=np.float32):
    return (
        randn(batch, seqlen_q, heads_q, dim, dtype=dtype),
        randn(batch, seqlen_k, heads_k, dim, dtype=dtype),
        randn(batch, seqlen_k, heads_k, dim_v or dim, dtype=dtype),
    )


class Marker(flashx.Backend):
    """Answers with a constant so a test can tell which backend ran; records what it received."""

    devices = frozenset({"cpu"})

    def __init__(self, name, priority=0, features=frozenset(FEATURES), unavailable=None, fail=False):
        self.name, self._priority, self.features = name, priority, frozenset(features)
        self._unavailable, self._fail = unavailable, fail
        self.received = None

    def available(self):
        return self._unavailable

    def priority(self, problem):
        return self._priority

    def forward(self, problem, q, k, v):
        if self._fail:
            raise RuntimeError(f"{self.name} broke")
        self.received = (problem, q, k, v)
        o = np.full(problem.o_shape, float(self._priority + 1), dtype=np.float32)
        return o, np.full(problem.lse_shape, 0.5, dtype=np.float32)


@pytest.fixture
def fresh_registry(monkeypatch):
    """Only the backends a test registers (entry points still discovered, then removed)."""
    registry.reset()
    for name in list(registry.backends()):
        registry.unregister(name)
    monkeypatch.delenv("FLASHX_BACKEND", raising=False)
    yield registry
    registry.reset()


# -- validation: every error class, each naming the argument ------------------------------


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda q, k, v: ([1.0], k, v, {}), flashx.DTypeError, "q: expected a NumPy array"),
        (lambda q, k, v: (q.astype(np.int32), k, v, {}), flashx.DTypeError, "q: expected one of"),
        (lambda q, k, v: (q, k.astype(np.float64), v, {}), flashx.DTypeError, "k: expected the dtype of q"),
        (lambda q, k, v: (q, torch.from_numpy(k), v, {}), flashx.DTypeError, "k: expected a numpy array"),
        (lambda q, k, v: (q[0], k, v, {}), flashx.ShapeError, "q: expected (B, N, H, D)"),
        (lambda q, k, v: (q, k[..., :4], v, {}), flashx.ShapeError, "k: expected head dim 8"),
        (lambda q, k, v: (q, k, v[:, :3], {}), flashx.ShapeError, "v: expected shape"),
        (lambda q, k, v: (q[:, :, :3], k, v, {}), flashx.ShapeError, "k: expected a head count dividing"),
        (lambda q, k, v: (q, k[:1], v[:1], {}), flashx.ShapeError, "k: expected batch 2"),
        (lambda q, k, v: (q, k, v, {"causal": 1}), flashx.DTypeError, "causal: expected a bool"),
        (lambda q, k, v: (q, k, v, {"window": (3,)}), flashx.OptionError, "window: expected (left, right)"),
        (lambda q, k, v: (q, k, v, {"window": (-2, 0)}), flashx.OptionError, "window"),
        (lambda q, k, v: (q, k, v, {"window": (-3, 0)}), flashx.OptionError, "window: expected (left, right) ints >= -1"),
        (lambda q, k, v: (q, k, v, {"softmax_scale": float("nan")}), flashx.OptionError, "softmax_scale: expected a finite real"),
        (lambda q, k, v: (q, k, v, {"softmax_scale": "0.5"}), flashx.DTypeError, "softmax_scale"),
        (lambda q, k, v: (q, k, v, {"dropout_p": "0.1"}), flashx.DTypeError, "dropout_p: expected a number"),
        (lambda q, k, v: (q, k, v, {"window": "left"}), flashx.DTypeError, "window: expected (left, right)"),
        (lambda q, k, v: (q[..., :0], k[..., :0], v, {}), flashx.ShapeError, "q: expected a head dim D >= 1"),
        (lambda q, k, v: (q, k, v, {"dropout_p": 1.0}), flashx.OptionError, "dropout_p: expected a number in [0, 1)"),
        (lambda q, k, v: (q, k, v, {"dropout_p": 1.5}), flashx.OptionError, "dropout_p: expected a number in [0, 1), got 1.5"),
        (lambda q, k, v: (q, k, v, {"seed": -1, "dropout_p": 0.1}), flashx.OptionError, "seed"),
        (lambda q, k, v: (q, k, v, {"rng_offset": 2**64}), flashx.OptionError, "rng_offset"),
        (lambda q, k, v: (q, k, v, {"rng_offset": -1}), flashx.OptionError, "rng_offset: expected an int in [0, 2**64), got -1"),
        (
            lambda q, k, v: (q, k, v, {"dropout_p": 0.1, "seed": 1, "dropout_offsets": (0, -1)}),
            flashx.OptionError,
            "dropout_offsets: expected (row, key) ints in [0, 2**31)",
        ),
        (lambda q, k, v: (q, k, v, {"mask": np.ones((5, 7))}), flashx.DTypeError, "mask: expected a bool array"),
        (lambda q, k, v: (q, k, v, {"mask": np.ones((3, 5, 7), bool)}), flashx.ShapeError, "mask: expected a shape broadcastable"),
        (
            lambda q, k, v: (q, k, v, {"block_mask": flashx.BlockMask(np.ones((1, 3), bool), 4)}),
            flashx.ShapeError,
            "block_mask.blocks: expected a shape broadcastable to (2, 4, 2, 2)",
        ),
        (lambda q, k, v: (q, k, v, {"block_mask": np.ones((2, 2), bool)}), flashx.DTypeError, "block_mask: expected a flashx.BlockMask"),
        (lambda q, k, v: (q, k, v, {"seqlens_q": np.array([6, 1], np.int32)}), flashx.ShapeError, "seqlens_q: expected lengths in [0, 5]"),
        (lambda q, k, v: (q, k, v, {"seqlens_k": np.array([1.0, 2.0])}), flashx.DTypeError, "seqlens_k: expected an integer dtype"),
        (lambda q, k, v: (q, k, v, {"seqlens_k": np.array([1], np.int32)}), flashx.ShapeError, "seqlens_k: expected shape (2,)"),
        (lambda q, k, v: (q, k, v, {"max_seqlen_q": 5}), flashx.ShapeError, "max_seqlen_q: only meaningful with cu_seqlens"),
        (lambda q, k, v: (q, k, v, {"softcap": -1.0}), flashx.OptionError, "softcap"),
        (lambda q, k, v: (q, k, v, {"sinks": np.zeros(4, np.int32)}), flashx.DTypeError, "sinks: expected a floating dtype"),
        (lambda q, k, v: (q, k, v, {"sinks": np.zeros((2, 4))}), flashx.ShapeError, "sinks: expected shape (4,), got (2, 4)"),
        (lambda q, k, v: (q, k, v, {"sinks": torch.zeros(4)}), flashx.DTypeError, "sinks: expected a numpy array"),
        (lambda q, k, v: (q, k, v, {"alibi_slopes": np.ones(4, bool)}), flashx.DTypeError, "alibi_slopes: expected a floating dtype"),
        (lambda q, k, v: (q, k, v, {"alibi_slopes": np.ones(2)}), flashx.ShapeError, "alibi_slopes: expected shape (4,) or (2, 4)"),
        (lambda q, k, v: (q, k, v, {"return_lse": "yes"}), flashx.DTypeError, "return_lse: expected a bool, got 'yes'"),
        (lambda q, k, v: (q, k, v, {"return_lse": 1}), flashx.DTypeError, "return_lse: expected a bool, got 1"),
    ],
)
def test_bad_input_names_the_argument(change, error, words):
    q, k, v, options = change(*qkv())
    with pytest.raises(error) as caught:
        flashx.attention(q, k, v, **options)
    assert words in str(caught.value)
    assert isinstance(caught.value, flashx.FlashXError)


def varlen_inputs(lengths_q=(3, 0, 4), lengths_k=(2, 5, 1)):
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    return randn(cu_q[-1], 4, 8), randn(cu_k[-1], 2, 8), randn(cu_k[-1], 2, 8), cu_q, cu_k


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda cu_q, cu_k: {"cu_seqlens_q": cu_q}, flashx.ShapeError, "cu_seqlens_k: expected an integer array"),
        (lambda cu_q, cu_k: {"cu_seqlens_q": cu_q.astype(np.float32), "cu_seqlens_k": cu_k}, flashx.DTypeError, "cu_seqlens_q: expected an integer dtype"),
        (lambda cu_q, cu_k: {"cu_seqlens_q": cu_q[::-1].copy(), "cu_seqlens_k": cu_k}, flashx.ShapeError, "cu_seqlens_q: expected offsets starting at 0"),
        (lambda cu_q, cu_k: {"cu_seqlens_q": cu_q + np.int32(1), "cu_seqlens_k": cu_k}, flashx.ShapeError, "cu_seqlens_q"),
        (lambda cu_q, cu_k: {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k[:-1]}, flashx.ShapeError, "cu_seqlens_k: expected shape (4,)"),
        (lambda cu_q, cu_k: {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 3}, flashx.ShapeError, "max_seqlen_q: expected an int >= the longest sequence (4)"),
        (lambda cu_q, cu_k: {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "mask": np.ones((1, 1), bool)}, flashx.ShapeError, "mask: indexes the padded layout"),
    ],
)
def test_bad_varlen_input_names_the_argument(change, error, words):
    q, k, v, cu_q, cu_k = varlen_inputs()
    with pytest.raises(error) as caught:
        flashx.attention(q, k, v, **change(cu_q, cu_k))
    assert words in str(caught.value)


def test_device_mismatch_is_a_device_error():
    q, k, v = (torch.from_numpy(x) for x in qkv())
    with pytest.raises(flashx.DeviceError, match="k: expected an array on q's device cpu, got one on meta"):
        flashx.attention(q, k.to("meta"), v)


def test_varlen_problem_shapes(fresh_registry):
    backend = Marker("only")
    registry.register(backend)
    q, k, v, cu_q, cu_k = varlen_inputs()
    o, lse = flashx.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    problem = backend.received[0]
    assert (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.total_q, problem.total_k) == (3, 4, 5, 7, 8)
    assert o.shape == (7, 4, 8) and lse.shape == (4, 7)


def test_a_packed_call_says_whether_rows_lie_past_its_sequences(fresh_registry):
    """Each packed call's problem, a remembered plan's too, says whether rows of q or k lie past
    cu_seqlens[-1] (rows_past_sequences): where none do, a backend's kernels write every output
    element, and it allocates them without filling them first. Its static key is the same either way."""
    backend = Marker("only")
    registry.register(backend)
    q, k, v, _, _ = varlen_inputs()  # 7 query rows, 8 key rows
    keys = set()
    for cu_q, cu_k, past in (([0, 3, 7], [0, 5, 8], False), ([0, 2, 6], [0, 5, 8], True),
                             ([0, 3, 7], [0, 2, 7], True), ([0, 4, 7], [0, 5, 8], False)):  # the same longest
        flashx.attention(q, k, v, cu_seqlens_q=np.array(cu_q, np.int32), cu_seqlens_k=np.array(cu_k, np.int64))
        problem = backend.received[0]
        assert problem.rows_past_sequences is past, (cu_q, cu_k)
        keys.add(problem.static_key)
    assert len(keys) == 1


def recorded_calls(monkeypatch, module, name) -> list:
    """``module.name`` patched to record each call's first argument, then to run as before."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda first, *rest: calls.append(first) or real(first, *rest))
    return calls


def test_self_attention_reads_its_one_offsets_array_once(fresh_registry, monkeypatch):
    """On a GPU each read of offsets on the host is a synchronization: cu_seqlens_q given again
    as cu_seqlens_k is read once, and a different array (or another total) still on its own."""
    from flashx import validation

    backend = Marker("only")
    registry.register(backend)
    reads = recorded_calls(monkeypatch, validation, "_cu_seqlens")  # their sides
    q, k, v, cu_q, _ = varlen_inputs()
    k, v = k[: q.shape[0]], v[: q.shape[0]]
    flashx.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q)
    shared = backend.received[0]
    flashx.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q)  # the remembered plan's path
    assert reads == ["q", "q"]
    flashx.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q.copy())
    assert reads[2:] == ["q", "k"]
    apart = backend.received[0]
    assert (shared.seqlen_k, shared.total_k) == (apart.seqlen_k, apart.total_k) == (shared.seqlen_q, shared.total_q)
    assert np.array_equal(shared.cu_seqlens_k, apart.cu_seqlens_k)


def test_packed_calls_plan_once_per_longest_lengths(fresh_registry, monkeypatch):
    """A training loop's packed batches have other longest sequences from step to step, and each
    longest lengths are another static problem: one plan each (its problem built, its backend
    chosen), which later calls with those lengths reuse, with their own offsets."""
    from flashx import plan

    backend = Marker("only")
    registry.register(backend)
    built = recorded_calls(monkeypatch, plan, "_template")  # the problems remembered
    q, k, v, _, _ = varlen_inputs()
    batches = [(3, 0, 4), (1, 5, 1), (4, 2, 1), (1, 5, 1), (2, 1, 4)]  # longest 4, 5, 4, 5, 4
    received = []
    for lengths in batches:
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        flashx.attention(q, k[:7], v[:7], cu_seqlens_q=cu, cu_seqlens_k=cu)
        received.append(backend.received[0])
    assert [p.seqlen_q for p in received] == [4, 5, 4, 5, 4]
    assert len(built) == 2  # the key's first call, then longest 5
    assert received[1].static_key is received[3].static_key  # one plan, its derived values reused
    assert [p.cu_seqlens_q.tolist()[-2] for p in received] == [3, 6, 6, 6, 3]


# -- dispatch --------------------------------------------------------------------------------


def test_auto_picks_the_highest_priority_that_supports_the_problem(fresh_registry):
    for backend in (Marker("low", 1), Marker("high", 5, features={"gqa"}), Marker("gone", 9, unavailable="no device")):
        registry.register(backend)
    q, k, v = qkv()
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 6.0  # "high"
    assert flashx.attention(q, k, v, causal=True)[0, 0, 0, 0] == 2.0  # "high" cannot do causal
    assert flashx.explain(q, k, v, causal=True).chosen == "low"


def test_explicit_backend_never_falls_back(fresh_registry):
    registry.register(Marker("low", 1))
    registry.register(Marker("high", 5, features={"gqa"}))
    q, k, v = qkv()
    with pytest.raises(flashx.UnsupportedError, match="backend 'high' cannot run .*does not support causal masking"):
        flashx.attention(q, k, v, causal=True, backend="high")
    with pytest.raises(flashx.UnknownBackendError, match="^backend='nope': no backend named 'nope'; registered: high, low$"):
        flashx.attention(q, k, v, backend="nope")


def test_auto_never_falls_back_after_a_runtime_error(fresh_registry):
    registry.register(Marker("low", 1))
    registry.register(Marker("broken", 5, fail=True))
    with pytest.raises(RuntimeError, match="broken broke"):
        flashx.attention(*qkv())


def test_env_var_and_context_manager_set_the_default(fresh_registry, monkeypatch):
    registry.register(Marker("low", 1))
    registry.register(Marker("high", 5))
    q, k, v = qkv()
    monkeypatch.setenv("FLASHX_BACKEND", "low")
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 2.0
    with flashx.use_backend("high"):
        assert flashx.attention(q, k, v)[0, 0, 0, 0] == 6.0
        with flashx.use_backend("low"):
            assert flashx.attention(q, k, v)[0, 0, 0, 0] == 2.0
        assert flashx.attention(q, k, v, backend="low")[0, 0, 0, 0] == 2.0  # explicit beats the default
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 2.0
    with pytest.raises(flashx.UnknownBackendError, match=r"^use_backend\('nope'\): no backend named 'nope'"):
        with flashx.use_backend("nope"):
            pass


def test_an_unknown_backend_name_is_a_value_error_that_suggests_the_closest(fresh_registry, monkeypatch):
    for name in ("triton", "numpy", "numba"):
        registry.register(Marker(name))
    q, k, v = qkv()
    with pytest.raises(flashx.UnknownBackendError) as caught:
        flashx.attention(q, k, v, backend="trtion")
    assert str(caught.value) == "backend='trtion': no backend named 'trtion'; registered: numba, numpy, triton; did you mean 'triton'?"
    assert isinstance(caught.value, ValueError) and not isinstance(caught.value, NotImplementedError)
    with pytest.raises(flashx.UnknownBackendError, match=r"^use_backend\('Numpy'\): no backend named 'Numpy'; .*did you mean 'numpy'\?$"):
        with flashx.use_backend("Numpy"):
            pass
    with pytest.raises(flashx.UnknownBackendError, match="^backend='bogus': no backend named 'bogus'; registered: numba, numpy, triton$"):
        flashx.explain(q, k, v, backend="bogus")
    monkeypatch.setenv("FLASHX_BACKEND", "bogus")
    for call in (flashx.attention, flashx.attention_forward, flashx.explain):
        with pytest.raises(flashx.UnknownBackendError, match="^FLASHX_BACKEND=bogus: no backend named 'bogus'; registered: "):
            call(q, k, v)
    assert flashx.attention(q, k, v, backend="numpy")[0, 0, 0, 0] == 1.0  # an explicit name beats the environment


def test_a_backend_whose_plugin_failed_is_known_and_cannot_run(tmp_path, monkeypatch):
    fake_distribution(tmp_path, "broken-plugin", "broken_flashx_plugin", "raise ImportError('missing libcuda.so')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("FLASHX_BACKEND", raising=False)
    registry.reset()
    q, k, v = qkv()
    try:
        with pytest.raises(flashx.UnsupportedError, match="^backend 'broken-plugin' cannot run here: plugin failed to load: ImportError: missing libcuda.so"):
            flashx.attention(q, k, v, backend="broken-plugin")
        with flashx.use_backend("broken-plugin"):
            explanation = flashx.explain(q, k, v)
        assert (explanation.chosen, explanation.requested) == (None, "broken-plugin")
        assert "no: plugin failed to load: ImportError: missing libcuda.so  <- requested by use_backend('broken-plugin')" in str(explanation)
        with pytest.raises(flashx.UnknownBackendError, match="; plugins that failed to load: broken-plugin .*; did you mean 'broken-plugin'\\?$"):
            flashx.attention(q, k, v, backend="broken-plugn")
    finally:
        registry.reset()


def test_explain_reports_the_backend_a_call_requests(fresh_registry, monkeypatch):
    for backend in (Marker("low", 1), Marker("high", 5, features={"gqa"}), Marker("gone", 9, unavailable="no device")):
        registry.register(backend)
    q, k, v = qkv()
    auto = flashx.explain(q, k, v)
    assert (auto.chosen, auto.requested, auto.requested_by) == ("high", None, None)
    assert "high  yes (priority 5)  <- auto" in str(auto) and "requested" not in str(auto)

    explicit = flashx.explain(q, k, v, backend="low")
    assert (explicit.chosen, explicit.requested, explicit.requested_by) == ("low", "low", "backend='low'")
    assert "low   yes (priority 1)  <- requested by backend='low'" in str(explicit) and "<- auto" not in str(explicit)
    assert explicit.rows == auto.rows

    cannot = flashx.explain(q, k, v, causal=True, backend="high")
    assert cannot.chosen is None and cannot.requested == "high"
    assert "high  no: does not support causal masking  <- requested by backend='high'" in str(cannot)
    assert flashx.explain(q, k, v, backend="gone").chosen is None

    with flashx.use_backend("low"):
        in_context = flashx.explain(q, k, v)
        assert flashx.explain(q, k, v, backend="high").chosen == "high"  # explicit beats the default
    assert (in_context.chosen, in_context.requested_by) == ("low", "use_backend('low')")
    monkeypatch.setenv("FLASHX_BACKEND", "low")
    from_environment = flashx.explain(q, k, v)
    assert (from_environment.chosen, from_environment.requested_by) == ("low", "FLASHX_BACKEND=low")
    assert "<- requested by FLASHX_BACKEND=low" in str(from_environment)
    # what a call runs is what explain reports
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 2.0


def test_dispatch_explain_takes_the_backend_asked_for(fresh_registry):
    from flashx import dispatch
    from flashx.validation import build_problem

    registry.register(Marker("low", 1))
    registry.register(Marker("high", 5))
    problem = build_problem(*qkv())
    assert dispatch.explain(problem).chosen == "high"
    assert dispatch.explain(problem, "low").chosen == "low"
    with flashx.use_backend("low"):
        assert dispatch.explain(problem, "auto").requested_by == "use_backend('low')"
    with pytest.raises(flashx.UnknownBackendError, match="did you mean 'low'"):
        dispatch.explain(problem, "lwo")


def test_nothing_fits_lists_every_backend_with_all_reasons_once(fresh_registry):
    class TwoReasons(Marker):
        def extra_reasons(self, problem):
            return ["tile too small", "tile too small"]

    registry.register(TwoReasons("picky", 3, features=set()))
    registry.register(Marker("gone", 1, unavailable="needs a GPU"))
    q, k, v = qkv()
    with pytest.raises(flashx.UnsupportedError) as caught:
        flashx.attention(q, k, v, causal=True, dropout_p=0.1)
    message = str(caught.value)
    assert "picky  no: does not support causal masking; does not support dropout; " in message
    assert message.count("tile too small") == 1
    assert "gone   no: needs a GPU" in message


# -- plugins ---------------------------------------------------------------------------------

PLUGIN_SOURCE = """
import numpy as np
import flashx
from flashx.hookspecs import hookimpl

class Fake(flashx.Backend):
    name = "fake"
    version = "9.9"
    devices = frozenset({"cpu"})

@hookimpl
def flashx_backends():
    return [Fake()]
"""


def fake_distribution(root, name, module, source):
    """A distribution on sys.path, found by importlib.metadata like an installed one."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[flashx.backends]\n{name} = {module}\n")


def test_discovery_through_a_fake_distribution_with_a_broken_neighbour(tmp_path, monkeypatch):
    fake_distribution(tmp_path, "fake-plugin", "fake_flashx_plugin", PLUGIN_SOURCE)
    fake_distribution(tmp_path, "broken-plugin", "broken_flashx_plugin", "raise ImportError('missing libcuda.so')\n")
    fake_distribution(
        tmp_path,
        "failing-hook",
        "failing_hook_plugin",
        "from flashx.hookspecs import hookimpl\n\n@hookimpl\ndef flashx_backends():\n    raise RuntimeError('no driver')\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.reset()
    try:
        infos = {info.name: info for info in flashx.backends()}
        assert infos["fake"].version == "9.9" and infos["fake"].available and infos["fake"].plugin == "fake-plugin"
        assert not infos["broken-plugin"].available
        assert "missing libcuda.so" in infos["broken-plugin"].reason and "ImportError" in infos["broken-plugin"].load_error
        assert "no driver" in infos["failing-hook"].reason
        assert "numpy" in infos  # the built-in backends still load beside the broken ones
        with pytest.raises(flashx.UnsupportedError, match="plugins that failed to load: broken-plugin, failing-hook"):
            registry.get("missing")
    finally:
        registry.reset()


def test_discovery_is_lazy_and_imports_no_gpu_library():
    code = textwrap.dedent(
        """
        import sys, flashx
        from flashx import registry
        assert registry._registry._backends is None
        heavy = [m for m in ("torch", "triton", "cupy", "numba", "numpy") if m in sys.modules]
        assert not heavy, heavy
        names = [info.name for info in flashx.backends()]
        assert "numpy" in names, names
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_duplicate_backend_names_are_refused(fresh_registry):
    registry.register(Marker("same"))
    with pytest.raises(ValueError, match="backend name 'same' is taken"):
        registry.register(Marker("same"))
    registry.register(Marker("same", 3), replace=True)
    assert registry.get("same")._priority == 3


# -- repeated calls: the Problem and backend remembered by flashx.plan ------------------------


def test_a_repeated_call_reuses_its_problem_and_any_change_makes_a_new_one(fresh_registry):
    backend = Marker("only")
    registry.register(backend)
    q, k, v = qkv()
    flashx.attention(q, k, v)
    first = backend.received[0]
    flashx.attention(q.copy(), k.copy(), v.copy())
    assert backend.received[0] is first  # equal signature: remembered
    changes = [
        ((q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)), {}, "dtype", "float64"),
        ((q[:, :3], k, v), {}, "seqlen_q", 3),
        ((q, k, v), {"causal": True}, "causal", True),
        ((q, k, v), {"softmax_scale": 0.5}, "softmax_scale", 0.5),
        ((q, k, v), {"softmax_scale": 2}, "softmax_scale", 2.0),
        ((q, k, v), {"window": (2, 0)}, "window", (2, 0)),
        ((q, k, v), {"softcap": 30.0}, "softcap", 30.0),
        ((q, k, v), {"deterministic": True}, "deterministic", True),
        ((q, k, v), {"dropout_p": 0.25, "seed": 11}, "seed", 11),
        ((q, k, v), {"dropout_p": 0.25, "seed": 12}, "seed", 12),
    ]
    for inputs, options, field, value in changes:
        flashx.attention(*inputs, **options)
        assert getattr(backend.received[0], field) == value, (field, value)
        assert backend.received[0] is not first
    flashx.attention(q, k, v)
    assert backend.received[0] is first


def test_a_remembered_call_still_gets_its_own_arrays(fresh_registry):
    backend = Marker("only")
    registry.register(backend)
    q, k, v = qkv()
    flashx.attention(q, k, v)
    # same shape, dtype and device, other memory and strides: the backend sees this call's arrays
    q_view = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    flashx.attention(q_view, k, v)
    assert backend.received[1] is q_view and backend.received[1].strides != q.strides
    registry.reset()  # the entry points again: the numbers follow each call's arrays
    for x in (q, q_view, q * 2):
        np.testing.assert_allclose(flashx.attention(x, k, v, backend="numpy"), oracle.forward(x, k, v)[0], atol=2e-5)


def test_a_remembered_call_follows_the_backend_choice(fresh_registry, monkeypatch):
    registry.register(Marker("low", 1))
    q, k, v = qkv()
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 2.0
    registry.register(Marker("high", 5))
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 6.0
    with flashx.use_backend("low"):
        assert flashx.attention(q, k, v)[0, 0, 0, 0] == 2.0
        assert flashx.attention(q, k, v, backend="high")[0, 0, 0, 0] == 6.0
    monkeypatch.setenv("FLASHX_BACKEND", "low")
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 2.0
    monkeypatch.delenv("FLASHX_BACKEND")
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 6.0
    registry.register(Marker("high", 8), replace=True)
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 9.0
    registry.unregister("high")
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 2.0
    with pytest.raises(flashx.UnknownBackendError, match="no backend named 'high'"):
        flashx.attention(q, k, v, backend="high")
    registry.reset()  # rediscovers the entry points: the NumPy backend computes again
    np.testing.assert_allclose(flashx.attention(q, k, v), oracle.forward(q, k, v)[0], atol=2e-5)


def test_a_drawn_dropout_seed_is_drawn_again_on_every_call():
    q, k, v = (torch.from_numpy(x) for x in qkv())
    seeds = {flashx.attention_forward(q, k, v, dropout_p=0.5, backend="numpy")[1].seed for _ in range(4)}
    assert len(seeds) == 4 and 0 not in seeds
    assert flashx.attention_forward(q, k, v, dropout_p=0.5, seed=5, backend="numpy")[1].seed == 5
    assert {flashx.attention_forward(q, k, v, backend="numpy")[1].seed for _ in range(2)} == {0}


def array_option_calls():
    """Calls with array options, one kind per entry: (q, k, v, each call's options), three calls a
    kind of one static key (shapes, dtypes, options) and other contents; packed calls differ in
    their longest sequences too."""
    q, k, v = qkv(batch=2, seqlen_q=6, seqlen_k=7)
    packed = tuple(x.reshape(-1, *x.shape[2:]) for x in (q, k, v))  # 12 query rows, 14 key rows
    offsets = (([0, 5, 12], [0, 7, 14]), ([0, 2, 9], [0, 0, 11]), ([0, 6, 12], [0, 7, 14]))
    return {
        "mask": ((q, k, v), [{"mask": RNG.random((2, 1, 6, 7)) < 0.7} for _ in range(3)]),
        "block_mask": ((q, k, v), [{"block_mask": flashx.BlockMask(RNG.random((1, 4, 3, 4)) < 0.7, 2)}
                                   for _ in range(3)]),
        "seqlens": ((q, k, v), [{"seqlens_q": np.array(lengths_q, np.int32), "seqlens_k": np.array(lengths_k, np.int64)}
                                for lengths_q, lengths_k in (([6, 3], [7, 2]), ([1, 6], [5, 7]), ([0, 4], [3, 0]))]),
        "varlen": (packed, [{"cu_seqlens_q": np.array(cu_q, np.int32), "cu_seqlens_k": np.array(cu_k, np.int32)}
                            for cu_q, cu_k in offsets]),
        "alibi and sinks": ((q, k, v), [{"alibi_slopes": RNG.random(4) + 0.1, "sinks": randn(4)} for _ in range(3)]),
        "dropout with a drawn seed": ((q, k, v), [{"dropout_p": 0.3}] * 3),
        "dropout with a seed and offset a step": ((q, k, v), [{"dropout_p": 0.3, "seed": seed, "rng_offset": offset}
                                                              for seed, offset in ((1, 0), (2, 64), (2, 2**63))]),
    }


@pytest.mark.parametrize("kind", list(array_option_calls()))
def test_a_repeated_call_with_array_options_plans_once_and_equals_a_validated_call(kind, monkeypatch):
    """Calls of one static key share a plan holding each call's own arrays (and drawn seed): each
    returns what a call validated in full on the same arguments returns, and its problem has the
    static key of that call's, which backends keep their launches under."""
    from flashx import plan, validation
    from flashx.execute import run_forward

    (q, k, v), calls = array_option_calls()[kind]
    built = []
    monkeypatch.setattr(plan, "build_problem", lambda *args, **kw: built.append(1) or validation.build_problem(*args, **kw))
    plan._plans.clear()
    for options in calls:
        o, res = flashx.attention_forward(q, k, v, causal=True, backend="numpy", **options)
        problem, impl = plan.plan(q, k, v, "numpy", flashx.options.complete("attention", dict(options, causal=True)))
        seed = {"seed": res.seed} if "dropout_p" in options and "seed" not in options else {}
        validated = validation.build_problem(q, k, v, causal=True, **options, **seed)
        assert problem.static_key == validated.static_key
        o_validated, lse_validated = run_forward(impl, validated, q, k, v)
        np.testing.assert_array_equal(o, o_validated)
        np.testing.assert_array_equal(res.lse, lse_validated)
        np.testing.assert_allclose(o, oracle.forward(q, k, v, causal=True, **options, **seed)[0], atol=2e-5)
    assert len(built) == 1  # the first call's


def test_a_remembered_plan_still_refuses_wrong_lengths_and_masks():
    """A call of a remembered plan's key, wrong only in its arrays' contents (or its seed and RNG
    offset), meets the checks of a first call; so does one whose arrays have another dtype or shape (another key)."""
    from flashx import plan

    q, k, v = qkv(batch=2, seqlen_q=6, seqlen_k=7)
    packed = tuple(x.reshape(-1, *x.shape[2:]) for x in (q, k, v))  # 12 query rows, 14 key rows
    cu = np.array([0, 5, 12], np.int32)
    right = {"packed": dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7), "seqlens": dict(seqlens_q=np.array([6, 3], np.int32)),
             "mask": dict(mask=RNG.random((2, 1, 6, 7)) < 0.5), "dropout": dict(dropout_p=0.2, seed=5, rng_offset=0)}
    wrong_contents = [
        ("packed", dict(cu_seqlens_q=np.array([0, 7, 5], np.int32)), flashx.ShapeError,
         r"cu_seqlens_q: expected offsets starting at 0, non-decreasing, ending at most at 12 \(rows of q\), "
         r"got \[0, 7, 5\]"),
        ("packed", dict(cu_seqlens_k=np.array([1, 5, 12], np.int32)), flashx.ShapeError, "cu_seqlens_k: expected offsets starting at 0"),
        ("packed", dict(cu_seqlens_k=np.array([0, 5, 15], np.int32)), flashx.ShapeError, r"ending at most at 14 \(rows of k\)"),
        ("packed", dict(cu_seqlens_q=np.array([0, 8, 12], np.int32)), flashx.ShapeError,
         r"max_seqlen_q: expected an int >= the longest sequence \(8\), got 7"),
        ("seqlens", dict(seqlens_q=np.array([7, 3], np.int32)), flashx.ShapeError, r"seqlens_q: expected lengths in \[0, 6\], got values from 3 to 7"),
        ("seqlens", dict(seqlens_q=np.array([-1, 3], np.int32)), flashx.ShapeError, r"seqlens_q: expected lengths in \[0, 6\]"),
        ("dropout", dict(seed=-1), flashx.OptionError, r"seed: expected an int in \[0, 2\*\*64\) or None, got -1"),
        ("dropout", dict(rng_offset=2**64), flashx.OptionError, r"rng_offset: expected an int in \[0, 2\*\*64\)"),
    ]
    for layout, options, error, message in wrong_contents:
        inputs = packed if layout == "packed" else (q, k, v)
        flashx.attention(*inputs, backend="numpy", **right[layout])
        call = dict(right[layout], **options)
        assert plan._key(*inputs, "numpy", flashx.options.complete("attention", call)) in plan._plans
        with pytest.raises(error, match=message):
            flashx.attention(*inputs, backend="numpy", **call)
    wrong_arrays = [
        ("packed", dict(cu_seqlens_q=cu.astype(np.float32)), flashx.DTypeError,
         "cu_seqlens_q: expected an integer dtype, got float32"),
        ("seqlens", dict(seqlens_q=np.array([6, 3], np.float64)), flashx.DTypeError,
         "seqlens_q: expected an integer dtype, got float64"),
        ("mask", dict(mask=RNG.random((2, 1, 6, 7))), flashx.DTypeError, "mask: expected a bool array"),
        ("mask", dict(mask=RNG.random((3, 1, 6, 7)) < 0.5), flashx.ShapeError,
         r"mask: expected a shape broadcastable to \(2, 4, 6, 7\), got \(3, 1, 6, 7\)"),
    ]
    for layout, options, error, message in wrong_arrays:
        inputs = packed if layout == "packed" else (q, k, v)
        flashx.attention(*inputs, backend="numpy", **right[layout])
        with pytest.raises(error, match=message):
            flashx.attention(*inputs, backend="numpy", **dict(right[layout], **options))


def test_a_remembered_call_checks_its_lengths_and_offsets_by_value_only(monkeypatch):
    """The key of a remembered plan holds the type, shape, dtype and device of its lengths and
    offsets, which the call that made it checked: a repeated call reads their values on the host
    and checks those, and checks nothing else of them again."""
    from flashx import validation

    q, k, v = qkv(batch=2, seqlen_q=6, seqlen_k=7)
    packed = tuple(x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    calls = {"seqlens": ((q, k, v), dict(seqlens_q=np.array([6, 3], np.int32), seqlens_k=np.array([7, 2], np.int64))),
             "packed": (packed, dict(cu_seqlens_q=np.array([0, 5, 12], np.int32),
                                     cu_seqlens_k=np.array([0, 7, 14], np.int32)))}
    checked = []
    same_array_as_q = validation._same_array_as_q
    monkeypatch.setattr(validation, "_same_array_as_q",
                        lambda name, *rest: checked.append(name) or same_array_as_q(name, *rest))
    for inputs, options in calls.values():
        flashx.attention(*inputs, backend="numpy", **options)
        checked.clear()
        flashx.attention(*inputs, backend="numpy", **options)
        assert not set(checked) & set(options), checked


@pytest.mark.parametrize("batch", [3, 70])
def test_validate_false_reads_no_values(batch, monkeypatch):
    """validate=False: lengths, offsets with both max_seqlen hints and FP8 descales reach the
    backend unread (no host copy, so a GPU call needs no synchronization), a few values or many,
    and the problem takes the hints as its longest sequences with rows past the last sequence
    assumed; without the hints the offsets are still read, since they size the launch. With
    validate=True the same calls read them, and refuse values out of range."""
    from flashx import arrays, validation

    reads = []

    def counted(x):
        reads.append(x.shape)
        return to_host(x)

    to_host = arrays.to_host
    monkeypatch.setattr(arrays, "to_host", counted)
    monkeypatch.setattr(validation, "_FEW_VALUES", -1)  # every read through to_host
    q, k, v = qkv(batch=batch, seqlen_q=6, seqlen_k=7)
    lengths = {"seqlens_q": np.full(batch, 6, np.int32), "seqlens_k": np.arange(batch, dtype=np.int64) % 8}
    cu = np.arange(batch + 1, dtype=np.int32) * 4
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    hints = {"max_seqlen_q": 5, "max_seqlen_k": 5}
    calls = [((q, k, v), lengths), (packed, dict(cu_seqlens_q=cu, cu_seqlens_k=cu, **hints))]
    for inputs, options in calls:
        problem = validation.build_problem(*inputs, validate=False, **options)
        assert not reads
        assert problem.seqlens_q is not None or (problem.seqlen_q, problem.rows_past_sequences) == (5, True)
        validation.build_problem(*inputs, **options)
        assert reads
        reads.clear()
    validation.build_problem(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu, validate=False)
    assert reads  # no hints: the offsets size the launch
    too_long = dict(lengths, seqlens_k=np.full(batch, 8, np.int32))
    with pytest.raises(flashx.ShapeError, match="seqlens_k"):
        validation.build_problem(q, k, v, **too_long)
    assert validation.build_problem(q, k, v, validate=False, **too_long).seqlens_k is not None
    torch = pytest.importorskip("torch")
    fp8 = [torch.from_numpy(x).to(torch.float8_e4m3fn) for x in (q, k, v)]
    scales = {name: torch.full((batch, k.shape[2]), 0.5) for name in ("q_descale", "k_descale", "v_descale")}
    reads.clear()
    validation.build_problem(*fp8, validate=False, **scales)
    assert not reads
    validation.build_problem(*fp8, **scales)
    assert len(reads) == 3


@pytest.mark.parametrize("batch", [3, 70])
def test_lengths_and_offsets_are_checked_alike_for_a_few_sequences_and_many(batch):
    """Up to validation._FEW_VALUES values are checked as Python ints, more in NumPy: either way
    the same longest sequences and the same errors, for offsets whose int32 differences would
    wrap and for uint64 lengths past int64's range too."""
    from flashx import validation

    assert (batch <= validation._FEW_VALUES) == (batch == 3)
    q, k, v = qkv(batch=batch, seqlen_q=4, seqlen_k=5, heads_q=1, heads_k=1, dim=2)
    lengths = np.arange(batch, dtype=np.int32) % 5
    problem = validation.build_problem(q, k, v, seqlens_k=lengths)
    assert problem.seqlens_k.tolist() == lengths.tolist()
    largest = lengths.astype(np.uint64)
    largest[lengths == 1] = 2**64 - 1
    for bad, shown in ((np.where(lengths == 2, 6, lengths), "from 0 to 6"),
                       (np.where(lengths == 1, -1, lengths), f"from -1 to {lengths.max()}"), (largest, "from ")):
        with pytest.raises(flashx.ShapeError, match=rf"seqlens_k: expected lengths in \[0, 5\], got values {shown}"):
            validation.build_problem(q, k, v, seqlens_k=bad)
    packed = tuple(x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    problem = validation.build_problem(*packed, cu_seqlens_q=offsets, cu_seqlens_k=offsets)
    longest = int(lengths.max())
    assert (problem.seqlen_q, problem.seqlen_k) == (longest, longest)
    wrapping = offsets.copy()
    wrapping[1:] = [2**31 - 1, -2**31] + [0] * (batch - 2)  # an int32 difference would wrap to a length of 1
    for bad in (offsets + 1, offsets[::-1].copy(), np.append(offsets[:-1], 4 * batch + 1).astype(np.int32), wrapping):
        with pytest.raises(flashx.ShapeError, match="cu_seqlens_q: expected offsets starting at 0, non-decreasing"):
            validation.build_problem(*packed, cu_seqlens_q=bad, cu_seqlens_k=offsets)
    with pytest.raises(flashx.ShapeError, match=rf"max_seqlen_q: expected an int >= the longest sequence \({longest}\)"):
        validation.build_problem(*packed, cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=longest - 1)


def test_the_remembered_plans_hold_no_callers_arrays():
    import weakref

    from flashx import plan

    q, k, v = qkv()
    mask = RNG.random((2, 1, 5, 7)) < 0.7
    flashx.attention(q, k, v, mask=mask, backend="numpy")
    flashx.attention(q, k, v, mask=mask, backend="numpy")
    held = weakref.ref(mask)
    del mask
    assert held() is None
    assert len(plan._plans) >= 1


@pytest.mark.parametrize(
    "valid, invalid, error, words",
    [
        ({"causal": True}, {"causal": 1}, flashx.DTypeError, "causal: expected a bool"),
        ({"deterministic": False}, {"deterministic": 0}, flashx.DTypeError, "deterministic: expected a bool"),
        ({"softmax_scale": 1.0}, {"softmax_scale": True}, flashx.DTypeError, "softmax_scale"),
        ({"window": (1, 1)}, {"window": (1, True)}, flashx.DTypeError, "window: expected (left, right)"),
        ({"window": (1, 2)}, {"window": (1.0, 2)}, flashx.DTypeError, "window: expected (left, right)"),
        ({"dropout_p": 0.0}, {"dropout_p": False}, flashx.DTypeError, "dropout_p: expected a number"),
        ({"seed": 1}, {"seed": True}, flashx.DTypeError, "seed: expected an int"),
        ({"rng_offset": 0}, {"rng_offset": 0.0}, flashx.DTypeError, "rng_offset: expected an int"),
        ({"backend": "numpy"}, {"backend": None}, flashx.DTypeError, "backend: expected a backend name"),
        ({"backend": "numpy"}, {"backend": "nmupy"}, flashx.UnknownBackendError, "did you mean 'numpy'?"),
        ({}, {"max_seqlen_q": 5}, flashx.ShapeError, "max_seqlen_q: only meaningful with cu_seqlens"),
        ({"dropout_p": 0.5, "seed": 1}, {"dropout_p": 1.5, "seed": 1}, flashx.OptionError, "dropout_p: expected a number in [0, 1)"),
        ({"dropout_p": 0.5, "seed": 1}, {"dropout_p": np.float64(1.5), "seed": 1}, flashx.OptionError, "got 1.5"),
        ({"rng_offset": np.uint64(3)}, {"rng_offset": np.int64(-1)}, flashx.OptionError, "rng_offset: expected an int in"),
        ({"window": (3, 0)}, {"window": (-3, 0)}, flashx.OptionError, "window: expected (left, right)"),
        ({"causal": np.True_}, {"causal": np.int64(1)}, flashx.DTypeError, "causal: expected a bool, got 1"),
        ({"return_lse": False}, {"return_lse": "yes"}, flashx.DTypeError, "return_lse: expected a bool"),
    ],
)
def test_a_wrong_call_raises_after_a_similar_right_one(valid, invalid, error, words):
    q, k, v = qkv()
    for _ in range(2):
        assert flashx.attention(q, k, v, **valid).shape == (2, 5, 4, 8)
        with pytest.raises(error) as caught:
            flashx.attention(q, k, v, **invalid)
        assert words in str(caught.value)


def test_a_remembered_call_meets_a_changed_environment(fresh_registry, monkeypatch):
    registry.register(Marker("low", 1))
    q, k, v = qkv()
    monkeypatch.setenv("FLASHX_BACKEND", "low")
    assert flashx.attention(q, k, v)[0, 0, 0, 0] == 2.0
    monkeypatch.setenv("FLASHX_BACKEND", "lwo")
    with pytest.raises(flashx.UnknownBackendError, match="^FLASHX_BACKEND=lwo: no backend named 'lwo'; registered: low; did you mean 'low'"):
        flashx.attention(q, k, v)


def test_completed_options_keep_the_declared_order_whatever_the_order_given():
    """The plan's key reads options by their declared position (``flashx.plan._key``)."""
    given = dict(validate=False, seed=np.int64(3), causal=True)
    completed = flashx.options.complete("attention", given)
    assert list(completed) == list(flashx.options.OPTIONS)
    assert completed == {**flashx.options.OPTIONS, "validate": False, "seed": 3, "causal": True}
    assert type(completed["seed"]) is int and given["seed"].dtype == np.int64  # the caller's dict as it was


def test_options_given_as_numpy_scalars_are_taken_as_python_scalars():
    q, k, v = qkv()
    python = dict(causal=True, window=(3, 0), softmax_scale=0.5, dropout_p=0.25, seed=7, rng_offset=2, dropout_offsets=(1, 2),
                  deterministic=False)
    numpy = dict(causal=np.True_, window=(np.int64(3), np.int32(0)), softmax_scale=np.float32(0.5), dropout_p=np.float64(0.25),
                 seed=np.uint64(7), rng_offset=np.int16(2), dropout_offsets=(np.int8(1), np.uint32(2)), deterministic=np.False_)
    want_o, want_lse = flashx.attention(q, k, v, return_lse=True, backend="numpy", **python)
    got_o, got_lse = flashx.attention(q, k, v, return_lse=np.True_, backend="numpy", **numpy)
    np.testing.assert_array_equal(got_o, want_o)
    np.testing.assert_array_equal(got_lse, want_lse)
    _, res = flashx.attention_forward(q, k, v, backend="numpy", **numpy)
    assert res == (res.lse, 7, 2) and type(res.seed) is int
    explanation = flashx.explain(q, k, v, backend="numpy", softcap=np.float64(20.0), **numpy)
    assert explanation.problem.softcap == 20.0 and explanation.problem.window == (3, 0) and explanation.problem.dropout_p == 0.25


def test_return_lse_must_be_a_bool_everywhere():
    q, k, v = qkv()
    o, res = flashx.attention_forward(q, k, v)
    calls = {
        "attention": lambda flag: flashx.attention(q, k, v, return_lse=flag),
        "attention_forward": lambda flag: flashx.attention_forward(q, k, v, return_lse=flag),
        "attention_backward": lambda flag: flashx.attention_backward(o, q, k, v, o, res, return_lse=flag),
        "explain": lambda flag: flashx.explain(q, k, v, return_lse=flag),
    }
    for name, call in calls.items():
        for flag, shown in (("yes", "'yes'"), (1, "1"), (None, "None"), (np.float32(1.0), "1.0")):
            with pytest.raises(flashx.DTypeError) as caught:
                call(flag)
            assert str(caught.value) == f"return_lse: expected a bool, got {shown}", name
        call(np.True_)
    assert isinstance(flashx.attention(q, k, v, return_lse=np.True_), tuple)
    assert flashx.attention(q, k, v, return_lse=np.False_).shape == (2, 5, 4, 8)


@pytest.mark.parametrize(
    "keyword, meant",
    [
        ("is_causal", "'causal'"),  # torch SDPA
        ("attn_mask", "'mask'"),
        ("scale", "'softmax_scale'"),
        ("window_size", "'window'"),  # flash-attn
        ("attn_bias", "'mask' or 'causal'"),  # xformers
        ("p", "'dropout_p'"),
        ("dropout", "'dropout_p' or 'dropout_offsets'"),  # close matches
        ("causl", "'causal'"),
        ("seqlens", "'seqlens_q' or 'seqlens_k'"),
    ],
)
def test_an_unknown_keyword_names_the_flashx_keyword_meant(keyword, meant):
    q, k, v = qkv()
    for call in (flashx.attention, flashx.attention_forward, flashx.explain):
        with pytest.raises(TypeError) as caught:
            call(q, k, v, **{keyword: 0.1})
        assert str(caught.value).startswith(f"{call.__name__}() got an unexpected keyword argument {keyword!r} (did you mean {meant}?); known: causal, ")
        assert not isinstance(caught.value, flashx.FlashXError)


def test_unknown_keywords_without_a_close_one_are_listed_as_they_are():
    with pytest.raises(TypeError, match=r"^attention\(\) got unexpected keyword arguments 'is_causal' \(did you mean 'causal'\?\), 'zzz'; known: "):
        flashx.attention(*qkv(), zzz=1, is_causal=True)


def test_an_option_error_is_a_value_error_and_no_shape_error():
    assert issubclass(flashx.OptionError, ValueError) and issubclass(flashx.OptionError, flashx.FlashXError)
    assert not issubclass(flashx.OptionError, flashx.ShapeError) and not issubclass(flashx.ShapeError, flashx.OptionError)
    q, k, v = qkv()
    with pytest.raises(ValueError) as caught:
        flashx.attention(q, k, v, softmax_scale=float("nan"))
    assert type(caught.value) is flashx.OptionError


def test_a_wrong_array_raises_after_a_right_one_of_the_same_shape():
    q, k, v = qkv()
    flashx.attention(q, k, v)
    with pytest.raises(flashx.DTypeError, match="k: expected the dtype of q"):
        flashx.attention(q, k.astype(np.float64), v)
    with pytest.raises(flashx.DTypeError, match="k: expected a numpy array like q"):
        flashx.attention(q, torch.from_numpy(k), v)
    # array options are checked on every call: their contents matter, not only their shape
    seqlens_k = np.array([7, 3], np.int32)
    flashx.attention(q, k, v, seqlens_k=seqlens_k)
    seqlens_k[0] = 9
    with pytest.raises(flashx.ShapeError, match=r"seqlens_k: expected lengths in \[0, 7\]"):
        flashx.attention(q, k, v, seqlens_k=seqlens_k)
    # the backward's checks of do, o and res.lse run on every call
    o, res = flashx.attention_forward(q, k, v)
    flashx.attention_backward(o, q, k, v, o, res)
    with pytest.raises(flashx.ShapeError, match=r"do: expected shape \(2, 5, 4, 8\), got \(2, 5, 4, 4\)"):
        flashx.attention_backward(o[..., :4], q, k, v, o, res)
    with pytest.raises(flashx.DTypeError, match="res.lse: expected dtype float32, got float64"):
        flashx.attention_backward(o, q, k, v, o, res._replace(lse=res.lse.astype(np.float64)))


def test_the_remembered_calls_are_bounded():
    from flashx import plan

    q, k, v = qkv()
    for scale in range(1, plan._LIMIT + 20):
        flashx.attention(q, k, v, softmax_scale=float(scale))
    assert 0 < len(plan._plans) <= plan._LIMIT
    assert 0 < len(plan._calls) <= plan._CALLS_LIMIT


# -- calls remembered whole: a repeated call runs the backend's prepared forward ---------------


def remembered_key(q, k, v, **options):
    """The key ``flashx.attention`` remembers a call of these arguments under (None: none)."""
    from flashx import plan

    return plan.call_key(q, k, v, options.pop("backend", "auto"), options)


@pytest.mark.parametrize(
    "field, change, error, words",
    [
        ("shape", lambda q, k, v, o: (q, k[..., :4], v, o), flashx.ShapeError, "k: expected head dim 8"),
        ("shape", lambda q, k, v, o: (q[:, :, :3], k, v, o), flashx.ShapeError, "k: expected a head count dividing"),
        ("dtype", lambda q, k, v, o: (q.int(), k, v, o), flashx.DTypeError, "q: expected one of"),
        ("dtype", lambda q, k, v, o: (q, k.double(), v, o), flashx.DTypeError, "k: expected the dtype of q"),
        ("device", lambda q, k, v, o: (q, k.to("meta"), v, o), flashx.DeviceError, "k: expected an array on q's device cpu"),
        ("kind", lambda q, k, v, o: (q, k.numpy(), v, o), flashx.DTypeError, "k: expected a torch array like q"),
        ("causal", lambda q, k, v, o: (q, k, v, dict(o, causal=1)), flashx.DTypeError, "causal: expected a bool"),
        ("window", lambda q, k, v, o: (q, k, v, dict(o, window=(2, True))), flashx.DTypeError, "window: expected"),
        ("window", lambda q, k, v, o: (q, k, v, dict(o, window=(-2, 0))), flashx.OptionError, "window: expected"),
        ("softmax_scale", lambda q, k, v, o: (q, k, v, dict(o, softmax_scale=True)), flashx.DTypeError, "softmax_scale"),
        ("softmax_scale", lambda q, k, v, o: (q, k, v, dict(o, softmax_scale=math.inf)), flashx.OptionError,
         "softmax_scale: expected a finite real"),
        ("softcap", lambda q, k, v, o: (q, k, v, dict(o, softcap=-1.0)), flashx.OptionError, "softcap"),
        ("dropout_p", lambda q, k, v, o: (q, k, v, dict(o, dropout_p=False)), flashx.DTypeError, "dropout_p: expected a number"),
        ("dropout_p", lambda q, k, v, o: (q, k, v, dict(o, dropout_p=1.5)), flashx.OptionError, "dropout_p: expected a number in"),
        ("seed", lambda q, k, v, o: (q, k, v, dict(o, seed=-1)), flashx.OptionError, "seed: expected an int"),
        ("rng_offset", lambda q, k, v, o: (q, k, v, dict(o, rng_offset=0.0)), flashx.DTypeError, "rng_offset: expected an int"),
        ("dropout_offsets", lambda q, k, v, o: (q, k, v, dict(o, dropout_offsets=(0, -1))), flashx.OptionError,
         "dropout_offsets: expected"),
        ("deterministic", lambda q, k, v, o: (q, k, v, dict(o, deterministic=0)), flashx.DTypeError,
         "deterministic: expected a bool"),
        ("validate", lambda q, k, v, o: (q, k, v, dict(o, validate=1)), flashx.DTypeError, "validate: expected a bool"),
        ("out_dtype", lambda q, k, v, o: (q, k, v, dict(o, out_dtype="bfloat16")), flashx.DTypeError,
         "out_dtype: only for FP8 inputs"),
        ("max_seqlen_q", lambda q, k, v, o: (q, k, v, dict(o, max_seqlen_q=5)), flashx.ShapeError,
         "max_seqlen_q: only meaningful with cu_seqlens"),
        ("return_lse", lambda q, k, v, o: (q, k, v, dict(o, return_lse=1)), flashx.DTypeError, "return_lse: expected a bool"),
        ("backend", lambda q, k, v, o: (q, k, v, dict(o, backend="nmupy")), flashx.UnknownBackendError, "did you mean"),
        ("keyword", lambda q, k, v, o: (q, k, v, dict(o, is_causal=False)), TypeError, "did you mean 'causal'"),
    ],
)
def test_a_remembered_call_meets_every_check_again_when_one_field_changes(field, change, error, words):
    """A right call is remembered whole (problem, plan, the backend's prepared forward) under its
    keywords and its arrays' metadata; a call that differs in one field that validation reads (a
    shape, a dtype, a device, the arrays' kind, any keyword) is another key, so it meets every
    check as a first call does, and raises. The right call is served again after it."""
    from flashx import plan

    q, k, v = (torch.from_numpy(x) for x in qkv())
    right = dict(causal=False, window=(3, 3), softmax_scale=0.5, softcap=20.0, dropout_p=0.0, seed=1, rng_offset=0,
                 dropout_offsets=(0, 0), deterministic=False, validate=True, backend="numpy")
    for _ in range(2):
        flashx.attention(q, k, v, **right)
    run = plan.prepared(remembered_key(q, k, v, **right))
    assert run is not None
    with pytest.raises(error) as caught:
        flashx.attention(*change(q, k, v, right)[:3], **change(q, k, v, right)[3])
    assert words in str(caught.value), field
    assert plan.prepared(remembered_key(q, k, v, **right)) is run
    torch.testing.assert_close(flashx.attention(q, k, v, **right), oracle_o(q, k, v, **right), rtol=0, atol=2e-6)


def oracle_o(q, k, v, *, backend, causal, window, softmax_scale, softcap, **_):
    o, _ = oracle.forward(*(x.numpy() for x in (q, k, v)), causal=causal, window=window, softmax_scale=softmax_scale,
                          softcap=softcap)
    return torch.from_numpy(np.asarray(o, dtype=np.float32))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_remembered_call_computes_what_a_validated_call_computes(kind, monkeypatch):
    """Calls of one key after the first run its remembered function alone (nothing is validated or
    planned again), on their own arrays: each returns what a call validated and planned in full
    returns on them, bit for bit. Arrays of other strides or another shape are other keys."""
    from flashx import plan, validation
    from flashx.execute import run_forward

    as_kind = (lambda x: x) if kind == "numpy" else torch.from_numpy
    options = dict(causal=True, window=(4, 0), softcap=5.0, softmax_scale=-0.3)
    built = []
    monkeypatch.setattr(plan, "build_problem", lambda *args, **kw: built.append(1) or validation.build_problem(*args, **kw))
    monkeypatch.setattr(plan, "_plans", {})
    monkeypatch.setattr(plan, "_calls", {})
    for seqlen_q in (5, 5, 5, 3):
        q, k, v = (as_kind(x) for x in qkv(seqlen_q=seqlen_q))
        q_strided = as_kind(np.ascontiguousarray(np.asarray(q).swapaxes(1, 2))).swapaxes(1, 2)
        for query in (q, q_strided):
            o, lse = flashx.attention(query, k, v, return_lse=True, backend="numpy", **options)
            problem = validation.build_problem(query, k, v, **options)
            o_validated, lse_validated = run_forward(flashx.registry.get("numpy"), problem, query, k, v)
            for got, want in ((o, o_validated), (lse, lse_validated)):
                assert type(got) is type(want)
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            assert plan.prepared(remembered_key(query, k, v, backend="numpy", **options)) is not None
    assert len(built) == 2  # one plan a shape, which no stride is part of
    assert len(plan._calls) == 4  # one remembered function a shape and strides


def test_a_remembered_call_leaves_autograd_autocast_and_lazy_negation_to_the_planned_path():
    """The remembered function serves calls that take their tensors as they are: one under grad
    mode with a tensor that requires grad, under autocast, or with torch's lazy negation, of the
    same metadata as a remembered call, goes the planned way (autograd, recast, resolved)."""
    q, k, v = (torch.from_numpy(x) for x in qkv())
    with torch.no_grad():
        for _ in range(2):
            o = flashx.attention(q, k, v, backend="numpy")
    q_grad = q.clone().requires_grad_()
    o_grad = flashx.attention(q_grad, k, v, backend="numpy")
    assert o_grad.grad_fn is not None
    o_grad.sum().backward()
    assert q_grad.grad is not None and q_grad.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flashx.attention(q, k, v, backend="numpy").dtype == torch.bfloat16
    negated = torch._neg_view(q)  # -q, lazily: the metadata of q, and so its key
    assert negated.is_neg() and remembered_key(negated, k, v, backend="numpy") == remembered_key(q, k, v, backend="numpy")
    torch.testing.assert_close(flashx.attention(negated, k, v, backend="numpy"),
                               flashx.attention(-q, k, v, backend="numpy"), rtol=0, atol=0)
    torch.testing.assert_close(flashx.attention(q, k, v, backend="numpy"), o, rtol=0, atol=0)


def test_the_remembered_calls_hold_no_callers_arrays():
    import weakref

    from flashx import plan

    q, k, v = (torch.from_numpy(x) for x in qkv())
    for _ in range(2):
        flashx.attention(q, k, v, backend="numpy")
    assert plan.prepared(remembered_key(q, k, v, backend="numpy")) is not None
    held = [weakref.ref(x) for x in (q, k, v)]
    del q, k, v
    assert all(ref() is None for ref in held)



# -- arrays in and out -----------------------------------------------------------------------


def test_arrays_cross_through_dlpack_without_copies(fresh_registry):
    backend = Marker("numpy-kind")
    registry.register(backend)
    q, k, v = (torch.from_numpy(x) for x in qkv())
    o = flashx.attention(q, k, v)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float32
    received_q = backend.received[1]
    assert isinstance(received_q, np.ndarray)
    assert received_q.__array_interface__["data"][0] == q.data_ptr()
    # strided views reach the backend as views, not copies
    q_view = torch.from_numpy(randn(2, 4, 5, 8)).transpose(1, 2)
    flashx.attention(q_view, k, v)
    assert backend.received[1].strides == tuple(s * 4 for s in q_view.stride())
    # bfloat16 is widened for NumPy and rounded back
    o = flashx.attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert o.dtype == torch.bfloat16 and backend.received[1].dtype == np.float32


def test_empty_inputs_have_the_implied_shapes(fresh_registry):
    registry.register(Marker("only"))
    for batch, seqlen_q, seqlen_k in ((0, 5, 7), (2, 0, 7), (2, 5, 0)):
        q, k, v = qkv(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, dim_v=6)
        o, res = flashx.attention_forward(q, k, v)
        assert o.shape == (batch, seqlen_q, 4, 6) and res.lse.shape == (batch, 4, seqlen_q)
        assert (o == 0).all() and np.isneginf(res.lse).all()
        dq, dk, dv = flashx.attention_backward(randn(*o.shape), q, k, v, o, res)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert not dq.any() and not dk.any() and not dv.any()


@pytest.mark.parametrize("varlen", [False, True])
def test_empty_inputs_with_sinks_hold_the_sink_in_every_row(fresh_registry, varlen):
    """No key at all: every row's lse is its head's sink (padding rows too), and dsinks is 0."""
    registry.register(Marker("only"))
    sinks = np.array([0.5, -1.0, np.nan, -np.inf], np.float32)
    if varlen:
        q, k, v, cu_q, cu_k = varlen_inputs(lengths_q=(3, 0, 4), lengths_k=(0, 0, 0))
        options = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks)
        expected_lse = np.broadcast_to(sinks[:, None], (4, 7))
    else:
        q, k, v = qkv(seqlen_k=0)
        options = dict(sinks=sinks, seqlens_q=np.array([5, 2], np.int32))
        expected_lse = np.broadcast_to(sinks[None, :, None], (2, 4, 5))
    o, res = flashx.attention_forward(q, k, v, **options)
    np.testing.assert_array_equal(res.lse, expected_lse)
    assert (o == 0).all() and res.lse.dtype == np.float32
    dq, dk, dv, dsinks = flashx.attention_backward(randn(*o.shape), q, k, v, o, res, **options)
    assert dsinks.shape == (4,) and dsinks.dtype == np.float32 and not dsinks.any() and not dq.any()


def test_slopes_and_sinks_take_any_floating_dtype_and_reach_backends_in_the_lse_dtype():
    q, k, v = qkv()
    for dtype, lse_dtype in ((np.float32, np.float32), (np.float64, np.float64)):
        for given in (np.float16, np.float32, np.float64):
            problem = flashx.explain(*(x.astype(dtype) for x in (q, k, v)), sinks=np.ones(4, given),
                                     alibi_slopes=np.ones((2, 4), given)).problem
            assert problem.sinks.dtype == lse_dtype and problem.alibi_slopes.dtype == lse_dtype
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    sinks = torch.tensor([0.5, 1.0, -1.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    problem = flashx.explain(tq, tk, tv, sinks=sinks).problem
    assert problem.sinks.dtype == torch.float32 and not problem.sinks.requires_grad


def test_score_modifications_are_opt_in():
    """A backend that keeps the default declaration would ignore the fields these features add."""

    class Default(flashx.Backend):
        name, devices = "default", frozenset({"cpu"})

    q, k, v = qkv()
    for options, feature in (({"softcap": 5.0}, "softcap"), ({"alibi_slopes": np.ones(4)}, "ALiBi slopes"),
                             ({"sinks": np.zeros(4)}, "attention sinks")):
        problem = flashx.explain(q, k, v, **options).problem
        assert Default().supports(problem) == [f"does not support {feature}"]


def test_a_backend_that_returns_no_dsinks_is_reported(fresh_registry):
    class NoSinkGradient(Marker):
        def backward(self, problem, q, k, v, o, lse, do):
            return np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)

    registry.register(NoSinkGradient("only"))
    q, k, v = qkv()
    o, res = flashx.attention_forward(q, k, v, sinks=np.zeros(4, np.float32))
    with pytest.raises(flashx.FlashXError, match="backend 'only' returned 3 gradients, expected 4 .dq, dk, dv, dsinks."):
        flashx.attention_backward(o, q, k, v, o, res, sinks=np.zeros(4, np.float32))


# -- numerics through the NumPy backend ------------------------------------------------------


def test_forward_matches_the_oracle_through_numpy_backend():
    q, k, v = qkv(seqlen_q=37, seqlen_k=53, dim_v=12)
    o, lse = flashx.attention(q, k, v, causal=True, return_lse=True, backend="numpy")
    ref_o, ref_lse = oracle.forward(q, k, v, causal=True)
    np.testing.assert_allclose(o, ref_o, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)


def test_torch_autograd_gradcheck_float64():
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in qkv(seqlen_q=6, seqlen_k=9, dim_v=5, dtype=np.float64))

    def f(q, k, v):
        return flashx.attention(q, k, v, causal=True, window=(4, -1), backend="numpy")

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8)


def test_torch_autograd_gradcheck_float64_with_score_modifications():
    """dsinks reaches sinks that require grad; softcap and ALiBi are differentiated through."""
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in qkv(seqlen_q=6, seqlen_k=9, dim_v=5, dtype=np.float64))
    sinks = torch.tensor([0.5, -1.0, 1.5, 0.0], dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([[0.5, 0.25, 0.125, 1.0], [0.0625, 2.0, 0.5, 0.25]], dtype=torch.float64)

    def f(q, k, v, sinks):
        return flashx.attention(q, k, v, causal=True, softcap=1.5, alibi_slopes=slopes, sinks=sinks, backend="numpy")

    assert torch.autograd.gradcheck(f, (q, k, v, sinks), eps=1e-6, atol=1e-8)
    o = flashx.attention(q.detach(), k.detach(), v.detach(), sinks=sinks, backend="numpy")
    o.sum().backward()
    assert sinks.grad is not None and q.grad is None  # only what requires grad receives one


def test_autocast_takes_mixed_dtypes_as_sdpa_does():
    """Under torch.autocast, float32 q and k beside a bfloat16 v run in bfloat16, as SDPA's do; the
    gradients return in each input's own dtype; outside autocast the mix is a DTypeError."""
    q, k, v = (torch.from_numpy(x) for x in qkv(seqlen_q=9, seqlen_k=11))
    q, k, v = q.requires_grad_(), k.requires_grad_(), v.to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = flashx.attention(q, k, v, backend="numpy")
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o, expected, atol=2e-2, rtol=2e-2)
    o.float().sum().backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    assert q.grad.abs().sum() > 0
    with pytest.raises(flashx.DTypeError, match="v: expected the dtype of q"):
        flashx.attention(q, k, v, backend="numpy")


def test_autograd_agrees_with_attention_backward():
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in qkv(seqlen_q=9, seqlen_k=11))
    do = torch.from_numpy(randn(2, 9, 4, 8))
    o, lse = flashx.attention(q, k, v, dropout_p=0.25, seed=7, return_lse=True, backend="numpy")
    assert not lse.requires_grad
    o.backward(do)
    o2, res = flashx.attention_forward(q.detach(), k.detach(), v.detach(), dropout_p=0.25, seed=7, backend="numpy")
    torch.testing.assert_close(o.detach(), o2, rtol=0, atol=0)
    grads = flashx.attention_backward(do, q.detach(), k.detach(), v.detach(), o2, res, dropout_p=0.25, backend="numpy")
    for auto, manual in zip((q.grad, k.grad, v.grad), grads):
        torch.testing.assert_close(auto, manual, rtol=0, atol=0)
    with pytest.raises(flashx.ShapeError, match="seed: the backward regenerates dropout from res.seed=7"):
        flashx.attention_backward(do, q.detach(), k.detach(), v.detach(), o2, res, dropout_p=0.25, seed=8)


def test_drawn_seed_is_returned_and_follows_torch_manual_seed():
    q, k, v = (torch.from_numpy(x) for x in qkv())
    torch.manual_seed(3)
    _, first = flashx.attention_forward(q, k, v, dropout_p=0.5, backend="numpy")
    torch.manual_seed(3)
    _, second = flashx.attention_forward(q, k, v, dropout_p=0.5, backend="numpy")
    assert first.seed == second.seed and first.rng_offset == 0


def test_drawn_seeds_are_torchs_draws_into_one_tensor_per_thread(monkeypatch):
    """Each seed is what torch.randint(2**63 - 1, ()) draws from torch's default generator, drawn
    into a tensor that the thread keeps rather than one made per call; one first made under
    inference mode still takes the draws of calls outside it."""
    import threading

    q, k, v = (torch.from_numpy(x) for x in qkv())
    torch.manual_seed(3)
    expected = [torch.randint(2**63 - 1, (), dtype=torch.int64).item() for _ in range(3)]
    seeds = []

    def draw():
        torch.manual_seed(3)
        with torch.inference_mode():
            seeds.append(flashx.attention_forward(q, k, v, dropout_p=0.5, backend="numpy")[1].seed)
        with monkeypatch.context() as patched:
            for name in ("empty", "randint", "tensor"):
                patched.setattr(torch, name, lambda *args, **kw: pytest.fail("made a tensor for a seed"))
            seeds.extend(flashx.attention_forward(q, k, v, dropout_p=0.5, backend="numpy")[1].seed for _ in range(2))

    thread = threading.Thread(target=draw)  # a thread of its own: its first draw makes its tensor
    thread.start()
    thread.join()
    assert seeds == expected


@pytest.mark.parametrize("varlen", [False, True])
def test_merge_states_of_two_key_halves_is_the_whole(varlen):
    if varlen:
        q, k, v, cu_q, cu_k = varlen_inputs(lengths_q=(3, 0, 4), lengths_k=(4, 6, 2))
        half = (cu_k[:-1] + cu_k[1:]) // 2
        first_k = np.concatenate([k[a:m] for a, m in zip(cu_k[:-1], half)])
        first_v = np.concatenate([v[a:m] for a, m in zip(cu_k[:-1], half)])
        second_k = np.concatenate([k[m:b] for m, b in zip(half, cu_k[1:])])
        second_v = np.concatenate([v[m:b] for m, b in zip(half, cu_k[1:])])
        cu_first = np.concatenate([[0], np.cumsum(half - cu_k[:-1])]).astype(np.int32)
        cu_second = np.concatenate([[0], np.cumsum(cu_k[1:] - half)]).astype(np.int32)
        whole = flashx.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, backend="numpy")
        part_a = flashx.attention(q, first_k, first_v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_first, return_lse=True, backend="numpy")
        part_b = flashx.attention(q, second_k, second_v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_second, return_lse=True, backend="numpy")
    else:
        q, k, v = qkv(seqlen_k=12)
        whole = flashx.attention(q, k, v, return_lse=True, backend="numpy")
        part_a = flashx.attention(q, k[:, :5], v[:, :5], return_lse=True, backend="numpy")
        part_b = flashx.attention(q, k[:, 5:], v[:, 5:], return_lse=True, backend="numpy")
    o, lse = flashx.merge_states(*part_a, *part_b)
    np.testing.assert_allclose(o, whole[0], atol=1e-6)
    np.testing.assert_allclose(lse, whole[1], atol=1e-6)


def test_merge_states_with_an_empty_part_weighs_it_zero():
    o_a, lse_a = randn(1, 3, 2, 4), randn(1, 2, 3)
    o_b, lse_b = np.zeros_like(o_a), np.full_like(lse_a, -np.inf)
    o, lse = flashx.merge_states(o_a, lse_a, o_b, lse_b)
    np.testing.assert_allclose(o, o_a, rtol=1e-6)
    np.testing.assert_array_equal(lse, lse_a)
    o, lse = flashx.merge_states(o_b, lse_b, o_b, lse_b)
    assert not np.isnan(o).any() and (o == 0).all() and np.isneginf(lse).all()
    with pytest.raises(flashx.ShapeError, match="lse_b: expected shape"):
        flashx.merge_states(o_a, lse_a, o_b, lse_b[..., :2])


def test_autograd_takes_a_gradient_carrying_torchs_negation_bit():
    """The do autograd hands the backward may be a lazy negation (is_neg): it is read as its values."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 8, dtype=torch.float64, generator=generator, requires_grad=True) for _ in range(3))
    negated = torch.randn(1, 5, 2, 8, dtype=torch.complex128, generator=generator).conj().imag
    assert negated.is_neg()
    flashx.attention(q, k, v, backend="numpy").backward(negated)
    lazy = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    flashx.attention(q, k, v, backend="numpy").backward(negated.resolve_neg())
    assert all(torch.equal(a, x.grad) for a, x in zip(lazy, (q, k, v)))


def test_the_cache_directory_is_flashx_cache_dir_else_xdg_cache_home_else_home(monkeypatch, tmp_path):
    from flashx.storage import cache_directory

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FLASHX_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_directory() == tmp_path / "mine"
    monkeypatch.delenv("FLASHX_CACHE_DIR")
    assert cache_directory() == tmp_path / "xdg" / "flashx"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_directory() == tmp_path / "home" / ".cache" / "flashx"


def test_per_static_problem_builds_once_per_description_and_key(monkeypatch):
    """A backend's memory (``flashx.backend.per_static_problem``) builds once per static problem
    and key: calls that differ in a drawn seed share the build, other shapes or keys build anew,
    and past BUILT_LIMIT the memory starts again empty."""
    from flashx import backend as base
    from flashx.problem import Problem

    def problem(**changes):
        fields = dict(array_kind="numpy", device="cpu", device_index=None, dtype="float32", batch=1, seqlen_q=4,
                      seqlen_k=4, total_q=None, total_k=None, heads_q=2, heads_k=2, head_dim=8, head_dim_v=8,
                      softmax_scale=0.5, dropout_p=0.1, seed=1)
        return Problem(**(fields | changes))

    memory, builds = {}, []

    def build():
        builds.append(1)
        return len(builds)

    assert base.per_static_problem(memory, problem(), "k", build) == 1
    assert base.per_static_problem(memory, problem(seed=99), "k", build) == 1  # a call's own seed: the same build
    assert base.per_static_problem(memory, problem(seqlen_q=5), "k", build) == 2
    assert base.per_static_problem(memory, problem(), "other", build) == 3
    monkeypatch.setattr(base, "BUILT_LIMIT", 3)
    assert base.per_static_problem(memory, problem(head_dim=16), "k", build) == 4 and len(memory) == 1


def test_tensor_layout_is_strides_and_alignment():
    torch = pytest.importorskip("torch")
    from flashx.backend import tensor_layout

    x = torch.zeros(4, 8, dtype=torch.float16)
    assert tensor_layout(x, None, x.t()) == (((8, 1), True), None, ((1, 8), True))
    assert tensor_layout(x.view(-1)[1:])[0][1] is False  # 2 bytes past a 16-byte boundary


def test_weightless_rows_read_as_plus_inf():
    torch = pytest.importorskip("torch")
    from flashx.backend import weightless_rows_as_plus_inf

    lse = torch.tensor([[-math.inf, 1.5, math.nan], [math.inf, -2.0, -math.inf]])
    got = weightless_rows_as_plus_inf(lse)
    assert got[0, 0] == math.inf and got[1, 2] == math.inf and got[1, 0] == math.inf
    assert got[0, 1] == 1.5 and got[1, 1] == -2.0 and math.isnan(got[0, 2])
    assert lse[0, 0] == -math.inf, "the forward's lse is left as it was"
