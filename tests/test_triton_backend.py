"""The Triton backend's kernels, run by Triton's interpreter on CPU, against the conformance suite's oracle.

Shapes are tiny but span several 32-row tiles (the interpreter's tile), so the masked edge
tiles, the unmasked interior loop and tile skipping all run. Every output buffer the backend
allocates is NaN-poisoned first, so an element the kernels never write fails the comparison.
"""

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (they import lazily)

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="the Triton backend needs triton (pip install 'flashx-attention[triton]')")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashx_conformance import oracle, philox  # noqa: E402

import flashx  # noqa: E402
from flashx.validation import build_problem  # noqa: E402
from flashx_triton.arguments import problem_args  # noqa: E402
from flashx_triton.dropout import dropout_args, dropout_keep, dropout_state  # noqa: E402
from flashx_triton.masking import band_part, band_parts, band_tiles  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's 1/0 on empty rows


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """torch.empty / empty_like hand out NaN (floats) or -1 (ints): unwritten memory shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(x):
        return x.fill_(math.nan) if x.is_floating_point() else x.fill_(-1)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def check_against_oracle(q, k, v, do, tol=2e-5, **options):
    """Every output equal to the NaN-exact float64 oracle: NaN and infinities exactly where it has them,
    except that an inf read through a masked tile's product comes out NaN (masked_dot)."""
    o, res = flashx.attention_forward(q, k, v, backend="triton", **options)
    grads = flashx.attention_backward(do, q, k, v, o, res, backend="triton", **options)
    want = oracle.forward_backward(*(x.double().numpy() for x in (do, q, k, v)), **options)
    for name, x, ref in zip(("o", "lse", "dq", "dk", "dv"), (o, res.lse, *grads), want):
        got, ref = x.double().numpy(), np.asarray(ref)
        finite = np.isfinite(ref)
        inf_as_nan = np.isinf(ref) & np.isnan(got) & (name != "lse")
        nan = np.isnan(got) & ~inf_as_nan
        assert np.array_equal(nan, np.isnan(ref)), f"{name}: NaN at {np.argwhere(nan != np.isnan(ref))[:4]}"
        infinite = np.isinf(ref) & ~inf_as_nan
        assert np.array_equal(got[infinite], ref[infinite]), f"{name}: wrong infinities"
        err = np.abs(got[finite] - ref[finite]).max(initial=0.0)
        assert err <= tol * max(1.0, np.abs(ref[finite]).max(initial=0.0)), f"{name}: max error {err:.3g}"
    return o, res, grads


# ---------------------------------------------------------------- the backend object


def test_backend_is_registered_and_available_in_the_interpreter():
    info = {b.name: b for b in flashx.backends()}
    assert "triton" in info
    from flashx_triton import TritonBackend

    backend = TritonBackend()
    assert backend.available() is None
    assert backend.devices == {"cuda", "cpu"}
    q = torch.zeros(1, 4, 2, 16)
    assert "triton" in str(flashx.explain(q, q, q, causal=True))


# ---------------------------------------------------------------- masking


@pytest.mark.parametrize("nq, nk", [(70, 100), (100, 70), (1, 75)])
def test_causal_bottom_right_with_gqa(nq, nk):
    B, Hq, Hk, D = 1, 4, 2, 32
    q, k, v, do = randn(B, nq, Hq, D), randn(B, nk, Hk, D), randn(B, nk, Hk, D), randn(B, nq, Hq, D)
    check_against_oracle(q, k, v, do, causal=True)


@pytest.mark.parametrize("window, causal", [((9, 20), False), ((40, -1), True), ((-1, 3), False)])
def test_window(window, causal):
    B, H, N, D = 1, 2, 96, 16
    q, k, v, do = randn(B, N, H, D), randn(B, N + 9, H, D), randn(B, N + 9, H, D), randn(B, N, H, D)
    check_against_oracle(q, k, v, do, window=window, causal=causal)


@triton.jit
def band_part_sizes(OUT, ROW_LENGTHS, OTHER_LENGTHS, left, right, ROWS: tl.constexpr, TILE: tl.constexpr,
                    ALL_MASKED: tl.constexpr):
    """hi - lo of each of band_part's parts, for the row tile program_id(0) of lengths pair program_id(1)."""
    tile, case = tl.program_id(0), tl.program_id(1)
    first, full_lo, full_hi, end = band_tiles(tile * ROWS, tl.load(ROW_LENGTHS + case), tl.load(OTHER_LENGTHS + case),
                                              left, right, ROWS, TILE, ALL_MASKED)
    for part in tl.static_range(3):
        lo, hi = band_part(part, first // TILE * TILE, full_lo, full_hi, end)
        tl.store(OUT + (case * tl.num_programs(0) + tile) * 3 + part, hi - lo)


@pytest.mark.parametrize("nq, nk", [(64, 64), (64, 96), (96, 64), (70, 100)])
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window=(9, 20)),
                                     dict(window=(40, -1), causal=True), dict(window=(-1, 3)), dict(mask="random"),
                                     dict(seqlens=True), dict(seqlens=True, causal=True)], ids=str)
def test_the_band_parts_left_out_of_a_kernel_never_hold_a_tile(nq, nk, options):
    """band_parts, which decides what loops a kernel compiles, against band_tiles, which decides
    at run time what tiles they run, for every row tile from both sides; and every masked part it
    keeps holds a tile for some lengths (no masked loop compiled in vain)."""
    options = dict(options)
    q, k = randn(2, nq, 1, 16), randn(2, nk, 1, 16)
    if options.pop("seqlens", False):  # lengths at and around the tile edges
        options.update(seqlens_q=torch.tensor([nq, nq]), seqlens_k=torch.tensor([nk, nk]))
        q_lengths, k_lengths = torch.meshgrid(*(torch.tensor(sorted({0, 1, 32, 33, 50, n}))
                                                for n in (nq, nk)), indexing="ij")
    else:
        q_lengths, k_lengths = torch.tensor([nq]), torch.tensor([nk])
    if options.get("mask") == "random":
        options["mask"] = torch.rand(1, 1, nq, nk) < 0.5
    problem = build_problem(q, k, k, **options)
    args = problem_args(problem)
    tile = 32
    for keys in (False, True):
        rows, other = (k_lengths, q_lengths) if keys else (q_lengths, k_lengths)
        near, far = (args["right"], args["left"]) if keys else (args["left"], args["right"])
        tiles = math.ceil((nk if keys else nq) / tile)
        sizes = torch.empty(rows.numel(), tiles, 3, dtype=torch.int32)
        band_part_sizes[(tiles, rows.numel())](sizes, rows.flatten().int(), other.flatten().int(), near, far, tile,
                                               tile, problem.mask is not None)
        parts = band_parts(problem, keys, tile)
        holds = [sizes[..., part].amax().item() > 0 for part in range(3)]
        kept = [bool(parts >> part & 1) for part in range(3)]
        assert kept[1] != (problem.mask is not None), "the full tiles' loop is left out exactly under a mask"
        for part in (0, 2):  # the masked tiles before and after the full ones
            assert holds[part] == kept[part], f"keys={keys} part {part}: kept {kept[part]}, holds {holds[part]}"
        assert not holds[1] or kept[1]


