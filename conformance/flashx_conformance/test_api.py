"""The public API around the kernels: determinism, empty inputs, strides, errors, autograd."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import flashx
from flashx_conformance.harness import LAYOUTS, OUTPUTS, TENSORS, Case, conformance_failures, make_case, make_varlen_case

REPEATS = 20
#: Layouts whose elements share memory or carry a lazy negation: the case draws values they can show.
ALIASED = ("tied", "broadcast", "negated")


def _bits(target, arrays):
    return [target.numpy(x) for x in arrays]


def _same_bits(first, later):
    return all(np.array_equal(a, b, equal_nan=True) for a, b in zip(first, later))


def test_determinism(flashx_target, flashx_rng):
    """20 forwards are bitwise identical; so are 20 backwards with deterministic=True (where promised)."""
    case = make_case(flashx_rng, batch=1, heads_q=2, heads_k=1, seqlen_q=17, seqlen_k=29, head_dim=16, dtype=flashx_target.dtype, causal=True)
    inputs = {name: flashx_target.array(x, case.dtype) for name, x in case.rounded().items()}
    q, k, v, do = (inputs[n] for n in TENSORS)
    flashx_target.skip_unless_supported(q, k, v)
    first = None
    for _ in range(REPEATS):
        o, res = flashx.attention_forward(q, k, v, causal=True, backend=flashx_target.name)
        bits = _bits(flashx_target, (o, res.lse))
        first = first or bits
        assert _same_bits(first, bits), "the forward is not bitwise reproducible"

    flashx_target.skip_unless_supported(q, k, v, causal=True, deterministic=True)
    first = None
    for _ in range(REPEATS):
        grads = flashx.attention_backward(do, q, k, v, o, res, causal=True, deterministic=True, backend=flashx_target.name)
        bits = _bits(flashx_target, grads)
        first = first or bits
        assert _same_bits(first, bits), "the backward with deterministic=True is not bitwise reproducible"


EMPTY = {
    "B=0": dict(batch=0),
    "Nq=0": dict(seqlen_q=0, seqlen_k=17),
    "Nk=0": dict(seqlen_q=17, seqlen_k=0),
    "Nk=0-causal": dict(seqlen_q=5, seqlen_k=0, causal=True),
}


@pytest.mark.parametrize("name", EMPTY)
def test_empty_inputs(flashx_target, flashx_rng, name):
    """Zero-size problems have outputs of the implied shapes; rows with no keys give o = 0, lse = -inf."""
    case = make_case(flashx_rng, **{"seqlen_q": 9, "dtype": flashx_target.dtype, **EMPTY[name]})
    got = flashx_target.check(case)
    shapes = {n: case.inputs[m].shape for n, m in (("o", "do"), ("dq", "q"), ("dk", "k"), ("dv", "v"))}
    for n, shape in shapes.items():
        assert got[n].shape == shape, f"{n}: shape {got[n].shape}, expected {shape}"


def test_empty_varlen(flashx_target, flashx_rng):
    """Every sequence of length 0, and rows that belong to none."""
    case = make_varlen_case(flashx_rng, lengths_q=[0, 0], lengths_k=[0, 0], spare_rows=2, dtype=flashx_target.dtype)
    flashx_target.check(case)


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in ("contiguous", *ALIASED)])
def test_noncontiguous(flashx_target, flashx_rng, layout, varlen):
    """Any strides are read correctly: BHSD-transposed views, slices of a packed qkv tensor, strided last dims.

    The memory around each view holds NaN: a kernel that assumes contiguity reads it.
    """
    if varlen:
        case = make_varlen_case(flashx_rng, lengths_q=[7, 30], lengths_k=[19, 41], heads_q=4, heads_k=2, head_dim=32, dtype=flashx_target.dtype, causal=True)
    else:
        case = make_case(flashx_rng, heads_q=4, heads_k=2, seqlen_q=37, seqlen_k=53, head_dim=32, dtype=flashx_target.dtype, causal=True)
    flashx_target.check(Case(case.inputs, case.dtype, case.options, layouts={name: layout for name in TENSORS}))


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("name", TENSORS)
@pytest.mark.parametrize("layout", ALIASED)
def test_aliased_layouts(flashx_target, flashx_rng, layout, name, varlen):
    """An input whose elements share memory (strides tied at 1, or 0) or that carries torch's lazy
    negation is read as the values it shows, and the outputs come back right whatever its layout
    (a gradient allocated "like" such an input inherits a layout the kernel may not write)."""
    dtype = "float16" if layout == "negated" and flashx_target.dtype == "bfloat16" else flashx_target.dtype
    shape = dict(heads_q=4, heads_k=2, head_dim=32, dtype=dtype, causal=True)
    if varlen:
        case = make_varlen_case(flashx_rng, lengths_q=[7, 30], lengths_k=[19, 41], spare_rows=3, **shape)
    else:
        case = make_case(flashx_rng, seqlen_q=37, seqlen_k=53, **shape)
    flashx_target.check(case.with_layout(name, layout))


def test_concurrent_calls(flashx_target, flashx_rng):
    """Calls of other shapes running in other threads change no bit of a call's results."""
    if flashx_target.device == "cpu" and "cuda" in flashx_target.backend.devices:
        pytest.skip("a GPU backend's CPU simulator (Triton's interpreter, Numba's) runs one kernel at a time")
    dtype = "float64" if "float64" in flashx_target.backend.dtypes else flashx_target.dtype
    case = make_case(flashx_rng, batch=1, seqlen_q=47, heads_q=3, heads_k=1, head_dim=256, head_dim_v=160, dtype=dtype)
    other = make_case(flashx_rng, batch=2, seqlen_q=64, heads_q=4, head_dim=64, dtype=dtype)
    inputs = flashx_target.inputs(case)
    serial = _bits(flashx_target, flashx_target.run(case, inputs)[::2])  # o, dq, dk, dv: res holds no array but lse
    stop = threading.Event()
    failures = []

    def keep_busy():
        while not stop.is_set():
            try:
                flashx_target.call(other)
            except Exception as error:  # noqa: BLE001 - reported by the main thread
                failures.append(error)
                return

    threads = [threading.Thread(target=keep_busy) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        differing = sum(not _same_bits(serial, _bits(flashx_target, flashx_target.run(case, inputs)[::2])) for _ in range(8))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not failures, f"a concurrent call failed: {failures[0]!r}"
    assert differing == 0, f"{differing} of 8 calls made beside others differ from the same call made alone"


class _Inputs:
    """Well-formed arrays like q's for the error cases, built on first use."""

    def __init__(self, target, dtype):
        self.target, self.dtype = target, dtype
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = (self.float(rng.standard_normal(s)) for s in ((2, 9, 4, 16), (2, 11, 2, 16), (2, 11, 2, 8)))
        self.packed_q, self.packed_k, self.packed_v = (self.float(rng.standard_normal(s)) for s in ((9, 4, 16), (9, 2, 16), (9, 2, 8)))
        self.cu = self.aux(np.array([0, 4, 9], np.int32))

    def float(self, x, dtype=None):
        return self.target.array(x, dtype or self.dtype)

    def aux(self, x):
        return self.target.array(x, self.dtype)

    def packed(self):
        return self.packed_q, self.packed_k, self.packed_v


def _other_dtype(dtype):
    return "float64" if dtype != "float64" else "float32"


# name -> (inputs -> ((q, k, v), keywords), the FlashXError subclass, a word the message must contain)
ERRORS = {
    "q-3d-padded": (lambda a: ((a.packed_q, a.k, a.v), {}), flashx.ShapeError, "q"),
    "head-dim-mismatch": (lambda a: ((a.q, a.float(np.ones((2, 11, 2, 8))), a.v), {}), flashx.ShapeError, "k"),
    "batch-mismatch": (lambda a: ((a.q, a.float(np.ones((3, 11, 2, 16))), a.float(np.ones((3, 11, 2, 8)))), {}), flashx.ShapeError, "k"),
    "v-rows-mismatch": (lambda a: ((a.q, a.k, a.float(np.ones((2, 10, 2, 8)))), {}), flashx.ShapeError, "v"),
    "heads-not-divisible": (lambda a: ((a.q, a.float(np.ones((2, 11, 3, 16))), a.float(np.ones((2, 11, 3, 8)))), {}), flashx.ShapeError, "k"),
    "dtype-mismatch": (lambda a: ((a.q, a.float(np.ones((2, 11, 2, 16)), _other_dtype(a.dtype)), a.v), {}), flashx.DTypeError, "k"),
    "integer-q": (lambda a: ((a.aux(np.ones((2, 9, 4, 16), np.int32)), a.k, a.v), {}), flashx.DTypeError, "q"),
    "not-an-array": (lambda a: (([[1.0]], a.k, a.v), {}), flashx.DTypeError, "q"),
    "window-bad": (lambda a: ((a.q, a.k, a.v), {"window": (-2, 0)}), flashx.OptionError, "window"),
    "window-not-pair": (lambda a: ((a.q, a.k, a.v), {"window": 5}), flashx.DTypeError, "window"),
    "window-three-sides": (lambda a: ((a.q, a.k, a.v), {"window": (1, 2, 3)}), flashx.OptionError, "window"),
    "dropout-p-1": (lambda a: ((a.q, a.k, a.v), {"dropout_p": 1.0}), flashx.OptionError, "dropout_p"),
    "dropout-p-1.5": (lambda a: ((a.q, a.k, a.v), {"dropout_p": 1.5}), flashx.OptionError, "dropout_p"),
    "dropout-p-negative": (lambda a: ((a.q, a.k, a.v), {"dropout_p": -0.1}), flashx.OptionError, "dropout_p"),
    "seed-negative": (lambda a: ((a.q, a.k, a.v), {"dropout_p": 0.1, "seed": -1}), flashx.OptionError, "seed"),
    "rng-offset-negative": (lambda a: ((a.q, a.k, a.v), {"rng_offset": -1}), flashx.OptionError, "rng_offset"),
    "dropout-offsets-negative": (
        lambda a: ((a.q, a.k, a.v), {"dropout_p": 0.1, "seed": 1, "dropout_offsets": (0, -1)}),
        flashx.OptionError,
        "dropout_offsets",
    ),
    "scale-nan": (lambda a: ((a.q, a.k, a.v), {"softmax_scale": float("nan")}), flashx.OptionError, "softmax_scale"),
    "return-lse-string": (lambda a: ((a.q, a.k, a.v), {"return_lse": "yes"}), flashx.DTypeError, "return_lse"),
    "scale-string": (lambda a: ((a.q, a.k, a.v), {"softmax_scale": "0.5"}), flashx.DTypeError, "softmax_scale"),
    "dropout-p-string": (lambda a: ((a.q, a.k, a.v), {"dropout_p": "0.1"}), flashx.DTypeError, "dropout_p"),
    "seed-float": (lambda a: ((a.q, a.k, a.v), {"dropout_p": 0.1, "seed": 1.5}), flashx.DTypeError, "seed"),
    "head-dim-0": (lambda a: ((a.q[..., :0], a.k[..., :0], a.v), {}), flashx.ShapeError, "head dim"),
    "mask-not-bool": (lambda a: ((a.q, a.k, a.v), {"mask": a.aux(np.ones((9, 11), np.int32))}), flashx.DTypeError, "mask"),
    "mask-shape": (lambda a: ((a.q, a.k, a.v), {"mask": a.aux(np.ones((9, 12), bool))}), flashx.ShapeError, "mask"),
    "block-mask-shape": (
        lambda a: ((a.q, a.k, a.v), {"block_mask": flashx.BlockMask(a.aux(np.ones((1, 1, 5, 5), bool)), (4, 4))}),
        flashx.ShapeError,
        "block_mask",
    ),
    "seqlens-too-long": (lambda a: ((a.q, a.k, a.v), {"seqlens_q": a.aux(np.array([3, 10], np.int32))}), flashx.ShapeError, "seqlens_q"),
    "seqlens-wrong-count": (lambda a: ((a.q, a.k, a.v), {"seqlens_k": a.aux(np.array([3], np.int32))}), flashx.ShapeError, "seqlens_k"),
    "cu-seqlens-one-side": (lambda a: (a.packed(), {"cu_seqlens_q": a.cu}), flashx.ShapeError, "cu_seqlens_k"),
    "cu-seqlens-decreasing": (
        lambda a: (a.packed(), {"cu_seqlens_q": a.aux(np.array([0, 5, 4], np.int32)), "cu_seqlens_k": a.cu}),
        flashx.ShapeError,
        "cu_seqlens_q",
    ),
    "cu-seqlens-past-end": (
        lambda a: (a.packed(), {"cu_seqlens_q": a.cu, "cu_seqlens_k": a.aux(np.array([0, 4, 10], np.int32))}),
        flashx.ShapeError,
        "cu_seqlens_k",
    ),
    "cu-seqlens-float": (
        lambda a: (a.packed(), {"cu_seqlens_q": a.aux(np.array([0.0, 4.0, 9.0], np.float32)), "cu_seqlens_k": a.cu}),
        flashx.DTypeError,
        "cu_seqlens_q",
    ),
    "max-seqlen-too-small": (
        lambda a: (a.packed(), {"cu_seqlens_q": a.cu, "cu_seqlens_k": a.cu, "max_seqlen_q": 3}),
        flashx.ShapeError,
        "max_seqlen_q",
    ),
    "mask-with-varlen": (
        lambda a: (a.packed(), {"cu_seqlens_q": a.cu, "cu_seqlens_k": a.cu, "mask": a.aux(np.ones((5, 5), bool))}),
        flashx.ShapeError,
        "mask",
    ),
}


@pytest.mark.parametrize("name", ERRORS)
def test_errors(flashx_target, name):
    """Each bad input raises its documented FlashXError subclass, and the message names the argument."""
    build, error, word = ERRORS[name]
    (q, k, v), options = build(_Inputs(flashx_target, flashx_target.dtype))
    with pytest.raises(error) as raised:
        flashx.attention_forward(q, k, v, backend=flashx_target.name, **options)
    assert word in str(raised.value), f"{error.__name__} does not name {word!r}: {raised.value}"


def test_unknown_backend(flashx_target):
    """A name no backend has is a ValueError naming it, the registered names and the closest one."""
    a = _Inputs(flashx_target, flashx_target.dtype)
    with pytest.raises(flashx.UnknownBackendError, match="^backend='no-such-backend': no backend named 'no-such-backend'; registered: "):
        flashx.attention_forward(a.q, a.k, a.v, backend="no-such-backend")
    misspelt = flashx_target.name + "_"
    with pytest.raises(ValueError) as raised:
        flashx.attention_forward(a.q, a.k, a.v, backend=misspelt)
    assert isinstance(raised.value, flashx.UnknownBackendError)
    assert str(raised.value).endswith(f"did you mean {flashx_target.name!r}?"), str(raised.value)


def test_explain_names_the_requested_backend(flashx_target):
    """explain reports the backend a call would run: the one asked for, by name or by use_backend."""
    a = _Inputs(flashx_target, flashx_target.dtype)
    flashx_target.skip_unless_supported(a.q, a.k, a.v)
    explicit = flashx.explain(a.q, a.k, a.v, backend=flashx_target.name)
    with flashx.use_backend(flashx_target.name):
        in_context = flashx.explain(a.q, a.k, a.v)
    for explanation, requested_by in ((explicit, f"backend={flashx_target.name!r}"), (in_context, f"use_backend({flashx_target.name!r})")):
        assert (explanation.chosen, explanation.requested, explanation.requested_by) == (flashx_target.name, flashx_target.name, requested_by)
        assert f"<- requested by {requested_by}" in str(explanation)


def test_device_mismatch(flashx_target, flashx_rng):
    """q on one device, k on another: DeviceError (needs a GPU)."""
    if not flashx_target.device.startswith("cuda") or flashx_target.caller_kind(flashx_target.dtype) != "torch":
        pytest.skip("needs torch tensors on a CUDA device")
    case = make_case(flashx_rng, dtype=flashx_target.dtype)
    q, k, v = (flashx_target.array(case.rounded()[n], case.dtype) for n in ("q", "k", "v"))
    with pytest.raises(flashx.DeviceError, match="k"):
        flashx.attention_forward(q, k.cpu(), v, backend=flashx_target.name)


def test_a_thread_that_has_made_no_gpu_call(flashx_target, flashx_rng):
    """A call from a fresh thread (a server's worker; autograd runs the backward on its own) meets
    the oracle. The first call, on this thread, compiles; the fresh thread's tensors then come from
    the allocator's cache, so no earlier GPU call of that thread has set it up."""
    case = make_case(flashx_rng, heads_q=4, heads_k=2, seqlen_q=37, seqlen_k=53, head_dim=32, dtype=flashx_target.dtype,
                     causal=True)
    inputs = {name: flashx_target.array(x, case.dtype) for name, x in case.rounded().items()}
    q, k, v, do = (inputs[n] for n in TENSORS)
    flashx_target.skip_unless_supported(q, k, v, causal=True)
    o, res = flashx.attention_forward(q, k, v, causal=True, backend=flashx_target.name)
    flashx.attention_backward(do, q, k, v, o, res, causal=True, backend=flashx_target.name)
    del o, res
    results = []

    def call():
        try:
            o, res = flashx.attention_forward(q, k, v, causal=True, backend=flashx_target.name)
            grads = flashx.attention_backward(do, q, k, v, o, res, causal=True, backend=flashx_target.name)
            results.append((o, res.lse, *grads))
        except Exception as error:  # re-raised on this thread, where pytest sees it
            results.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    [result] = results
    if isinstance(result, Exception):
        raise result
    failures = conformance_failures(case, dict(zip(OUTPUTS, (flashx_target.numpy(x) for x in result))))
    assert not failures, case.describe() + "\n" + "\n".join(failures)


@pytest.mark.parametrize("layout", ["seqlens", "varlen"])
def test_unvalidated_lengths(flashx_target, flashx_rng, layout):
    """``validate=False``: lengths and offsets reach the backend unread, packed ones with
    ``max_seqlen_*`` hints above their longest sequence (which then size the launch) and rows past
    the last sequence; the outputs meet the oracle as with validation, padding rows included."""
    if layout == "varlen":
        case = make_varlen_case(flashx_rng, lengths_q=[5, 40, 0], lengths_k=[9, 33, 4], spare_rows=3, heads_q=4,
                                heads_k=2, head_dim=32, dtype=flashx_target.dtype, causal=True, validate=False,
                                max_seqlen_q=64, max_seqlen_k=48)
    else:
        case = make_case(flashx_rng, batch=3, seqlen_q=40, seqlen_k=56, heads_q=4, heads_k=2, head_dim=32,
                         dtype=flashx_target.dtype, causal=True, validate=False,
                         seqlens_q=np.array([40, 0, 17], np.int32), seqlens_k=np.array([3, 56, 30], np.int32))
    flashx_target.check(case)


def test_repeated_calls(flashx_target, flashx_rng):
    """One problem called again and again meets the oracle every time: with new arrays alive at
    other addresses beside the earlier ones, then with new values in the first call's arrays.
    What a backend keeps between the calls of a problem (compiled launches, TMA descriptors
    encoded for an address) must never carry an earlier call's addresses or values."""
    cases = [make_case(flashx_rng, heads_q=4, heads_k=2, seqlen_q=70, seqlen_k=100, head_dim=32,
                       dtype=flashx_target.dtype, causal=True) for _ in range(3)]
    arrays = [flashx_target.inputs(case) for case in cases]  # all alive: each call at new addresses

    def check(case, inputs):
        o, res, dq, dk, dv = flashx_target.run(case, inputs)
        failures = conformance_failures(case, dict(zip(OUTPUTS, map(flashx_target.numpy, (o, res.lse, dq, dk, dv)))))
        assert not failures, case.describe() + "\n" + "\n".join(failures)

    for case, inputs in zip(cases, arrays):
        check(case, inputs)
    for name in TENSORS:
        arrays[0][name][...] = arrays[2][name]
    check(cases[2], arrays[0])


def test_autograd(flashx_target, flashx_rng):
    """flashx.attention(...).backward() on torch tensors meets the oracle and, when the backward is
    deterministic, gives attention_backward's gradients bit for bit."""
    torch = pytest.importorskip("torch")
    dtype = flashx_target.dtype
    case = make_case(flashx_rng, heads_q=4, heads_k=2, seqlen_q=37, seqlen_k=53, head_dim=32, dtype=dtype, causal=True)
    rounded = case.rounded()
    q, k, v, do = (torch.from_numpy(rounded[n]).to(device=flashx_target.device, dtype=getattr(torch, dtype)) for n in TENSORS)
    options = dict(causal=True, deterministic=bool(getattr(flashx_target.backend, "deterministic_backward", False)))
    flashx_target.skip_unless_supported(q, k, v, **options)
    o, res = flashx.attention_forward(q, k, v, backend=flashx_target.name, **options)
    expected = flashx.attention_backward(do, q, k, v, o, res, backend=flashx_target.name, **options)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flashx.attention(*leaves, backend=flashx_target.name, return_lse=True, **options)
    assert out.requires_grad, "flashx.attention did not build an autograd graph"
    out.backward(do)
    got = dict(zip(OUTPUTS, (flashx_target.numpy(x) for x in (out, lse, *(leaf.grad for leaf in leaves)))))
    failures = conformance_failures(case, got)
    assert not failures, case.describe() + "\n" + "\n".join(failures)
    if options["deterministic"]:
        for name, want in zip(("dq", "dk", "dv"), expected):
            assert np.array_equal(got[name], flashx_target.numpy(want)), f"{name}: autograd differs from attention_backward"