def test_bool_mask_with_broadcast_and_fully_masked_rows():
    B, H, Nq, Nk, D = 2, 2, 40, 70, 16
    mask = torch.rand(1, H, Nq, Nk) < 0.4
    mask[:, :, 5] = False  # empty rows: o = 0, lse = -inf, no gradient
    mask[:, :, :, 32:64] = False  # a whole key tile: skipped
    q, k, v, do = randn(B, Nq, H, D), randn(B, Nk, H, D), randn(B, Nk, H, D), randn(B, Nq, H, D)
    o, res, _ = check_against_oracle(q, k, v, do, mask=mask)
    assert (o[:, 5] == 0).all() and (res.lse[:, :, 5] == -math.inf).all()


def test_block_mask_with_blocks_unlike_the_tiles():
    B, H, Nq, Nk, D = 1, 2, 70, 90, 16
    blocks = torch.rand(B, H, math.ceil(Nq / 8), math.ceil(Nk / 24)) < 0.5
    block_mask = flashx.BlockMask(blocks, block_size=(8, 24))
    q, k, v, do = randn(B, Nq, H, D), randn(B, Nk, H, D), randn(B, Nk, H, D), randn(B, Nq, H, D)
    check_against_oracle(q, k, v, do, block_mask=block_mask, causal=True)


def test_masks_of_one_shape_and_other_strides_are_each_read_through_their_own():
    """Kernels read a mask as given through the strides of its broadcast, which a launch binds:
    calls with masks (and block masks) of one shape laid out otherwise, in turn, each get theirs."""
    B, H, Nq, Nk, D = 2, 2, 40, 40, 16
    q, k, v, do = randn(B, Nq, H, D), randn(B, Nk, H, D), randn(B, Nk, H, D), randn(B, Nq, H, D)
    mask, blocks = torch.rand(1, H, Nq, Nk) < 0.5, torch.rand(B, 1, 5, 5) < 0.7
    for _ in range(2):
        for layout in (lambda x: x, lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2)):
            check_against_oracle(q, k, v, do, mask=layout(mask))
            check_against_oracle(q, k, v, do, block_mask=flashx.BlockMask(layout(blocks), 8), causal=True)


def test_seqlens_with_nan_padding_never_leak():
    B, H, N, D = 3, 2, 70, 16
    lq, lk = torch.tensor([70, 33, 0]), torch.tensor([41, 70, 9])
    q, k, v, do = randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D)
    for b in range(B):
        q[b, lq[b]:], do[b, lq[b]:] = math.nan, math.nan
        k[b, lk[b]:], v[b, lk[b]:] = math.inf, math.nan
    o, res, grads = check_against_oracle(q, k, v, do, causal=True, seqlens_q=lq, seqlens_k=lk)
    assert all(x.isfinite().all() for x in (o, *grads)), "the poison reached an output"


def test_varlen_with_an_empty_sequence_and_rows_past_the_last():
    H, D = 2, 16
    cu_q, cu_k = torch.tensor([0, 37, 37, 100], dtype=torch.int32), torch.tensor([0, 50, 61, 61], dtype=torch.int32)
    tq, tk = 104, 66  # rows past cu[-1] belong to no sequence
    q, k, v, do = randn(tq, H, D), randn(tk, H, D), randn(tk, H, D), randn(tq, H, D)
    o, res, _ = check_against_oracle(q, k, v, do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert (o[100:] == 0).all() and (res.lse[:, 100:] == -math.inf).all()


@pytest.mark.parametrize("sinks", [False, True])
def test_varlen_whose_sequences_cover_every_row_fills_nothing_first(monkeypatch, sinks):
    """Without rows past cu_seqlens[-1] (an empty sequence and empty rows inside), the kernels
    write every element of every output: the backend allocates them without a fill (a kernel
    launch each on a GPU), and the NaN-poisoned allocations never show. The int8 flags of the
    exact launches are no output, and are cleared once per buffer (launch.flags), not per call."""
    H, D = 2, 16
    cu_q, cu_k = torch.tensor([0, 37, 37, 100], dtype=torch.int32), torch.tensor([0, 50, 61, 66], dtype=torch.int32)
    q, k, v, do = randn(100, H, D), randn(66, H, D), randn(66, H, D), randn(100, H, D)
    options = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, window=(8, 0))
    if sinks:
        options["sinks"] = torch.tensor([0.5, -1.0])
    fills = []
    for name in ("zeros", "zeros_like", "full"):
        fill = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *args, fill=fill, **kw: (fills.append(kw.get("dtype")),
                                                                          fill(*args, **kw))[1])
    check_against_oracle(q, k, v, do, **options)
    assert all(dtype == torch.int8 for dtype in fills), fills


# ---------------------------------------------------------------- shapes, strides, dtypes


def test_mqa_dv_ne_d_non_power_of_two_head_dim_and_strided_inputs():
    B, Hq, N, D, Dv = 1, 3, 50, 40, 24
    q = randn(B, Hq, N, D).transpose(1, 2)  # BHSD storage seen as BSHD
    k, v, do = randn(B, N, 1, D), randn(B, N, 1, Dv), randn(B, N, Hq, 2 * Dv)[..., ::2]
    assert not do.is_contiguous()
    check_against_oracle(q, k, v, do, softmax_scale=0.3)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_half_precisions(dtype, tol):
    B, H, N, D = 1, 2, 64, 32
    q, k, v, do = (randn(B, N, H, D, dtype=dtype) for _ in range(4))
    check_against_oracle(q, k, v, do, tol=tol, causal=True)


# ---------------------------------------------------------------- NaN and infinities (the contract's "Scores and masking" section)


@pytest.mark.parametrize("name, value", [("q", math.nan), ("k", math.nan), ("v", math.nan), ("do", math.nan),
                                         ("v", math.inf), ("v", -math.inf)])
def test_a_non_finite_input_reaches_exactly_the_outputs_that_read_it(name, value):
    """Row/key 20 sits inside the masked diagonal tile: the rows and keys of that tile that do not
    attend it share its tl.dot and must stay finite."""
    B, Hq, Hk, N, D = 1, 4, 2, 45, 32
    inputs = dict(q=randn(B, N, Hq, D), k=randn(B, N, Hk, D), v=randn(B, N, Hk, D), do=randn(B, N, Hq, D))
    inputs[name][0, 20, -1, 5] = value
    check_against_oracle(**inputs, causal=True)


def test_the_exact_forward_launch_redoes_only_the_query_tiles_that_met_a_nonfinite_value(monkeypatch):
    """Causal, 32-row tiles, a NaN in V at key 40 of one head: the plain products of tile [32, 64)
    give NaN to rows 32-39 too, which may not read it, and tile [64, 96) reads it: those two of the
    12 programs are flagged and redone; tile [0, 32) never loads key 40."""
    from flashx_triton import launch

    flags = []
    run = launch.Passes.__call__
    monkeypatch.setattr(launch.Passes, "__call__", lambda self, *tensors: flags.append(run(self, *tensors)))
    B, H, N, D = 1, 4, 96, 16
    q, k, v = randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D)
    v[0, 40, 2, 3] = math.nan
    o, _ = flashx.attention_forward(q, k, v, backend="triton", causal=True)
    assert len(flags) == 1 and flags[0].tolist().count(1) == 2 and flags[0].tolist().count(0) == 10
    assert o[0, :40].isfinite().all() and o[0, 40:, 2, 3].isnan().all() and o[0, 40:, [0, 1, 3]].isfinite().all()
    check_against_oracle(q, k, v, randn(B, N, H, D), causal=True)


def test_the_exact_gradient_launch_redoes_only_the_programs_that_met_a_nonfinite_value(monkeypatch):
    """Causal, 32-row tiles, dK/dV and dQ in one launch (3 key tiles and 3 query tiles a head, 24
    programs), a NaN in Q at row 40 of one head: the plain products of key tile [32, 64) give NaN
    to keys 41-63 too, which may not use that row, key tile [0, 32) and query tile [32, 64) use it:
    those three are flagged and redone; key tile [64, 96) never loads row 40."""
    from flashx_triton import launch, tuning

    monkeypatch.setattr(tuning, "INTERPRETED_GRADIENTS", ["fused"])
    flags = []
    run = launch.Passes.__call__
    monkeypatch.setattr(launch.Passes, "__call__", lambda self, *tensors: flags.append(run(self, *tensors)))
    B, H, N, D = 1, 4, 96, 16
    q, k, v, do = randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D)
    q[0, 40, 2, 3] = math.nan
    check_against_oracle(q, k, v, do, causal=True)
    gradient_flags = [f.tolist() for f in flags if len(f) == 24]
    assert len(gradient_flags) == 1 and gradient_flags[0].count(1) == 3, gradient_flags


def test_programs_of_one_wave_run_in_one_exact_launch(monkeypatch):
    """A masked problem whose programs fit one wave of the GPU (launch.fits_one_wave; stood in
    for here, since the interpreter never fits) runs its forward and its gradients in one exact
    launch each, with no flags: NaN in V at key 40 of one head, causal, still as the oracle."""
    from flashx_triton import launch

    monkeypatch.setattr(launch, "fits_one_wave", lambda programs, device: True)
    monkeypatch.setattr(launch, "_built", {})
    launched = []
    run = launch.Launch.__call__
    monkeypatch.setattr(launch.Launch, "__call__", lambda self, *tensors: (launched.append(
        dict(zip(self.kernel.arg_names[-len(self.bound):], self.bound)).get("EXACT")), run(self, *tensors))[1])
    B, H, N, D = 1, 4, 96, 16
    q, k, v, do = randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D)
    v[0, 40, 2, 3] = math.nan
    check_against_oracle(q, k, v, do, causal=True)
    assert launched == [True, None, True]  # the forward, the backward's prepare kernel and its gradients


def test_the_exact_launch_takes_every_flagged_program_of_every_share(monkeypatch):
    """Each program of an exact launch runs the flagged ones among FLAGS_PER_PROGRAM programs of
    the first launch (launch.program_share): with 4 to a share, a NaN in V at key 40 of every
    head flags the forward programs of query tiles [32, 64) and [64, 96) of each of 6 heads, 12
    of 18, two or three in each of the five shares; the gradient launch's flags spread likewise."""
    from flashx_triton import launch

    monkeypatch.setattr(launch, "FLAGS_PER_PROGRAM", tl.constexpr(4))
    B, H, N, D = 1, 6, 96, 16
    q, k, v, do = randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D)
    v[0, 40, :, 3] = math.nan
    check_against_oracle(q, k, v, do, causal=True)


def test_calls_reuse_their_flags_and_flag_only_their_own_programs(monkeypatch):
    """Passes's flags live in one buffer per thread, device, stream and size (launch.flags), not
    one allocation per call: a clean call after one that flagged two programs uses the same buffer,
    flags none of them and equals the oracle; another thread gets a buffer of its own."""
    import threading

    from flashx_triton import launch

    flags = []
    run = launch.Passes.__call__
    monkeypatch.setattr(launch.Passes, "__call__", lambda self, *tensors: flags.append(run(self, *tensors)))
    B, H, N, D = 1, 4, 96, 16
    q, k, v = randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D)
    poisoned = v.clone()
    poisoned[0, 40, 2, 3] = math.nan
    flashx.attention_forward(q, k, poisoned, backend="triton", causal=True)
    assert flags[0].tolist().count(1) == 2
    o, _ = flashx.attention_forward(q, k, v, backend="triton", causal=True)
    assert flags[1] is flags[0] and flags[1].tolist().count(1) == 0
    np.testing.assert_allclose(o.numpy(), oracle.forward(*(x.double().numpy() for x in (q, k, v)), causal=True)[0],
                               atol=2e-5)
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(launch.flags(q.device, len(flags[0]))))
    thread.start()
    thread.join()
    assert elsewhere[0] is not flags[0] and launch.flags(q.device, len(flags[0])) is flags[0]


@pytest.fixture
def exact_launches(monkeypatch):
    """Launches and buffers of flags made afresh, each ExactLaunch's actual launches recorded (the
    ExactLaunch)."""
    import threading

    from flashx_triton import launch

    monkeypatch.setattr(launch, "_built", {})
    monkeypatch.setattr(launch, "_flags", threading.local())  # an earlier test's flags, left set
    launched = []
    run = launch.Launch.__call__
    monkeypatch.setattr(launch.Launch, "__call__", lambda self, *tensors: (
        launched.append(self) if isinstance(self, launch.ExactLaunch) else None, run(self, *tensors))[1])
    return launched


class Sent:
    """A kernel sent to compile elsewhere (background.Compiling), ended by the test."""

    def __init__(self):
        self.ended, self.waited = False, 0

    def done(self):
        return self.ended

    def wait(self):
        self.waited += 1
        self.ended = True


def test_a_first_call_on_clean_data_launches_no_exact_kernel_and_a_later_nan_call_is_exact(exact_launches):
    """Clean data never runs an exact launch past its flag check, so a shape's first call reads
    the flags and, none set, leaves the exact kernels out (to compile elsewhere; under the
    interpreter, which has nothing to compile, nowhere). Later calls launch them without a flag
    read, and one with a NaN in V gets the oracle's outputs: NaN only where rows read it."""
    B, H, N, D = 1, 4, 96, 16
    q, k, v, do = randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D)
    check_against_oracle(q, k, v, do, causal=True)
    assert exact_launches == []
    check_against_oracle(q, k, v, do, causal=True)
    assert len(exact_launches) == 2  # the forward's and the backward's
    v[0, 40, 2, 3] = math.nan
    check_against_oracle(q, k, v, do, causal=True)
    assert len(exact_launches) == 4


def test_while_an_exact_kernel_compiles_elsewhere_clean_calls_skip_it_and_a_flagged_one_waits(exact_launches,
                                                                                                   monkeypatch):
    """Each exact kernel is sent elsewhere once, by the first clean call; clean calls skip it
    while it compiles there, a call with a flag waits for that compile and launches (exact), and
    once a compile has ended its launch runs on every call without a flag read."""
    from flashx_triton import background

    sent = []
    monkeypatch.setattr(background, "compile_elsewhere", lambda *args: sent.append(Sent()) or sent[-1])
    B, H, N, D = 1, 4, 96, 16
    q, k, v = randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D)
    for _ in range(2):
        flashx.attention_forward(q, k, v, backend="triton", causal=True)
    assert len(sent) == 1 and exact_launches == []
    poisoned = v.clone()
    poisoned[0, 40, 2, 3] = math.nan
    o, _ = flashx.attention_forward(q, k, poisoned, backend="triton", causal=True)
    assert sent[0].waited == 1 and len(exact_launches) == 1
    assert o[0, :40].isfinite().all() and o[0, 40:, 2, 3].isnan().all()  # rows 32-39 exact
    flashx.attention_forward(q, k, v, backend="triton", causal=True)
    assert len(sent) == 1 and len(exact_launches) == 2
    q2 = randn(B, 64, H, D)  # another shape: its own exact launch, sent elsewhere
    flashx.attention_forward(q2, q2, q2, backend="triton", causal=True)
    assert len(sent) == 2 and len(exact_launches) == 2
    sent[1].ended = True  # compiled elsewhere: launched from now on, clean or not
    flashx.attention_forward(q2, q2, q2, backend="triton", causal=True)
    assert sent[1].waited == 0 and len(exact_launches) == 3


def test_programs_without_rows_leave_a_new_buffer_of_flags_clear(exact_launches):
    """Varlen programs past their sequence's rows write no flag: a new buffer starts clear
    (launch.flags), or what memory held there would have the exact kernels compiled on clean data."""
    cu = torch.tensor([0, 37, 37, 100], dtype=torch.int32)  # query tiles [32, 64) of sequence 0 and all of 1: none
    q, k, v, do = randn(100, 2, 16), randn(100, 2, 16), randn(100, 2, 16), randn(100, 2, 16)
    check_against_oracle(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    assert exact_launches == []


def test_under_graph_capture_exact_launches_are_launched_on_the_first_call(exact_launches, monkeypatch):
    """A graph replays its launches long after the capture, where no flag read can decide: the
    exact launches are captured (compiled here) on the first call, and nothing is sent elsewhere."""
    from flashx_triton import background, launch

    monkeypatch.setattr(launch, "capturing", lambda device: True)
    monkeypatch.setattr(background, "compile_elsewhere", lambda *args: pytest.fail("sent elsewhere"))
    B, H, N, D = 1, 4, 96, 16
    check_against_oracle(randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D), randn(B, N, H, D), causal=True)
    assert len(exact_launches) == 2


def test_a_candidate_under_trial_skips_its_clean_exact_launch_and_sends_nothing_elsewhere(exact_launches,
                                                                                             monkeypatch):
    """Tuning runs every candidate; only the chosen one's exact kernel will be needed. Once the
    choice is made, the chosen launch's first clean call sends its kernel elsewhere."""
    from flashx_triton import background, tuning

    sent = []
    monkeypatch.setattr(background, "compile_elsewhere", lambda *args: sent.append(Sent()) or sent[-1])
    q, k, v = (randn(1, 96, 4, 16) for _ in range(3))
    monkeypatch.setattr(tuning._trying, "active", True, raising=False)
    flashx.attention_forward(q, k, v, backend="triton", causal=True)
    assert sent == [] and exact_launches == []
    monkeypatch.setattr(tuning._trying, "active", False)
    flashx.attention_forward(q, k, v, backend="triton", causal=True)
    assert len(sent) == 1 and exact_launches == []


@pytest.mark.parametrize("plan", ["split", "fused"])
def test_dkdv_and_dq_in_one_launch_or_two(monkeypatch, plan):
    """Both ways of launching the gradient kernel's two kinds of programs (tuning.GRADIENTS): in
    two launches, where each leaves the other kind uncompiled, and in one, where each program
    picks its kind; under GQA, so that the query heads of a key head map to the right programs."""
    from flashx_triton import tuning

    monkeypatch.setattr(tuning, "INTERPRETED_GRADIENTS", [plan])
    B, Hq, Hk, N, D = 2, 6, 2, 70, 16
    seqlens = torch.tensor([N, 51])  # an array option: the call's plan cache does not keep the Problem
    check_against_oracle(randn(B, N, Hq, D), randn(B, N, Hk, D), randn(B, N, Hk, D), randn(B, N, Hq, D), causal=True,
                         seqlens_q=seqlens, seqlens_k=seqlens)


@pytest.mark.parametrize("name", ["q", "k", "v", "do"])
def test_backward_with_descriptors_built_in_the_kernel(monkeypatch, name):
    """The backward's other descriptor placement (the H100's first choice at d128): one TMA
    descriptor per program and head, zero past the sequence instead of past the tensor."""
    from flashx_triton import tuning

    monkeypatch.setattr(tuning, "INTERPRETED", tuning.Config(32, 32, 1, 1, host_descriptors=False))
    B, Hq, Hk, N, D = 2, 4, 2, 45, 32
    inputs = dict(q=randn(B, N, Hq, D), k=randn(B, N, Hk, D), v=randn(B, N, Hk, D), do=randn(B, N, Hq, D))
    inputs[name][0, 20, -1, 5] = math.nan
    inputs[name][1, 40:] = math.nan  # past seqlens: never read
    seqlens = torch.tensor([N, 40])
    check_against_oracle(**inputs, causal=True, seqlens_q=seqlens, seqlens_k=seqlens)


@pytest.mark.parametrize("name", ["v", "do"])
def test_nan_in_bfloat16_reaches_exactly_the_outputs_that_read_it(name):
    B, H, N, D = 1, 2, 45, 32
    inputs = {n: randn(B, N, H, D, dtype=torch.bfloat16) for n in ("q", "k", "v", "do")}
    inputs[name][0, 20, -1, 5] = math.nan
    check_against_oracle(**inputs, tol=3e-2, causal=True)


def test_nan_under_a_random_bool_mask_reaches_only_the_rows_that_attend_it():
    B, H, Nq, Nk, D = 1, 2, 40, 50, 16
    q, k, v, do = randn(B, Nq, H, D), randn(B, Nk, H, D), randn(B, Nk, H, D), randn(B, Nq, H, D)
    mask = torch.rand(Nq, Nk) < 0.5
    k[0, 7, 1, 2], v[0, 30, 0, 4], q[0, 11, 0, 1], do[0, 35, 1, 3] = math.nan, math.nan, math.nan, math.nan
    check_against_oracle(q, k, v, do, mask=mask)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_poison_at_masked_keys_and_rows_never_leaks(value):
    """Keys no row attends and rows attending nothing, poisoned in k, v, q and dO, inside masked tiles."""
    B, H, Nq, Nk, D = 1, 1, 37, 53, 16
    q, k, v, do = randn(B, Nq, H, D), randn(B, Nk, H, D), randn(B, Nk, H, D), randn(B, Nq, H, D)
    mask = torch.rand(Nq, Nk) < 0.7
    mask[:, [3, 7, 52]] = False
    mask[[2, 5], :] = False
    k[:, [3, 7, 52]], v[:, [3, 7, 52]], q[:, [2, 5]], do[:, [2, 5]] = value, value, value, value
    check_against_oracle(q, k, v, do, mask=mask)
    blocks = torch.ones(1, 1, 2, 3, dtype=torch.bool)
    blocks[..., 1] = False
    q, k, v, do = randn(B, 30, H, D), randn(B, 40, H, D), randn(B, 40, H, D), randn(B, 30, H, D)
    k[:, 16:32], v[:, 16:32] = value, value
    check_against_oracle(q, k, v, do, block_mask=flashx.BlockMask(blocks, (16, 16)))


# ---------------------------------------------------------------- dropout


# Words with the top bit set (passed to the kernel as negative int32s), an offset past 2**32.
DROPOUT_DRAWS = [  # seed, rng_offset, Hq, b, h, i, j
    (0x0, 0, 1, 0, 0, 0, 0),
    (0x2A, 0x80000005, 4, 1, 2, 3, 5),
    (0x1234567890ABCDEF, 7, 8, 0, 7, 100, 1023),
    (0xFFFFFFFFFFFFFFFF, 4294967299, 16, 3, 15, 4095, 4094),
]


@triton.jit
def draw(OUT, i, j, stream, seed_lo, seed_hi, rng_offset, row0, key0, threshold):
    dropout = dropout_state(seed_lo, seed_hi, rng_offset, row0, key0, (threshold, 1.0))
    tl.store(OUT + tl.arange(0, 2), dropout_keep(i, j + tl.arange(0, 2) * 0, stream, dropout).to(tl.int8))


@pytest.mark.parametrize("seed, offset, hq, b, h, i, j", DROPOUT_DRAWS)
def test_kernel_dropout_draw_is_the_suites(seed, offset, hq, b, h, i, j):
    counter = (j // 4, i, b * hq + h, offset & 0xFFFFFFFF)  # the contract's Dropout section
    r = int(philox.philox4x32(counter, (seed & 0xFFFFFFFF, seed >> 32))[j % 4])
    x = torch.zeros(1, 1, 1, 16)
    draws = dropout_args(build_problem(x, x, x, dropout_p=0.5, seed=seed, rng_offset=offset))
    for threshold in (r, r + 1):  # r >= r keeps, r >= r + 1 drops: the kernel saw exactly r
        out = torch.empty(2, dtype=torch.int8)
        draw[(1,)](out, i, j, b * hq + h, *draws, threshold=threshold)
        assert out.tolist() == [int(r >= threshold)] * 2


def test_dropout_draws_are_int32s_at_every_seed_offset_and_position():
    """A launch serves every call whose tensors are laid out alike (``launch.call_args``), so the
    draws must travel in the one width Triton compiled them for, whatever their values."""
    x = torch.zeros(1, 1, 1, 16)
    for seed, offset, position in ((0, 0, 0), (2**64 - 1, 2**64 - 1, 2**31 - 1), (2**63, 2**32 + 3, 2**31 - 16)):
        problem = build_problem(x, x, x, dropout_p=0.5, seed=seed, rng_offset=offset,
                                dropout_offsets=(position, position))
        assert all(type(draw) is int and -2**31 <= draw < 2**31 for draw in dropout_args(problem))


def test_dropout_forward_and_backward_use_the_spec_mask():
    B, Hq, Hk, Nq, Nk, D = 2, 2, 1, 45, 70, 16
    q, k, v, do = randn(B, Nq, Hq, D), randn(B, Nk, Hk, D), randn(B, Nk, Hk, D), randn(B, Nq, Hq, D)
    options = dict(dropout_p=0.3, seed=0x1234567890ABCDEF, rng_offset=5, causal=True)
    check_against_oracle(q, k, v, do, **options)


# ---------------------------------------------------------------- determinism


def test_forward_and_backward_are_bitwise_reproducible():
    B, H, N, D = 1, 2, 64, 16
    q, k, v, do = (randn(B, N, H, D) for _ in range(4))
    first = flashx.attention_forward(q, k, v, backend="triton")
    again = flashx.attention_forward(q, k, v, backend="triton")
    assert torch.equal(first[0], again[0]) and torch.equal(first[1].lse, again[1].lse)
    grads = [flashx.attention_backward(do, q, k, v, *first, backend="triton", deterministic=True) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ---------------------------------------------------------------- tile choice


def test_unequal_head_dims_never_pair_a_narrow_tile_with_a_wide_one():
    """16- and 32-wide tiles beside wider ones miscompiled on the H100 (wrong dk, illegal accesses)."""
    from flashx_triton.arguments import tile_widths

    assert tile_widths(32, 128) == dict(BLOCK_D=64, BLOCK_DV=128)
    assert tile_widths(8, 64) == dict(BLOCK_D=64, BLOCK_DV=64)
    assert tile_widths(64, 32) == dict(BLOCK_D=64, BLOCK_DV=64)
    assert tile_widths(32, 32) == dict(BLOCK_D=32, BLOCK_DV=32)  # equal widths stay narrow
    assert tile_widths(40, 80) == dict(BLOCK_D=64, BLOCK_DV=128)


def test_tuning_tells_a_few_heads_from_a_full_gpu_at_the_same_length():
    from types import SimpleNamespace

    from flashx_triton import tuning

    def size(batch, heads, n):
        return tuning.size_class(SimpleNamespace(batch=batch, heads_q=heads, seqlen_q=n))

    assert size(2, 4, 1024) != size(16, 32, 1024)  # the benchmark's check, then its sweep
    assert size(16, 32, 1024) == size(8, 32, 1024)  # both fill an H100: more rows change nothing
    assert size(16, 32, 1024) != size(2, 32, 8192)  # as many rows, but the length still counts


def test_autotuner_drops_candidates_that_do_not_compile_or_disagree():
    from triton.runtime.errors import OutOfResources, PTXASError

    from flashx_triton import tuning

    good = torch.arange(6.0)
    failures = {"ptxas": PTXASError("register allocation failed"), "smem": OutOfResources(300000, 232448, "shared memory"),
                "pass": RuntimeError("PassManager::run failed")}

    def run(config):
        if config in failures:
            raise failures[config]
        return [good]

    assert tuning._first_that_runs(["ptxas", "smem", "pass", "ok"], run) == "ok"  # untimed
    log = []
    with pytest.MonkeyPatch.context() as patch:
        import triton.testing

        patch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: fn() or 1.0)
        assert tuning._fastest(["ptxas", "smem", "pass", "ok"], run, log) == "ok"
    assert log == [("ptxas", None), ("smem", None), ("pass", None), ("ok", 1.0)]
    assert not tuning._agree(good + 1, good) and tuning._agree(good + 1e-7, good)
    with pytest.raises(PTXASError):  # nothing left to fall back on
        tuning._first_that_runs(["smem", "ptxas"], run)


def test_autotuner_poisons_outputs_so_a_candidate_must_write_every_element(monkeypatch):
    """Every candidate writes into the same buffers: one that leaves elements unwritten (Triton's
    Hopper warp specialization did) must not pass off what the candidate before it wrote there."""
    import triton.testing

    from flashx_triton import tuning

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: fn() or 1.0)
    buffer = torch.tensor([0.0, 0.0, 0.0, 0.0, 7.0, 7.0])  # 7: set by the caller, written by no kernel

    def run(config):
        if config != "lazy":
            buffer[:4] = torch.arange(4.0)
        return [buffer]

    log = []
    assert tuning._fastest(["ok", "lazy"], run, log) == "ok"
    assert log == [("lazy", None), ("ok", pytest.approx(1.0, abs=0.1))]
    assert torch.equal(buffer, torch.tensor([0.0, 1.0, 2.0, 3.0, 7.0, 7.0]))  # as the first run left it


def test_autotuner_times_each_candidate_once_and_keeps_the_fastest(monkeypatch):
    """Each candidate that agrees with the first is timed once (do_bench's median) and the smallest
    median wins: the call path times nothing else (equal power states and host time are the
    benchmarks' methodology, not the tuner's)."""
    import triton.testing

    from flashx_triton import tuning

    medians = {"a": 3.0, "b": 2.0, "c": 2.5}
    output, timed, running = torch.arange(4.0), [], []

    def do_bench(fn, **kwargs):
        fn()
        timed.append(running[-1])
        return medians[running[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    log = []
    assert tuning._fastest(["a", "b", "c"], lambda config: running.append(config) or [output], log) == "b"
    assert timed == ["a", "b", "c"]
    assert log == [("a", 3.0), ("b", 2.0), ("c", 2.5)]


def test_launch_hands_later_calls_the_compiled_kernel_every_argument_in_order(monkeypatch):
    """The first call compiles through the JIT; later ones must give the compiled kernel the same
    positional arguments and a grid of three axes (its launcher indexes all three)."""
    import triton.compiler

    from flashx_triton.launch import Launch

    launched = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: launched.append(("compiled", grid, args))

    class Kernel:
        arg_names = ["X", "Y", "n", "scale", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *args, **options: launched.append(("jit", grid, args, options)) or Compiled()

    monkeypatch.setattr(triton.compiler, "CompiledKernel", Compiled)
    launch = Launch(Kernel(), (7,), {"num_warps": 4}, BLOCK=32, n=5, scale=0.5)
    launch("x1", "y1")
    launch("x2", "y2")
    assert launched == [("jit", (7, 1, 1), ("x1", "y1", 5, 0.5, 32), {"num_warps": 4}),
                        ("compiled", (7, 1, 1), ("x2", "y2", 5, 0.5, 32))]


def test_a_tuned_kernel_chooses_again_when_autotuning_is_switched(monkeypatch):
    """A caller may run untimed (the default), then with tuning (FLASHX_TRITON_AUTOTUNE=1):
    a problem seen by both must not keep the untimed choice."""
    from flashx_triton import tuning

    monkeypatch.setattr(tuning, "choose", lambda kernel, problem, run: "timed" if tuning.autotuning() else "shipped")
    tuned = tuning.Tuned("forward", lambda problem, config, x: lambda x: (config, x))
    monkeypatch.delenv("FLASHX_TRITON_AUTOTUNE", raising=False)
    assert tuned(None, 1) == ("shipped", 1)
    monkeypatch.setenv("FLASHX_TRITON_AUTOTUNE", "1")
    assert tuned(None, 2) == ("timed", 2)
    monkeypatch.setenv("FLASHX_TRITON_AUTOTUNE", "0")
    assert tuned(None, 3) == ("shipped", 3)




def test_calls_of_one_static_problem_share_their_launches_and_bring_their_own_values():
    """Masks, lengths and dropout seeds differ from call to call where shapes and options do not:
    such calls build their launches once (``per_problem`` keys on the static problem and on what
    Triton specialises on in the call's own values), and each computes with its own mask, lengths
    and seed."""
    from flashx_triton import launch

    q, k, v, do = (randn(2, 48, 2, 16) for _ in range(4))
    launch._built.clear()
    built = []
    # any seed: its words travel as int32s that Triton does not specialise (dropout.DROPOUT_DRAW)
    for p, n, seed in ((0.5, 40, 1), (0.8, 9, 2**40 + 16), (0.6, 33, 2**64 - 1)):
        check_against_oracle(q, k, v, do, mask=torch.rand(2, 1, 48, 48) < p, dropout_p=0.3, seed=seed,
                             seqlens_k=torch.tensor([n, 48 - n], dtype=torch.int32))
        built.append(len(launch._built))
    assert built == [2, 2, 2]  # the forward's and the backward's launches


def test_remembered_calls_compute_what_planned_calls_do(monkeypatch):
    """``flashx.attention`` remembers a call whole (``flashx.plan.call_key``), and the backend's
    prepared forward (``prepare_forward``) serves its later calls of the same metadata: a decoding
    step's one-row query in transformers' BHSD layout through ``sdpa_as_flashx``, and a causal
    prefill. Each call, with contents of its own, returns what ``forward`` returns on a problem
    validated afresh, bit for bit; so does one whose tensors lie at another alignment (forward's
    own way), and one whose operands are copied or negated on each call (a strided head dim, a
    negative scale)."""
    from flashx import plan
    from flashx.compat import sdpa_as_flashx
    from flashx_triton import forward as module
    from flashx_triton.forward import forward

    forwards = []  # calls that take forward's own way
    monkeypatch.setattr(module, "forward", lambda *args: forwards.append(1) or forward(*args))

    def planned(q, k, v, **options):
        return forward(build_problem(q, k, v, **options), q, k, v)[0]

    def step(length):
        query = randn(2, 1, 4 * 16).view(2, 1, 4, 16).transpose(1, 2)  # a transposed projection
        return query, randn(2, 2, length, 16), randn(2, 2, length, 16)

    monkeypatch.setattr(plan, "_calls", {})
    for query, key, value in (step(40), step(40), step(40), step(41)):
        o = sdpa_as_flashx(query, key, value, scale=0.25, enable_gqa=True, backend="triton")
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        assert torch.equal(o, planned(q, k, v, softmax_scale=0.25, causal=False, window=None, mask=None,
                                      dropout_p=0.0))
    assert sum(key[0] == "sdpa_as_flashx" for key in plan._calls) == 2  # one a length

    def misaligned(*shape):  # a view 4 bytes into its storage: the strides of a contiguous tensor
        return randn(1 + math.prod(shape))[1:].view(*shape)

    q, k, v = randn(2, 40, 2, 16), randn(2, 40, 2, 16), randn(2, 40, 2, 16)
    strided = randn(2, 40, 2, 32)[..., ::2]
    causal, negative = dict(causal=True), dict(causal=True, softmax_scale=-0.5)
    for inputs, options, forward_calls in (((q, k, v), causal, 0), ((q, misaligned(2, 40, 2, 16), v), causal, 1),
                                           ((q, k, v), causal, 0), ((strided, k, v), causal, 1),
                                           ((strided, k, v), causal, 1), ((q, k, v), negative, 1),
                                           ((q, k, v), negative, 1)):
        forwards.clear()
        o = flashx.attention(*inputs, backend="triton", **options)
        assert len(forwards) == forward_calls
        assert torch.equal(o, planned(*inputs, **options))
        assert plan.prepared(plan.call_key(*inputs, "triton", options)) is not None


def test_a_short_query_runs_as_decoding_planned_or_remembered(monkeypatch):
    """A query of at most decode.SHORT_QUERY rows whose rows of a kv head fill one row tile (Nq x
    group <= 64) runs as decoding (``decode.attention_as_decoding``): as the oracle, its backward
    from those residuals included, on a planned call and on a remembered one. 17 rows take the
    forward kernel."""
    from flashx_triton import decode, forward as module

    decoded = []
    run = module.decode
    monkeypatch.setattr(module, "decode", lambda *args: decoded.append(args[0].seqlen_q) or run(*args))
    for nq in (1, decode.SHORT_QUERY, decode.SHORT_QUERY + 1):
        q, do = randn(2, nq, 8, 16), randn(2, nq, 8, 16)
        k, v = randn(2, 90, 2, 16), randn(2, 90, 2, 16)
        check_against_oracle(q, k, v, do, causal=True, window=(40, 0))
        first, again = (flashx.attention(q, k, v, backend="triton", softcap=3.0) for _ in range(2))
        assert torch.equal(first, again)
    assert decoded == [1] * 3 + [decode.SHORT_QUERY] * 3


# ---------------------------------------------------------------- accumulating into running sums


def _accumulating_case(name):
    """(q, k, v, do, options) of a small problem: padded with GQA, lengths or dropout, or packed
    with an empty sequence and rows past the last."""
    torch.manual_seed(zlib_seed(name))
    if name == "packed":
        cu = torch.tensor([0, 30, 30, 75], dtype=torch.int32)
        q, do = randn(90, 4, 16), randn(90, 4, 16)
        k, v = randn(80, 2, 16), randn(80, 2, 16)
        return q, k, v, do, dict(cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, 20, 50, 80], dtype=torch.int32),
                                 causal=True)
    q, do = randn(2, 70, 4, 16), randn(2, 70, 4, 16)
    k, v = randn(2, 100, 2, 16), randn(2, 100, 2, 16)
    options = {"causal": dict(causal=True),
               "dropout": dict(window=(9, 20), dropout_p=0.3, seed=5, softcap=2.0),
               "lengths": dict(seqlens_q=torch.tensor([70, 33], dtype=torch.int32),
                               seqlens_k=torch.tensor([41, 100], dtype=torch.int32), causal=True),
               "nan": dict(causal=True)}[name]
    if name == "nan":  # a key that the plain launch's masked tiles meet in rows that may not read it
        v[:, 90] = math.nan
    return q, k, v, do, options


def zlib_seed(name: str) -> int:
    return sum(map(ord, name))


def _running(shape, lse_shape):
    """A running state (o, lse) in float32, some rows still empty (lse = -inf, o = 0), inside views
    of larger buffers as a ring passes them (rows 3 on)."""
    o = randn(*shape[:-3], shape[-3] + 3, *shape[-2:])[..., 3:, :, :]
    lse = randn(*lse_shape[:-1], lse_shape[-1] + 3)[..., 3:]
    lse[..., :5] = -math.inf
    o.transpose(-3, -2)[..., :5, :] = 0.0
    return o, lse


@pytest.mark.parametrize("name", ["causal", "dropout", "lengths", "packed", "nan"])
def test_forward_into_merges_as_the_cores_merge_of_a_returned_part(name):
    """Kernels that merge as they write against the core's merge of the plain call's (o, lse), and
    against the float64 oracle merged in float64. With a NaN in V the plain launch meets it in
    masked tiles: a program it flags must merge once, in the exact launch."""
    from flashx.accumulate import run_forward_into
    from flashx.api import merge_weights
    from flashx.options import complete
    from flashx.plan import plan

    q, k, v, _, options = _accumulating_case(name)
    problem, triton_impl = plan(q, k, v, "triton", complete("attention_forward", dict(options)))
    _, numpy_impl = plan(q, k, v, "numpy", complete("attention_forward", dict(options)))
    assert triton_impl.implements("forward_into") and not numpy_impl.implements("forward_into")
    o_sums, lse_sums = _running(problem.o_shape, problem.lse_shape)
    start = o_sums.clone(), lse_sums.clone()
    o_base, lse_base = o_sums._base.clone(), lse_sums._base.clone()
    run_forward_into(triton_impl, problem, q, k, v, o_sums, lse_sums)
    fallback = [x.clone() for x in start]
    run_forward_into(numpy_impl, problem, q, k, v, *fallback)
    for got, want in zip((o_sums, lse_sums), fallback):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(o_sums._base[..., :3, :, :], o_base[..., :3, :, :])  # the rows before the view
    assert torch.equal(lse_sums._base[..., :3], lse_base[..., :3])
    numpy_options = {key: x.numpy() if isinstance(x, torch.Tensor) else x for key, x in options.items()}
    o, lse = oracle.forward(*(x.double().numpy() for x in (q, k, v)), **numpy_options)
    weight_start, weight, merged = merge_weights(np, start[1].double().numpy(), np.asarray(lse))
    want = weight_start * start[0].double().numpy() + weight * np.nan_to_num(np.asarray(o), nan=np.nan)
    if problem.varlen:  # rows of no sequence are left as they were
        want[75:], merged[:, 75:] = start[0][75:].numpy(), start[1][:, 75:].numpy()
    np.testing.assert_allclose(o_sums.double().numpy(), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse_sums.double().numpy(), merged, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["causal", "dropout", "lengths", "packed", "nan"])
def test_backward_into_adds_what_backward_returns_unrounded(name):
    """Gradient programs that add into running float32 sums against the core's sums of the plain
    call's parts; a program the plain launch flags adds once, in the exact launch."""
    from flashx.accumulate import run_backward_into
    from flashx.options import complete
    from flashx.plan import plan

    q, k, v, do, options = _accumulating_case(name)
    problem, triton_impl = plan(q, k, v, "triton", complete("attention_forward", dict(options)))
    _, numpy_impl = plan(q, k, v, "numpy", complete("attention_forward", dict(options)))
    assert triton_impl.implements("backward_into")
    o, lse = flashx.attention(q, k, v, return_lse=True, backend="numpy", **options)
    sums = [randn(*x.shape) for x in (q, k, v)]
    fallback = [x.clone() for x in sums]
    assert run_backward_into(triton_impl, problem, q, k, v, o, lse, do, *sums) is None
    run_backward_into(numpy_impl, problem, q, k, v, o, lse, do, *fallback)
    for got, want in zip(sums, fallback):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5, equal_nan=True)


def test_backward_into_with_sinks_returns_dsinks():
    from flashx.accumulate import run_backward_into
    from flashx.options import complete
    from flashx.plan import plan

    q, k, v, do, options = _accumulating_case("causal")
    options["sinks"] = torch.tensor([0.5, -1.0, 2.0, -math.inf])
    problem, impl = plan(q, k, v, "triton", complete("attention_forward", dict(options)))
    o, lse = flashx.attention(q, k, v, return_lse=True, backend="numpy", **options)
    sums = [torch.zeros(x.shape) for x in (q, k, v)]
    dsinks = run_backward_into(impl, problem, q, k, v, o, lse, do, *sums)
    want = flashx.attention_backward(do, q, k, v, o, flashx.Residuals(lse, 0, 0), backend="numpy", **options)
    for got, part in zip((*sums, dsinks), want):
        torch.testing.assert_close(got, part.float(), rtol=1e-5, atol=2e-5)
