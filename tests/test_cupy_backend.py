"""The CuPy backend: its host side (variant choice, argument packing, cache keys, availability)
runs anywhere; the kernels, against the float64 oracle, only where a CUDA GPU is present."""

from __future__ import annotations

import math
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

import flashx
from flashx.problem import Problem
from flashx_conformance import oracle
from flashx_cupy import CupyBackend, decode, launch, tma, unavailable_reason, variants


def _problem(**changes):
    fields = dict(dtype="bfloat16", seqlen_k=8192, head_dim=128, head_dim_v=128, varlen=False, seqlens_q=None,
                  seqlens_k=None, mask=None, block_mask=None, dropout_p=0.0, deterministic=False, band=None, softcap=None,
                  alibi_slopes=None, sinks=None, softmax_scale=0.125)
    fields |= changes
    fp8 = fields["dtype"].startswith("float8")
    return SimpleNamespace(**({"fp8": fp8, "fp8_dtype": fields["dtype"] if fp8 else None,
                               "out_dtype": "bfloat16" if fp8 else fields["dtype"]} | fields))


def _gpu() -> bool:
    return unavailable_reason() is None


@pytest.fixture(autouse=True)
def _fresh_launches(monkeypatch):
    """Each test builds its launches afresh (``launch.per_problem``), under the patches it makes."""
    monkeypatch.setattr(launch, "_built", {})


def _route_launches(monkeypatch, device, record):
    """The forward's and backward's launches on ``device`` (an H100's 132 SMs) call ``record(variant,
    grid, params, extra)`` (``params``: the struct as its layout) instead of a kernel."""
    import contextlib

    layouts = {layout.itemsize: layout for layout in (launch.PARAMS, launch.BACKWARD_PARAMS)}
    monkeypatch.setattr(launch, "caller_stream", lambda problem, x: contextlib.nullcontext((device, None)))
    monkeypatch.setattr(launch, "device_size", lambda device_id: (132, 228 * 1024))

    def kernel_of(variant, device):
        def kernel(grid, block, args, shared_mem, stream):
            record(variant, grid[0], args[0].view(layouts[args[0].itemsize]), args[1:])
        return kernel

    monkeypatch.setattr(launch, "_kernel", kernel_of)


# -- declarations and availability ---------------------------------------------------------

def test_declarations():
    backend = flashx.registry.get("cupy")
    assert isinstance(backend, CupyBackend)
    assert backend.features <= frozenset(flashx.problem.FEATURES)
    assert {"softcap", "alibi", "sinks"} <= backend.features
    assert backend.deterministic_backward and backend.devices == {"cuda"}


@pytest.mark.skipif(_gpu(), reason="a GPU is present")
def test_unavailable_reason_without_a_gpu():
    reason = flashx.registry.get("cupy").available()
    assert reason is not None and ("CUDA device" in reason or "cannot import" in reason)
    info = next(b for b in flashx.backends() if b.name == "cupy")
    assert not info.available and info.reason == reason


# -- variants --------------------------------------------------------------------------------

@pytest.mark.parametrize("dim, expected", [(8, 64), (64, 64), (65, 128), (128, 128), (200, 256), (256, 256)])
def test_head_dim_class(dim, expected):
    assert flashx.problem.head_dim_class(dim) == expected


def test_variant_follows_the_problem():
    plain = variants.choose("forward", _problem(), aligned=True)
    assert (plain.dim_qk, plain.dim_v, plain.block_m, plain.block_n, plain.warps) == (128, 128, 128, 64, 4)
    assert plain.macros["DTYPE"] == 1 and not any(plain.macros[m] for m in ("MASK", "BLOCK_MASK", "DROPOUT", "VARLEN"))
    featured = variants.choose("forward", _problem(dtype="float32", head_dim=40, head_dim_v=200, mask=1, dropout_p=0.1,
                                                   varlen=True), aligned=False)
    assert (featured.dim_qk, featured.dim_v) == (64, 256)
    assert featured.macros | {} == featured.macros and featured.macros["DTYPE"] == 2
    assert featured.macros["MASK"] == featured.macros["DROPOUT"] == featured.macros["VARLEN"] == 1
    assert featured.macros["ALIGNED"] == 0 and featured.block_m == 32  # float32 at 256 wide: two warps
    assert plain.options != featured.options


@pytest.mark.parametrize("kernel", ["forward", "forward_sm90", "dq", "dkdv", "dq_sm90", "dkdv_sm90", "delta"])
def test_score_mods_are_compile_time_options(kernel):
    """Each modification is a macro of the variants that use it, 0 for a call without it (today's
    code); the dK/dV kernel, which sees the sink only through the LSE, is built without SINKS."""
    plain = variants.choose(kernel, _problem(), aligned=True)
    assert plain.macros["SOFTCAP"] == plain.macros["ALIBI"] == plain.macros["SINKS"] == 0
    modified = variants.choose(kernel, _problem(softcap=30.0, alibi_slopes=object(), sinks=object()), aligned=True)
    assert modified.macros["SOFTCAP"] == modified.macros["ALIBI"] == 1
    key_side = kernel in ("dkdv", "dq_sm90", "dkdv_sm90")  # no delta kernel in the build
    assert modified.macros["SINKS"] == (not key_side)
    assert modified.options != plain.options and modified.shared_memory == plain.shared_memory
    for one in ("softcap", "alibi", "sinks"):  # each alone, the others off
        alone = variants.choose(kernel, _problem(**{"softcap" if one == "softcap" else f"{one}_slopes" if one == "alibi"
                                                    else one: 1.0 if one == "softcap" else object()}), aligned=True)
        assert [alone.macros[m] for m in ("SOFTCAP", "ALIBI", "SINKS")] == [
            int(one == "softcap"), int(one == "alibi"), int(one == "sinks" and not key_side)]


@pytest.mark.parametrize("kernel", ["forward", "forward_sm90", "forward_fp8_sm90", "dq", "dkdv", "delta"])
def test_negative_scale_is_a_forward_option(kernel):
    """A negative softmax_scale builds the wgmma forwards apart (their row max is then over the
    scaled scores, not the dot products); the other kernels build the same for either sign."""
    positive, negative = (variants.choose(kernel, _problem(softmax_scale=scale, dtype="float8_e4m3fn" if "fp8" in kernel
                                                           else "bfloat16"), aligned=True) for scale in (0.125, -0.125))
    forward = kernel in variants.SM90_FORWARDS
    assert positive.macros.get("NEGATIVE_SCALE") == (0 if forward else None)
    assert (negative.options != positive.options) == forward


def test_delta_shares_the_dq_build():
    dq, delta = (variants.choose(kernel, _problem(), aligned=True) for kernel in ("dq", "delta"))
    assert dq.options == delta.options and variants.FILES["dq"] == variants.FILES["delta"]
    assert dq.entry_point != delta.entry_point and delta.threads == 32 * variants.DELTA_WARPS


@pytest.mark.parametrize("key", sorted(variants.TILES))
@pytest.mark.parametrize("split", [False, True])
def test_tiles_fit(key, split):
    """Warps own whole 16-row atoms, tiles feed mma in 16s, and shared memory fits the H100."""
    kernel, width, dim = key
    block_m, block_n, warps = variants.TILES[key]
    assert block_m % (16 * warps) == 0 and block_n % 16 == 0
    dtype = {"32": "float32", "8": "float8_e4m3fn"}.get(width, "bfloat16")
    fused, masked = kernel == "dkdv_dq", kernel == "forward_mask"
    variant = variants.choose({"dkdv_dq": "dkdv", "forward_mask": "forward"}.get(kernel, kernel),
                              _problem(dtype=dtype, head_dim=dim, head_dim_v=dim if not split else 64,
                                       mask=object() if masked else None),
                              aligned=True, dq_atomic=fused)
    assert (variant.block_m, variant.block_n, variant.warps) == (block_m, block_n, warps)
    assert variant.shared_memory <= 227 * 1024


@pytest.mark.parametrize("changes, capability, is_aligned, kernel", [
    ({}, "90", True, "forward_sm90"),
    ({"dtype": "float16", "head_dim": 64, "head_dim_v": 64}, "90", True, "forward_sm90"),
    ({"band": (-1, 0), "varlen": True, "seqlens_k": object()}, "90", True, "forward_sm90"),  # the pair rule's band
    ({}, "80", True, "forward"),  # wgmma is sm_90a code
    ({}, "100", True, "forward"),
    ({}, "90", False, "forward"),  # cp.async copies 16-byte chunks
    ({"dtype": "float32"}, "90", True, "forward"),
    ({"head_dim_v": 256}, "90", True, "forward"),
    ({"mask": object()}, "90", True, "forward_sm90"),
    ({"block_mask": object()}, "90", True, "forward_sm90"),
    ({"dropout_p": 0.1}, "90", True, "forward_sm90"),
    ({"dropout_p": 0.1, "head_dim": 64, "head_dim_v": 64, "band": (-1, 0)}, "90", True, "forward_sm90"),
    ({"dropout_p": 0.1, "mask": object(), "block_mask": object()}, "90", True, "forward_sm90"),
    ({"mask": object()}, "90", False, "forward"),
    ({"dtype": "float8_e4m3fn", "block_mask": object()}, "90", True, "forward_fp8_sm90"),
    ({"softcap": 30.0, "alibi_slopes": object(), "sinks": object()}, "90", True, "forward_sm90"),  # the shared softmax
    ({"softcap": 30.0, "alibi_slopes": object(), "sinks": object()}, "80", True, "forward"),
    ({"dtype": "float8_e4m3fn"}, "90", True, "forward_fp8_sm90"),  # FP8: the one forward (fp8_forward_reasons)
    ({"dtype": "float8_e4m3fn", "mask": object(), "head_dim": 64}, "90", True, "forward_fp8_sm90"),
])
def test_forward_kernel_choice(changes, capability, is_aligned, kernel):
    assert variants.forward_kernel(_problem(**changes), is_aligned, capability) == kernel


@pytest.mark.parametrize("changes, tma_, kernel", [
    ({"head_dim": 256, "head_dim_v": 256}, True, "forward_sm90"),
    ({"head_dim": 192, "head_dim_v": 256, "band": (-1, 0), "seqlens_k": object()}, True, "forward_sm90"),
    ({"head_dim": 256, "head_dim_v": 256, "dtype": "float16", "softcap": 30.0}, True, "forward_sm90"),
    ({"head_dim": 256, "head_dim_v": 256}, False, "forward"),  # two V buffers need TMA's producer
    ({"head_dim": 256, "head_dim_v": 256, "varlen": True}, False, "forward"),
    ({"head_dim": 128, "head_dim_v": 256}, True, "forward"),  # mixed classes
    ({"head_dim": 256, "head_dim_v": 64}, True, "forward"),
    ({"head_dim": 256, "head_dim_v": 256, "dropout_p": 0.1}, True, "forward"),  # Philox's registers spill
    ({"head_dim": 256, "head_dim_v": 256, "mask": object()}, True, "forward"),  # ... and the pair tests
    ({"head_dim": 256, "head_dim_v": 256, "block_mask": object()}, True, "forward"),
    ({}, False, "forward_sm90"),
])
def test_forward_kernel_choice_d256(changes, tma_, kernel):
    """Both head dims of class 256 take the wgmma forward where K and V come by TMA."""
    assert variants.forward_kernel(_problem(**changes), True, "90", tma_) == kernel


@pytest.mark.parametrize("dim", [64, 128])
def test_sm90_forward_variant(dim):
    """Swizzled tiles start on 1024-byte boundaries; the build targets sm_90a, the mma.sync one does not."""
    problem = _problem(head_dim=dim, head_dim_v=dim)
    variant = variants.choose("forward_sm90", problem, aligned=True)
    size = variants.ELEMENT_SIZES[variant.dtype]
    tiles = (variant.block_m * dim * size, variant.block_n * dim * size)
    assert all(bytes_ % 1024 == 0 for bytes_ in tiles)
    # Q, two K and three V tiles, a tile of zeros, the barriers
    assert variant.shared_memory == tiles[0] + 6 * tiles[1] + 128 <= 227 * 1024
    assert variant.block_m == 16 * variant.warps and variant.warps % 4 == 0  # one atom a warp, whole warpgroups
    assert variant.threads == 32 * (variant.warps + variants.PRODUCER_WARPS)  # and a producer warpgroup
    assert f"#define PRODUCER_THREADS {32 * variants.PRODUCER_WARPS} " in (variants.KERNELS / "forward_sm90.cu").read_text()
    assert "--gpu-architecture=sm_90a" in variant.options and variant.entry_point == "flashx_forward_sm90"
    plain = variants.choose("forward", problem, aligned=True)
    assert not any(option.startswith("--gpu-architecture") for option in plain.options)
    versions = ("14.2.0", (13, 0), "90")
    assert (variants.cache_key(variants.source(variants.FILES[variant.kernel]), variant.options, versions)
            != variants.cache_key(variants.source(variants.FILES[plain.kernel]), plain.options, versions))


@pytest.mark.parametrize("changes, tma_, tile", [
    ({}, True, (128, 176, 8, 2)),  # FA3's 176 keys at d128 without a band, by TMA
    ({}, False, (128, 128, 8, 3)),  # two V buffers need TMA's producer
    ({"band": (-1, 0)}, True, (128, 128, 8, 3)),  # causal
    ({"band": (64, 64)}, True, (128, 128, 8, 3)),  # a window
    ({"head_dim": 64, "head_dim_v": 128}, True, (128, 176, 8, 2)),  # the wider class picks
    ({"head_dim": 128, "head_dim_v": 64, "seqlens_k": object()}, True, (128, 176, 8, 2)),
    ({"head_dim": 64, "head_dim_v": 64}, True, (192, 128, 12, 3)),  # three warpgroups at d64
    ({"head_dim": 40, "head_dim_v": 64, "band": (-1, 0)}, False, (128, 128, 8, 3)),  # two under a band
    ({"seqlen_k": 2048}, True, (128, 128, 8, 3)),  # a short loop over key tiles: SHORT_TILE
    ({"seqlen_k": 512, "head_dim": 64, "head_dim_v": 64}, False, (128, 128, 8, 3)),
    ({"seqlen_k": 2049}, True, (128, 176, 8, 2)),
    ({"seqlen_k": 512, "head_dim": 256, "head_dim_v": 256}, True, (128, 80, 8, 2)),  # d256 keeps its table
    ({"dtype": "float16", "head_dim": 64, "head_dim_v": 64, "varlen": True}, False, (192, 128, 12, 3)),
    ({"head_dim": 256, "head_dim_v": 256}, True, (128, 80, 8, 2)),  # FA3's 80 keys at d256, by TMA
    ({"head_dim": 160, "head_dim_v": 256, "band": (-1, 0)}, True, (128, 80, 8, 2)),
    ({"dropout_p": 0.1}, True, (128, 128, 8, 3)),  # Philox's registers spill beside S of 176 keys
    ({"dropout_p": 0.1, "head_dim": 64, "head_dim_v": 64}, True, (128, 128, 8, 3)),  # ... or in a third warpgroup
    ({"block_mask": object()}, True, (128, 128, 8, 3)),  # the tile votes, likewise
    ({"block_mask": object(), "head_dim": 64, "head_dim_v": 64}, True, (128, 128, 8, 3)),
    ({"mask": object(), "head_dim": 64, "head_dim_v": 64}, True, (128, 128, 8, 3)),  # the pair tests
    ({"mask": object(), "dropout_p": 0.1, "band": (-1, 0)}, True, (128, 64, 8, 3)),  # ... beside 64 keys at d128
    ({"block_mask": object(), "dropout_p": 0.1}, True, (128, 64, 8, 3)),  # and a block mask's beside Philox's
])
def test_sm90_forward_tiles(changes, tma_, tile):
    """FORWARD_SM90_TILES by the widest head-dim class, the band and the loads; the V ring's size
    travels as V_BUFFERS, and shared memory counts the zeros apart only beside three V buffers."""
    variant = variants.choose("forward_sm90", _problem(**changes), aligned=True, tma=tma_)
    assert (variant.block_m, variant.block_n, variant.warps, variant.v_buffers) == tile
    assert variant.macros["V_BUFFERS"] == variant.v_buffers and variant.macros["BLOCK_N"] == variant.block_n
    assert variant.threads == 32 * (variant.warps + variants.PRODUCER_WARPS)
    size = variants.ELEMENT_SIZES[variant.dtype]
    q = variant.block_m * variant.dim_qk * size
    k, v = (variant.block_n * dim * size for dim in (variant.dim_qk, variant.dim_v))
    zeros = v if variant.v_buffers == 3 else 0  # else in the ring
    assert variant.shared_memory == q + 2 * k + variant.v_buffers * v + zeros + 128 <= 227 * 1024


@pytest.mark.parametrize("key", sorted(variants.FORWARD_SM90_TILES))
def test_sm90_forward_tiles_fit(key):
    """Every tile of the table: whole warpgroups of 64 rows, one 16-row atom a warp, S's N a product
    that wgmma.cuh writes, 1024-byte swizzled tiles, two V buffers only by TMA, and shared memory
    (Q, two K and the V tiles with the zeros) within the H100's 227 KiB at both head dims of the class."""
    widest, banded, tma_ = key
    block_m, block_n, warps, v_buffers = variants.FORWARD_SM90_TILES[key]
    assert block_m == 16 * warps and warps % 4 == 0 and block_n in (64, 80, 128, 176)
    assert v_buffers == 3 or (v_buffers == 2 and tma_)
    for dim_qk, dim_v in ((widest, widest), (widest, 64), (64, widest)):
        problem = _problem(head_dim=dim_qk, head_dim_v=dim_v, band=(-1, 0) if banded else None)
        variant = variants.choose("forward_sm90", problem, aligned=True, tma=tma_)
        assert (variant.block_m, variant.block_n, variant.warps, variant.v_buffers) == (block_m, block_n, warps, v_buffers)
        assert all(rows * dim * 2 % 1024 == 0 for rows in (block_m, block_n) for dim in (dim_qk, dim_v))
        assert variant.shared_memory <= 227 * 1024


def test_sm90_forward_tiles_restore():
    """A benchmark's A/B: one shape for every key restores the single 128 x 128 CTA of two warpgroups."""
    table = dict.fromkeys(variants.FORWARD_SM90_TILES, (128, 128, 8, 3))
    original = variants.FORWARD_SM90_TILES
    try:
        variants.FORWARD_SM90_TILES = table
        for dim in (64, 128):
            for tma_ in (False, True):
                variant = variants.choose("forward_sm90", _problem(head_dim=dim, head_dim_v=dim), aligned=True, tma=tma_)
                assert (variant.block_m, variant.block_n, variant.warps, variant.v_buffers) == (128, 128, 8, 3)
    finally:
        variants.FORWARD_SM90_TILES = original


@pytest.mark.parametrize("changes, capability, is_aligned, sm90", [
    ({}, "90", True, True),
    ({"dtype": "float16", "head_dim": 64, "head_dim_v": 64, "band": (-1, 0)}, "90", True, True),
    ({"head_dim": 64, "head_dim_v": 64, "deterministic": True}, "90", True, True),
    ({"head_dim": 64, "head_dim_v": 64}, "90", True, True),  # with the fused dQ (fused_dq)
    ({"head_dim": 40, "head_dim_v": 96}, "90", True, True),  # classes 64 and 128
    ({"mask": object(), "block_mask": object(), "dropout_p": 0.1, "band": (-1, 0), "varlen": True}, "90", True,
     True),  # dq.cuh's and dkdv.cuh's pair rule, dropout and exact path
    ({"softcap": 30.0, "alibi_slopes": object(), "sinks": object()}, "90", True, True),
    ({"deterministic": True}, "90", True, True),  # no atomics
    ({}, "80", True, False),  # wgmma is sm_90a code
    ({}, "100", True, False),
    ({}, "90", False, False),  # cp.async copies 16-byte chunks
    ({"dtype": "float32"}, "90", True, False),
    ({"head_dim_v": 256}, "90", True, True),  # dK and dV in two launches, steps of 32 rows
    ({"head_dim": 256, "head_dim_v": 256, "dropout_p": 0.1, "band": (-1, 0)}, "90", True, True),
])
def test_sm90_backward_choice(monkeypatch, changes, capability, is_aligned, sm90):
    monkeypatch.delenv(variants.SM90_BACKWARD_ENV, raising=False)
    assert variants.sm90_backward(_problem(**changes), is_aligned, capability) is sm90
    monkeypatch.setenv(variants.SM90_BACKWARD_ENV, "0")  # the switch back to mma.sync, for comparisons
    assert variants.sm90_backward(_problem(**changes), is_aligned, capability) is False


@pytest.mark.parametrize("kernel", ["dq_sm90", "dkdv_sm90"])
@pytest.mark.parametrize("dim_qk, dim_v", [(64, 64), (128, 128), (64, 128), (256, 256), (128, 256), (256, 64)])
def test_sm90_backward_variants(kernel, dim_qk, dim_v):
    """Two computing warpgroups of 64 resident rows, a producer warpgroup, and steps of 64 streamed
    rows (32 at d256) through a ring of buffers, each stage with two barriers and its item: three
    stages unless the carve would pass 227 KiB; swizzled tiles start on 1024-byte boundaries; the
    builds target sm_90a and see the ring's stages."""
    widest = max(dim_qk, dim_v)
    variant = variants.choose(kernel, _problem(head_dim=dim_qk, head_dim_v=dim_v), aligned=True)
    assert (variant.block_m, variant.block_n, variant.warps) == (128, 64 if widest <= 128 else 32, 8)
    assert variant.threads == 32 * (variant.warps + variants.PRODUCER_WARPS)
    assert (variant.dkdv_parts, variant.dq_atomic) == (3, False)
    size = variants.ELEMENT_SIZES[variant.dtype]
    tiles = [rows * dim * size for rows in (variant.block_m, variant.block_n) for dim in (dim_qk, dim_v)]
    assert all(bytes_ % 1024 == 0 for bytes_ in tiles)

    # the resident tiles, the ring's streamed ones, then dK/dV's LSE and D a stage or dQ's allowed pairs of a
    # tile; the ring's two mbarriers, item and cover a stage
    def carve(stages):
        extra = stages * 2 * variant.block_n * 4 if kernel == "dkdv_sm90" else variant.block_m * variant.block_n
        return tiles[0] + tiles[1] + stages * (tiles[2] + tiles[3]) + extra + stages * (2 * 8 + 2 * 4)

    stages = variants.RING_STAGES if carve(variants.RING_STAGES) <= 227 * 1024 else 2
    assert variant.ring_stages == stages and variant.shared_memory == carve(stages) <= 227 * 1024
    assert f"-DRING_STAGES={stages}" in variant.options
    assert (kernel, widest, stages) != ("dkdv_sm90", 256, 2)  # three stages fit beside K and V at d256
    assert "--gpu-architecture=sm_90a" in variant.options and variant.entry_point == f"flashx_{kernel}"
    assert f"#define PRODUCER_THREADS {32 * variants.PRODUCER_WARPS} " in (variants.KERNELS / variants.FILES[kernel]).read_text()
    assert f"#define RING_STAGES {variants.RING_STAGES} " in (variants.KERNELS / "ring.cuh").read_text()
    assert '#include "ring.cuh"' in (variants.KERNELS / variants.FILES[kernel]).read_text()


@pytest.mark.parametrize("capability, switch, changes, launched", [
    ("90", None, {}, ["delta", "dkdv_sm90 adding dQ", "dq_round"]),  # fused_dq: flashx_dq_sm90 does not run
    ("90", None, {"causal": True}, ["delta", "dkdv_sm90 adding dQ", "dq_round"]),  # a band: the sums in one launch
    ("90", None, {"causal": True, "sums_whole_bytes": 0}, ["delta", "dq_sm90", "dkdv_sm90"]),  # or the split kernels
    ("90", None, {"deterministic": True}, ["delta", "dq_sm90", "dkdv_sm90"]),  # no atomics
    ("90", "0", {}, ["delta", "dkdv adding dQ", "dq_round"]),  # the mma.sync kernel with its fused dQ
    ("90", "0", {"causal": True}, ["delta", "dq", "dkdv"]),
    ("80", None, {}, ["delta", "dkdv adding dQ", "dq_round"]),
    ("90", None, {"head_dim": 256, "head_dim_v": 256}, ["delta", "dq_sm90", "dkdv_sm90", "dkdv_sm90"]),  # dK, then dV
    ("90", "0", {"head_dim": 256, "head_dim_v": 256}, ["delta", "dq", "dkdv", "dkdv"]),
    ("90", None, {"head_dim": 64, "head_dim_v": 64}, ["delta", "dkdv_sm90 adding dQ", "dq_round"]),
    ("90", None, {"head_dim": 64, "head_dim_v": 64, "causal": True}, ["delta", "dkdv_sm90 adding dQ", "dq_round"]),
    ("90", None, {"causal": True, "deterministic": True}, ["delta", "dq_sm90", "dkdv_sm90"]),
])
def test_backward_launches(monkeypatch, capability, switch, changes, launched):
    """On compute capability 9.0 a 16-bit backward takes the wgmma kernels: flashx_dkdv_sm90 adding
    dQ where ``fused_dq`` holds, else the two kernels, which add no atomics; the switch brings back
    the mma.sync kernels. ``sums_whole_bytes`` in ``changes`` sets launch.DQ_SUMS_WHOLE_BYTES."""

    import torch

    if "sums_whole_bytes" in changes:
        monkeypatch.setattr(launch, "DQ_SUMS_WHOLE_BYTES", changes.pop("sums_whole_bytes"))
    if switch is None:
        monkeypatch.delenv(variants.SM90_BACKWARD_ENV, raising=False)
    else:
        monkeypatch.setenv(variants.SM90_BACKWARD_ENV, switch)
    dim, dim_v = changes.pop("head_dim", 128), changes.pop("head_dim_v", 128)
    problem = _torch_problem(dtype="bfloat16", head_dim=dim, head_dim_v=dim_v, **changes)
    q, do = (torch.zeros(2, 5, 3, dim, dtype=torch.bfloat16) for _ in range(2))
    o = torch.zeros(2, 5, 3, dim_v, dtype=torch.bfloat16)
    k, v = torch.zeros(2, 7, 1, dim, dtype=torch.bfloat16), torch.zeros(2, 7, 1, dim_v, dtype=torch.bfloat16)
    lse = torch.zeros(problem.lse_shape)
    device = SimpleNamespace(id=0, compute_capability=capability)
    kernels = []
    _route_launches(monkeypatch, device, lambda variant, *args: kernels.append(variant.kernel + " adding dQ" * variant.dq_atomic))
    launch.backward(problem, q, k, v, o, lse, do)
    assert kernels == launched


@pytest.mark.parametrize("options, kernel, ctas, inner", [
    (dict(causal=True), "dkdv_sm90", 4096, True),  # causal: the backward's kernels at every size
    (dict(causal=True), "dq", 10**6, True),
    (dict(causal=True), "forward_sm90", 8 * 132, True),  # the forward while its grid is short
    (dict(causal=True), "forward_sm90", 8 * 132 + 1, False),
    (dict(causal=True, window=(-1, 5)), "dkdv", 64, True),  # the left side still unbounded
    ({}, "dkdv_sm90", 64, False),  # no band: every tile of a head does the same work
    (dict(window=(1024, 0)), "dkdv_sm90", 64, False),  # a window: likewise, but for its first tiles
    (dict(window=(16, -1)), "dq_sm90", 64, False),  # the mirror band's heaviest tiles lie at the other end
])
def test_heads_inner(options, kernel, ctas, inner):
    """The grid's order (kernels/scheduling.cuh): a sequence's heads innermost under a causal band
    (``Problem.triangular_band``), in the forward only while its grid holds at most
    FORWARD_INNER_CTAS_PER_SM CTAs an SM."""
    assert variants.heads_inner(_torch_problem(**options), kernel, ctas, 132) is inner


@pytest.mark.parametrize("causal, seqlen, inner", [(True, 128, (1, 1, 1)), (False, 128, (0, 0, 0)),
                                                   (True, 70_000, (0, 1, 1))])
def test_heads_inner_packed(monkeypatch, causal, seqlen, inner):
    """Each launch packs tiles_m and heads_inner for its own grid: the forward's (3 heads of 2
    sequences, 128 query rows a CTA) takes heads innermost only while it is short; the backward's
    kernels always under a causal band."""
    import torch

    monkeypatch.delenv(variants.SM90_BACKWARD_ENV, raising=False)
    problem = _torch_problem(dtype="bfloat16", head_dim=64, head_dim_v=64, seqlen_q=seqlen, seqlen_k=seqlen,
                             causal=causal, deterministic=True)
    q, do, o = (torch.zeros(2, seqlen, 3, 64, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.zeros(2, seqlen, 1, 64, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.zeros(problem.lse_shape)
    device = SimpleNamespace(id=0, compute_capability="90")
    packed = {}

    def record(variant, grid, params, extra):
        if variant.kernel in ("forward_sm90", "dq_sm90", "dkdv_sm90"):
            assert grid == params[0]["tiles_m"] * params[0]["batch"] * (3 if variant.kernel != "dkdv_sm90" else 1)
            packed[variant.kernel] = int(params[0]["heads_inner"])

    _route_launches(monkeypatch, device, record)
    monkeypatch.setattr(launch.tma, "kernel_argument", lambda variant, k, v: np.zeros(1))
    launch.forward(problem, q, k, v)
    launch.backward(problem, q, k, v, o, lse, do)
    assert (packed["forward_sm90"], packed["dq_sm90"], packed["dkdv_sm90"]) == inner


def _nvrtc():
    """cuda-bindings' NVRTC, or a skip where it or its library is missing."""
    try:
        from cuda.bindings import nvrtc

        if nvrtc.nvrtcVersion()[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError("nvrtcVersion failed")
    except Exception as error:  # the module, or the library it loads
        pytest.skip(f"NVRTC is not usable here: {error}")


@pytest.mark.parametrize("kernel", ["dq_sm90", "dkdv_sm90"])
@pytest.mark.parametrize("dtype, dim_qk, dim_v, features", [
    ("bfloat16", 64, 64, {}),
    ("bfloat16", 128, 128, {}),
    ("float16", 64, 128, {}),
    ("float16", 128, 128, dict(mask=True, dropout=True, block_mask=True, varlen=True)),
    ("bfloat16", 128, 128, dict(seqlens_q=True, seqlens_k=True, softcap=True, alibi=True)),
])
def test_sm90_backward_compiles(kernel, dtype, dim_qk, dim_v, features):
    """NVRTC builds the wgmma backward's variants for sm_90a."""
    _nvrtc()
    from flashx_cupy import resources

    tiles = variants.TILES[kernel, "16", max(dim_qk, dim_v)]
    text = resources.ptx(variants.Variant(kernel, dtype, dim_qk, dim_v, *tiles, **features), "90")
    assert f".entry flashx_{kernel}(" in text and "wgmma.mma_async" in text and ".target sm_90a" in text


@pytest.mark.parametrize("dim_qk, dim_v", [(64, 64), (128, 128), (64, 128)])
def test_sm90_fused_dq_variant(dim_qk, dim_v):
    """flashx_dkdv_sm90 adding dQ: the CTA of the two-kernel path, with two dS^T tiles (128 keys x
    64 queries, one per step in turn) on 1024-byte boundaries beside its shared memory, and each
    warpgroup's float32 staging of its 64 columns of a step's dQ."""
    problem = _problem(head_dim=dim_qk, head_dim_v=dim_v)
    assert variants.fused_dq(problem, sm90=True, whole_sums=True)
    fused = variants.choose("dkdv_sm90", problem, aligned=True, dq_atomic=True)
    plain = variants.choose("dkdv_sm90", problem, aligned=True)
    assert fused.macros["DQ_ATOMIC"] == 1 and fused.options != plain.options
    assert (fused.block_m, fused.block_n, fused.warps, fused.threads) == (plain.block_m, plain.block_n, plain.warps,
                                                                          plain.threads)
    scores = fused.block_m * fused.block_n * variants.ELEMENT_SIZES[fused.dtype]
    assert scores % 1024 == 0
    staging = fused.block_n * 64 * 4
    assert staging % 1024 == 0
    assert fused.shared_memory == plain.shared_memory + 2 * scores + 2 * staging <= 227 * 1024


@pytest.mark.parametrize("dtype, dim, features", [
    ("bfloat16", 64, {}),
    ("float16", 128, {}),
    ("bfloat16", 128, dict(mask=True, dropout=True, block_mask=True, varlen=True)),
    ("bfloat16", 64, dict(seqlens_q=True, seqlens_k=True, softcap=True, alibi=True)),
])
def test_sm90_fused_dq_compiles(dtype, dim, features):
    """NVRTC builds flashx_dkdv_sm90 adding dQ for sm_90a: its dS^T products read both operands
    from shared memory, MN-major, and the sums are bulk reductions (the exact path's, per thread)."""
    _nvrtc()
    from flashx_cupy import resources

    variant = variants.Variant("dkdv_sm90", dtype, dim, dim, *variants.TILES["dkdv_sm90", "16", dim], dq_atomic=True,
                               **features)
    text = resources.ptx(variant, "90")
    assert ".entry flashx_dkdv_sm90(" in text and "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in text
    assert "red.relaxed.gpu.global.add.v2.f32" not in text
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\S+ \{[^}]*\}, %rd\d+, %rd\d+, acc, 1, 1, 1, 1;", text)


def test_dkdv_split_only_for_the_widest():
    assert variants.dkdv_parts(128, 128) == (3,)
    assert variants.dkdv_parts(64, 256) == (1, 2)


@pytest.mark.parametrize("changes, sm90, whole_sums, fused", [
    ({}, False, False, True),
    ({}, True, True, True),
    ({"dtype": "float16", "head_dim": 40, "head_dim_v": 96}, False, False, True),
    ({"deterministic": True}, True, True, False),  # the reductions' order varies from run to run
    ({"band": (-1, 0)}, False, True, False),  # causal on mma.sync: the split kernels skip more empty tiles
    ({"band": (-1, 0)}, True, True, True),  # on wgmma with the sums in one launch
    ({"band": (1024, 0)}, True, True, True),
    ({"band": (-1, 0)}, True, False, False),  # not in launches of a few kv heads
    ({"band": (-1, 0), "deterministic": True}, True, True, False),
    ({"dtype": "float32"}, False, True, False),  # no tensor cores: the float32 products stage in shared memory
    ({"head_dim_v": 256}, True, True, False),  # dK and dV in two launches: no one launch holds dS and both sums
])
def test_fused_dq_unless_determinism_is_asked(changes, sm90, whole_sums, fused):
    problem = _problem(**changes)
    assert variants.fused_dq(problem, sm90, whole_sums) is fused
    if fused:  # and its shared memory fits
        variant = variants.choose("dkdv", problem, aligned=True, dq_atomic=True)
        assert variant.macros["DQ_ATOMIC"] == 1 and variant.shared_memory <= 227 * 1024
        atoms = variant.block_n // 16  # each warp sums whole 16-query atoms of dQ, or a share of one's columns
        assert atoms % variant.warps == 0 or variant.warps % atoms == 0


@pytest.mark.parametrize("batch, seqlen, heads_k, group, varlen", [
    (2, 8192, 16, 1, False), (1, 65536, 16, 1, False), (1, 200000, 2, 4, False), (4, 128, 8, 2, False),
    (3, 0, 5, 3, True),
])
def test_dq_sums_in_chunks_of_kv_heads(batch, seqlen, heads_k, group, varlen):
    """Every kv head in exactly one launch: all in one where their float32 sums fit the whole
    bound, else a launch's sums within the chunk bound unless one head alone exceeds it."""
    problem = SimpleNamespace(varlen=varlen, total_q=5000 if varlen else None, batch=batch, seqlen_q=seqlen,
                              heads_k=heads_k, group=group, head_dim=100)
    chunks = launch.kv_head_chunks(problem)
    assert [h for first, heads in chunks for h in range(first, first + heads)] == list(range(heads_k))
    rows = 5000 if varlen else batch * seqlen
    per_head = rows * group * 128 * 4
    whole = heads_k * per_head <= launch.DQ_SUMS_WHOLE_BYTES
    assert launch.dq_sums_whole(problem) is whole
    if whole:
        assert chunks == [(0, heads_k)]
    else:
        assert all(heads * per_head <= max(launch.DQ_SUMS_BYTES, per_head) for _, heads in chunks)
        assert len(chunks) == -(-heads_k // max(1, min(heads_k, launch.DQ_SUMS_BYTES // per_head)))


@pytest.mark.parametrize("varlen", [False, True])
def test_dq_sums_in_panels(monkeypatch, varlen):
    """The fused backward's dQ sums as the kernels address them (dkdv.cuh's dq_panel: a head's
    panel i is head h * panels + i of DQ_PANEL columns) come back into dq by flashx_dq_round
    (modelled here index for index), a launch a kv head, the head dim's padding and rows past the
    sequences left out."""
    import ctypes

    import torch

    cu = np.array([0, 2, 5], np.int32)
    problem = _torch_problem(dtype="bfloat16", heads_q=6, heads_k=2, head_dim=100, head_dim_v=100,
                             **(dict(total_q=6, total_k=5, cu_seqlens_q=cu, cu_seqlens_k=cu) if varlen else {}))
    variant = SimpleNamespace(kernel="dkdv_sm90", dim_qk=128, block_m=128, threads=384, shared_memory=0)
    rounding = SimpleNamespace(kernel="dq_round", threads=256, shared_memory=0)
    panels = variant.dim_qk // launch.DQ_PANEL
    rows = [(start, end - start) for start, end in zip(cu, cu[1:])] if varlen else [(0, problem.seqlen_q)] * 2

    def value(b, h, i, c):  # small integers, exact in bfloat16
        return float((31 * b + 7 * h + 3 * i + c) % 97)

    def add_sums(p):  # flashx_dkdv_sm90's additions, as dkdv.cuh addresses them
        for b, (start, length) in enumerate(rows):
            for hh in range(p["kv_heads"] * problem.group):
                for i in range(length):
                    for c in range(variant.dim_qk):
                        index = hh * panels + c // launch.DQ_PANEL
                        at = b * p["dq_b"] + (start + i) * p["dq_n"] + index * p["dq_h"] + c % launch.DQ_PANEL
                        ctypes.c_float.from_address(int(p["dq"] + 4 * at)).value += value(
                            b, p["kv_head0"] * problem.group + hh, i, c)

    def round_sums(p, r, grid):  # flashx_dq_round, thread by thread
        flat = dq.view(-1)
        for t in range(grid * rounding.threads):
            panel, head, row = t % panels, t // panels % r["heads"], t // panels // r["heads"]
            if row >= r["rows"]:
                continue
            sequence_rows = r["rows"] if varlen else p["seqlen_q"]
            b, n = divmod(row, sequence_rows)
            source = int(r["sums"]) + 4 * ((((b * r["heads"] + head) * panels + panel) * sequence_rows + n) * launch.DQ_PANEL)
            for j in range(launch.DQ_PANEL):
                if panel * launch.DQ_PANEL + j < p["head_dim"]:
                    at = b * p["dq_b"] + n * p["dq_n"] + (r["head0"] + head) * p["dq_h"] + panel * launch.DQ_PANEL + j
                    assert p["dq"] == dq.data_ptr()
                    flat[at] = ctypes.c_float.from_address(source + 4 * j).value

    def kernel(launched, grid, params, extra):
        if launched.kernel == "dq_round":
            chunk = extra[0].view(launch.DQ_ROUND)[0]
            round_sums({name: int(params[0][name]) for name in ("dq", "dq_b", "dq_n", "dq_h", "seqlen_q", "head_dim")},
                       {name: int(chunk[name]) for name in launch.DQ_ROUND.names}, grid)
        else:
            add_sums(params[0])

    monkeypatch.setattr(launch, "DQ_SUMS_WHOLE_BYTES", 0)
    monkeypatch.setattr(launch, "DQ_SUMS_BYTES", 1)  # a launch a kv head
    device = SimpleNamespace(id=0)
    _route_launches(monkeypatch, device, kernel)
    shape = (6, 6, 100) if varlen else (2, 5, 6, 100)
    dq = torch.zeros(shape, dtype=torch.bfloat16)
    params = launch.pack(problem, launch.BACKWARD_PARAMS, **launch.tensor_fields("dq", dq, varlen, 3))
    launch._dkdv_adding_dq(problem, device, variant, {}, dq, rounding, params)(None, {"dq": dq.data_ptr()}, dq)
    want = torch.zeros(shape)
    for b, (start, length) in enumerate(rows):
        for h in range(6):
            for i in range(length):
                at = (start + i, h) if varlen else (b, i, h)
                want[at] = torch.tensor([value(b, h, i, c) for c in range(100)])
    assert torch.equal(dq.float(), want)


@pytest.mark.parametrize("layout, struct", [("DQ_ROUND", "DqRound")])
def test_small_layouts_match_their_structs(layout, struct):
    fields, end = _struct_fields("dq.cu", struct)
    dtype = getattr(launch, layout)
    assert [(name, dtype.fields[name][1], dtype.fields[name][0].itemsize) for name in dtype.names] == fields
    assert dtype.itemsize == end


# -- sources and cache keys ----------------------------------------------------------------

def test_source_inlines_the_headers():
    text = variants.source("dq.cu")  # through backward.cuh and common.cuh
    assert not re.search(r'^#include "', text, re.MULTILINE)
    assert text.count("struct Params {") == 1 and "flashx_dq" in text and "flashx_delta" in text
    assert "void __launch_bounds__(THREADS, 1) flashx_dkdv" not in text  # a build compiles its file's kernels alone
    assert "void __launch_bounds__(THREADS, 1) flashx_dkdv" in variants.source("dkdv.cu")
    defined = {name: re.findall(r"__global__ void .*?(flashx_\w+)\(", variants.source(name))
               for name in ("dq.cu", "dkdv.cu", "dq_sm90.cu", "dkdv_sm90.cu")}
    assert defined == {"dq.cu": ["flashx_delta", "flashx_dq_round", "flashx_dq"], "dkdv.cu": ["flashx_dkdv"],
                       "dq_sm90.cu": ["flashx_dq_sm90"], "dkdv_sm90.cu": ["flashx_dkdv_sm90"]}
    for name in ("forward_sm90.cu", "dq_sm90.cu", "dkdv_sm90.cu"):  # the wgmma helpers, from one header
        assert variants.source(name).count("__device__ __forceinline__ u64 wgmma_desc(") == 1
    text = variants.source("forward_sm90.cu")  # through forward.cuh
    assert not re.search(r'^#include "', text, re.MULTILINE)
    assert text.count("struct Params {") == 1 and text.count("struct ForwardRows {") == 1


def test_cache_key_follows_included_headers(tmp_path):
    """An edit of common.cuh, which forward.cu includes, makes a new key (NVRTC's -I would not)."""
    copy = tmp_path / "kernels"
    shutil.copytree(variants.KERNELS, copy)
    options, versions = variants.choose("forward", _problem(), aligned=True).options, ("14.2.0", (13, 0), "90")
    before = variants.cache_key(variants.source("forward.cu", copy), options, versions)
    header = copy / "common.cuh"
    header.write_text(header.read_text().replace("#define LOG2E", "// edited\n#define LOG2E"))
    after = variants.cache_key(variants.source("forward.cu", copy), options, versions)
    assert before != after
    assert before == variants.cache_key(variants.source("forward.cu"), options, versions)
    assert before != variants.cache_key(variants.source("forward.cu"), options, ("14.2.0", (13, 1), "90"))
    assert before != variants.cache_key(variants.source("forward.cu"), options + ("-DX=1",), versions)


def test_kernels_are_built_once_and_looked_up_by_variant(monkeypatch):
    """A launch finds its kernel without reading or hashing the source (which costs more than the
    launch); the delta and dQ kernels, one text with one set of options, share a module."""
    builds, reads = [], []

    class Module:
        def __init__(self, code, options):
            builds.append(options)

        def get_function(self, name):
            return SimpleNamespace(name=name)

    fake_cupy = SimpleNamespace(RawModule=Module, __version__="14.2.0",
                                cuda=SimpleNamespace(nvrtc=SimpleNamespace(getVersion=lambda: (13, 0))))
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake_cupy)
    monkeypatch.setattr(variants, "_modules", {})
    monkeypatch.setattr(variants, "_kernels", {})
    read = variants.source
    monkeypatch.setattr(variants, "source", lambda name: reads.append(name) or read(name))
    device = SimpleNamespace(id=0, compute_capability="90")
    delta, dq = (variants.choose(kernel, _problem(), aligned=True) for kernel in ("delta", "dq"))
    for _ in range(3):
        assert variants.kernel(delta, device).name == "flashx_delta"
        assert variants.kernel(dq, device).name == "flashx_dq"
    assert len(builds) == 1 and reads == ["dq.cu", "dq.cu"]
    variants.kernel(delta, SimpleNamespace(id=1, compute_capability="90"))  # another GPU: looked up again
    assert len(builds) == 1 and len(reads) == 3


# -- argument packing ----------------------------------------------------------------------

def _struct_fields(file: str, name: str, offset: int = 0) -> tuple[list, int]:
    """The (name, offset, size) of each field of ``struct name`` in kernels/``file``, laid out from
    ``offset`` (a base's size), and the struct's end."""
    text = (variants.KERNELS / file).read_text()
    body = re.search(rf"struct {name}(?: : \w+)? \{{(.*?)\}};", text, re.DOTALL).group(1)
    sizes = {"u64": 8, "i64": 8, "int": 4, "float": 4}
    fields = []
    for kind, names in re.findall(r"(u64|i64|int|float) ([^;]+);", body):
        for field in (n.strip() for n in names.split(",")):
            offset = -(-offset // sizes[kind]) * sizes[kind]
            fields.append((field, offset, sizes[kind]))
            offset += sizes[kind]
    return fields, -(-offset // 8) * 8


@pytest.mark.parametrize("layout, file, struct", [
    ("PARAMS", "common.cuh", "Params"),
    ("BACKWARD_PARAMS", "backward.cuh", "BackwardParams"),
    ("DECODE_PARAMS", "decode.cu", "DecodeParams"),
])
def test_params_layouts_match_the_structs(layout, file, struct):
    """Each record lists the fields of its struct in order, with C's sizes and offsets; a struct
    derived from ``Params`` has its fields after ``Params``'s whole size, as C++ lays out a class
    whose base is plain data."""
    fields, end = _struct_fields("common.cuh", "Params")
    if struct != "Params":
        own, end = _struct_fields(file, struct, end)
        assert re.search(rf"struct {struct} : Params \{{", (variants.KERNELS / file).read_text())
        fields += own
    dtype = getattr(launch, layout)
    assert list(dtype.names) == [name for name, _, _ in fields]
    assert [dtype.fields[name][1] for name, _, _ in fields] == [o for _, o, _ in fields]
    assert [dtype.fields[name][0].itemsize for name, _, _ in fields] == [s for _, _, s in fields]
    assert dtype.itemsize == end
    opaque = launch.OPAQUE[dtype.itemsize]  # the same bytes, as one
    assert opaque.itemsize == dtype.itemsize and opaque.names is None


def test_each_kernel_takes_its_layout():
    """The forwards take ``Params``, the backward's kernels ``BackwardParams``, decoding's
    ``DecodeParams``: the struct the host packs for each (launch.pack, decode.pack_decode)."""
    expected = {"forward": "Params", "forward_sm90": "Params", "forward_fp8_sm90": "Params",
                "delta": "BackwardParams", "dq": "BackwardParams", "dkdv": "BackwardParams",
                "dq_sm90": "BackwardParams", "dkdv_sm90": "BackwardParams", "decode": "DecodeParams",
                "decode_merge": "DecodeParams", "decode_append": "DecodeParams"}
    for kernel, struct in expected.items():
        text = variants.source(variants.FILES[kernel])
        entry = variants.ENTRY_POINTS[kernel]
        if kernel in ("forward_sm90", "forward_fp8_sm90"):  # named by a macro, defined in forward_sm90.cuh
            entry = "FORWARD_SM90"
        assert re.search(rf"\b{entry}\(const {struct} p\b", text), kernel
    assert len(launch.OPAQUE) == 4  # each layout's size its own: Params, BackwardParams, DecodeParams, DqRound


def test_pack():
    problem = Problem(array_kind="torch", device="cuda", device_index=0, dtype="bfloat16", batch=2, seqlen_q=100,
                      seqlen_k=300, total_q=None, total_k=None, heads_q=8, heads_k=2, head_dim=64, head_dim_v=32,
                      softmax_scale=-0.5, causal=True, rng_offset=(1 << 32) + 7, dropout_offsets=(5, 9), dropout_p=0.25,
                      seed=(1 << 64) - 1)
    params = launch.pack(problem, q=1234, q_n=512, tiles_m=3)[0]
    assert params["left"] == 400 and params["right"] == 0  # unbounded: a reach past every pair
    assert np.uint32(params["rng_offset"].view(np.uint32)) == 7
    assert params["drop_threshold"].view(np.uint32) == math.floor(0.25 * 2**32)
    assert params["seed"] == (1 << 64) - 1 and params["q"] == 1234 and params["q_n"] == 512 and params["k"] == 0
    assert params["scale"] == np.float32(-0.5) and params["scale_log2"] == np.float32(-0.5 * math.log2(math.e))
    assert params["drop_scale"] == np.float32(1 / 0.75) and params["tiles_m"] == 3 and params["group"] == 4
    assert (params["drop_row0"], params["drop_col0"]) == (5, 9)


def _torch_problem(**changes):
    import torch

    fields = dict(array_kind="torch", device="cpu", device_index=None, dtype="float32", batch=2, seqlen_q=5, seqlen_k=7,
                  total_q=None, total_k=None, heads_q=3, heads_k=1, head_dim=8, head_dim_v=8, softmax_scale=0.5)
    converted = {name: torch.as_tensor(value) if isinstance(value, np.ndarray) else value
                 for name, value in changes.items()}
    return Problem(**(fields | converted))


def test_pack_softcap():
    """The kernels take tanh(S / c) of S = scale * dot as tanh(dot * (scale / c)), and c in base 2."""
    params = launch.pack(_torch_problem(softmax_scale=0.25, softcap=20.0))[0]
    assert params["softcap_scale"] == np.float32(0.25 / 20.0)
    assert params["softcap_log2"] == np.float32(20.0 * math.log2(math.e))
    plain = launch.pack(_torch_problem(softmax_scale=0.25))[0]
    assert plain["softcap_scale"] == plain["softcap_log2"] == 0


@pytest.mark.parametrize("slopes_shape, alibi_b", [((3,), 0), ((2, 3), 3)])
def test_auxiliary_fields_slopes_and_sinks(slopes_shape, alibi_b):
    """Slopes per head serve every sequence (batch stride 0); per sequence and head, a row of Hq.
    float32 contiguous arrays are read where they are."""
    rng = np.random.default_rng(3)
    slopes, sinks = rng.random(slopes_shape).astype(np.float32), rng.random(3).astype(np.float32)
    problem = _torch_problem(alibi_slopes=slopes, sinks=sinks)
    fields = launch.auxiliary_fields(problem)
    assert fields["alibi_b"] == alibi_b
    assert fields["alibi_slopes"] == problem.alibi_slopes.data_ptr() and fields["sinks"] == problem.sinks.data_ptr()
    assert not {"alibi_slopes", "alibi_b", "sinks"} & launch.auxiliary_fields(_torch_problem()).keys()


def test_auxiliary_fields_read_the_cores_lengths_where_they_are(monkeypatch):
    """The core hands lengths and offsets over as contiguous int32 arrays (and slopes and sinks
    as float32 ones): a call takes their addresses, and converts or copies none of them."""
    import torch

    cu, lengths = np.array([0, 2, 5], np.int32), np.array([2, 3], np.int32)
    varlen = _torch_problem(total_q=5, total_k=5, cu_seqlens_q=cu, cu_seqlens_k=cu)
    padded = _torch_problem(seqlens_q=lengths, seqlens_k=lengths, sinks=np.zeros(3, np.float32))
    monkeypatch.setattr(torch.Tensor, "to", lambda *args, **kw: pytest.fail("converted an array the core converted"))
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda *args, **kw: pytest.fail("copied a contiguous array"))
    fields = launch.auxiliary_fields(varlen)
    assert (fields["cu_q"], fields["cu_k"]) == (varlen.cu_seqlens_q.data_ptr(), varlen.cu_seqlens_k.data_ptr())
    fields = launch.auxiliary_fields(padded)
    assert (fields["seqlens_q"], fields["seqlens_k"]) == (padded.seqlens_q.data_ptr(), padded.seqlens_k.data_ptr())


def test_empty_rows_of_varlen_lse():
    """Rows past cu_seqlens[-1] have no key: lse -inf, or the sink of their head."""
    import torch

    cu = np.array([0, 2, 4], np.int32)
    varlen = dict(total_q=6, total_k=4, cu_seqlens_q=cu, cu_seqlens_k=cu)
    sinks = np.array([0.5, -np.inf, 2.0], np.float32)
    lse = launch.empty_row_lse(_torch_problem(**varlen, sinks=sinks), "cpu")
    assert lse.shape == (3, 6) and lse.is_contiguous()
    assert torch.equal(lse, torch.from_numpy(sinks)[:, None].expand(3, 6))
    assert torch.equal(launch.empty_row_lse(_torch_problem(**varlen), "cpu"), torch.full((3, 6), -math.inf))


@pytest.mark.parametrize("past", [False, True])
def test_varlen_outputs_are_filled_only_where_rows_lie_past_the_sequences(monkeypatch, past):
    """No kernel writes the rows past cu_seqlens[-1]: o, lse and the gradients start as the
    contract's values there (0, -inf), filled when allocated. Where every row belongs to a sequence
    (``rows_past_sequences`` False), every element is written and nothing is filled first."""

    import torch

    cu = np.array([0, 2, 5], np.int32)
    problem = _torch_problem(total_q=5, total_k=5, cu_seqlens_q=cu, cu_seqlens_k=cu, rows_past_sequences=past)
    q, k, v, o, do = torch.ones(5, 3, 8), torch.ones(5, 1, 8), torch.ones(5, 1, 8), torch.ones(5, 3, 8), torch.ones(5, 3, 8)
    lse = torch.zeros(problem.lse_shape)
    _route_launches(monkeypatch, SimpleNamespace(id=0, compute_capability="90"), lambda *args: None)
    fills = []
    for name in ("zeros", "full"):
        fill = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *args, fill=fill, **kw: fills.append(fill) or fill(*args, **kw))
    launch.forward(problem, q, k, v)
    launch.backward(problem, q, k, v, o, lse, do)
    assert bool(fills) == past


@pytest.mark.parametrize("capability", ["80", "90"])
def test_calls_of_a_problem_share_its_launches_and_bring_their_own_values(monkeypatch, capability):
    """Calls of one static problem and layout build their launches once (``launch.per_problem``:
    variants chosen, structs packed) and each launch reads the call's own tensors, seed and RNG
    offset, written into the kept struct (``KernelLaunch``)."""
    import torch

    launched, chosen = [], []
    _route_launches(monkeypatch, SimpleNamespace(id=0, compute_capability=capability),
                    lambda variant, grid, params, extra: launched.append(params[0].copy()))
    monkeypatch.setattr(tma, "usable", lambda problem, *tensors: False)  # no tensor maps of CPU tensors
    choose = variants.choose
    monkeypatch.setattr(variants, "choose", lambda kernel, *args, **kw: chosen.append(kernel) or choose(kernel, *args, **kw))
    for seed, offset in ((3, 0), ((1 << 64) - 5, 9 << 32 | 77)):
        problem = _torch_problem(dtype="bfloat16", head_dim=64, head_dim_v=64, dropout_p=0.25, seed=seed,
                                 rng_offset=offset)
        q, do = (torch.randn(2, 5, 3, 64, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(2, 7, 1, 64, dtype=torch.bfloat16) for _ in range(2))
        launched.clear()
        o, lse = launch.forward(problem, q, k, v)
        dq, dk, dv = launch.backward(problem, q, k, v, o, lse, do)
        for params in launched:
            assert (params["seed"], params["rng_offset"].view(np.uint32)) == (seed, offset & 0xFFFFFFFF)
            assert (params["q"], params["k"], params["v"]) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
        forward, *backward = launched
        assert (forward["o"], forward["lse"]) == (o.data_ptr(), lse.data_ptr())
        for params in backward:
            assert params.dtype == launch.BACKWARD_PARAMS and params["dout"] == do.data_ptr()
            assert (params["dk"], params["dv"]) == (dk.data_ptr(), dv.data_ptr())
    assert len(chosen) == 1 + len(backward)  # the first call's


@pytest.mark.parametrize("varlen", [False, True])
def test_dsinks_sums_the_rows_of_each_head(varlen):
    import torch

    cu = np.array([0, 2, 5], np.int32)
    problem = _torch_problem(sinks=np.zeros(3, np.float32),
                             **(dict(total_q=6, total_k=5, cu_seqlens_q=cu, cu_seqlens_k=cu) if varlen else {}))
    terms = torch.arange(math.prod(problem.lse_shape), dtype=torch.float32).reshape(problem.lse_shape)
    heads_first = terms if varlen else terms.transpose(0, 1)
    want = heads_first.reshape(problem.heads_q, -1).sum(dim=1)
    assert torch.equal(launch.sum_over_rows(problem, terms), want)


# -- decoding (host side) -------------------------------------------------------------------

def _decode_problem(batch=2, seqlen_q=1, heads_q=8, heads_k=2, head_dim=128, head_dim_v=None, dtype="bfloat16",
                    page_size=None, slots=4096, new=0, cache_dtype=None, **keywords):
    """A DecodeProblem on CPU torch tensors (the host side reads only their shapes and strides);
    the caches in ``cache_dtype`` (default: q's)."""
    import torch

    from flashx.validation import build_decode_problem

    head_dim_v = head_dim_v or head_dim
    element = getattr(torch, dtype)
    rows = batch if page_size is None else batch * -(-slots // page_size)
    width = slots if page_size is None else page_size
    cached = getattr(torch, cache_dtype or dtype)
    caches = (torch.zeros(rows, width, heads_k, head_dim, dtype=cached),
              torch.zeros(rows, width, heads_k, head_dim_v, dtype=cached))
    table = None if page_size is None else torch.arange(rows, dtype=torch.int64).reshape(batch, -1)
    tokens = {} if not new else {"k_new": torch.zeros(batch, new, heads_k, head_dim, dtype=element),
                                 "v_new": torch.zeros(batch, new, heads_k, head_dim_v, dtype=element)}
    q = torch.zeros(batch, seqlen_q, heads_q, head_dim, dtype=element)
    keywords = {name: torch.as_tensor(x) if isinstance(x, np.ndarray) else x for name, x in keywords.items()}
    problem = build_decode_problem(q, *caches, cache_seqlens=torch.zeros(batch, dtype=torch.int64), block_table=table,
                                   validate=False, **tokens, **keywords)
    return problem, q, caches, tokens


def test_decode_is_an_operation():
    backend = flashx.registry.get("cupy")
    assert backend.operations == {"attention", "decode"}
    problem, *_ = _decode_problem(page_size=16, mask=np.ones((1, 1), bool), window=(100, -1), softcap=30.0,
                                  alibi_slopes=np.ones(8, np.float32), sinks=np.zeros(8, np.float32), head_dim_v=64)
    reasons = backend.supports(dataclasses_replace(problem, device="cuda"))
    assert reasons == []


def dataclasses_replace(problem, **changes):
    import dataclasses

    return dataclasses.replace(problem, **changes)


@pytest.mark.parametrize("rows, widest, block_m", [(1, 128, 16), (4, 128, 16), (17, 64, 32), (33, 64, 64), (100, 64, 64),
                                                   (33, 128, 32), (8, 256, 16), (64, 256, 16)])
def test_decode_rows_per_cta(rows, widest, block_m):
    """The fewest rows that hold the group's, within the accumulators' bound."""
    assert variants.decode_block_m(rows, widest) == block_m
    assert block_m * widest <= variants.DECODE_ROW_ELEMENTS


@pytest.mark.parametrize("key", sorted(variants.DECODE_TILES))
@pytest.mark.parametrize("paged", [False, True])
def test_decode_tiles_fit(key, paged):
    """Each warp takes whole 16-key products; the thread per row of the join exists; Q, the stages,
    the pages and the staging fit the H100's shared memory; the join fits the K/V buffers (the
    kernel's static_assert: an FP8 cache's one widened tile and its byte stages); a 16-bit or FP8
    CTA of 16 rows up to d128 leaves room for two per SM."""
    width, dim = key
    block_n, warps, stages = variants.DECODE_TILES[key]
    assert block_n % (16 * warps) == 0 and block_n // warps <= 64 and stages >= 2
    dtype, fp8 = "float32" if width == "32" else "bfloat16", width == "8"
    for block_m in (16, 32, 64):
        if block_m > variants.decode_rows_most(dim, fp8):
            continue
        variant = variants.Variant("decode", dtype, dim, dim, block_m, block_n, warps, stages=stages, paged=paged,
                                   fp8_cache=fp8)
        assert variant.threads >= block_m and variant.shared_memory <= 227 * 1024
        size, pad = variants.ELEMENT_SIZES[dtype], 16 // variants.ELEMENT_SIZES[dtype]
        join = (block_m * dim + (2 * warps + 1) * block_m) * 4
        buffers = (1 if fp8 else stages) * block_n * 2 * (dim + pad) * size + fp8 * stages * block_n * 2 * dim
        assert join <= buffers
        if width != "32" and dim <= 128 and block_m == 16:
            assert decode.ctas_per_sm(variant, 228 * 1024) >= 2


@pytest.mark.parametrize("dim", variants.HEAD_DIM_CLASSES)
def test_fp8_decode_keeps_bytes_in_flight(dim):
    """An FP8 cache's extra stage keeps at least three quarters of the cache bytes in flight per SM
    that a 16-bit cache's tiles keep (all of them at d64 and d256): the tiles already requested
    ahead (STAGES - 1 a CTA) times the CTAs an H100 SM holds, 16 rows a CTA."""

    def in_flight(width, bytes_per_value):
        block_n, warps, stages = variants.DECODE_TILES[width, dim]
        variant = variants.Variant("decode", "bfloat16", dim, dim, 16, block_n, warps, stages=stages,
                                   fp8_cache=width == "8")
        return (stages - 1) * block_n * 2 * dim * bytes_per_value * decode.ctas_per_sm(variant, 228 * 1024)

    ratio = in_flight("8", 1) / in_flight("16", 2)
    assert ratio == (0.75 if dim == 128 else 1.0)


def test_fp8_cache_declarations(monkeypatch):
    """float8_e4m3fn is declared for decoding's cache (and attention: test_fp8_forward_declarations);
    an FP8 cache is declined below compute capability 8.9 (no e4m3 conversions), and taken where
    CuPy cannot tell (no GPU: the backend is unavailable, and dispatch asks nothing of it)."""
    import flashx_cupy

    backend = flashx.registry.get("cupy")
    assert "float8_e4m3fn" in backend.dtypes and "float8_e5m2" not in backend.dtypes
    problem, *_ = _decode_problem(cache_dtype="float8_e4m3fn", page_size=16, seqlen_q=2, new=2, head_dim=64,
                                  mask=np.ones((2, 2), bool), window=(100, -1), softcap=30.0, num_splits=3,
                                  alibi_slopes=np.ones(8, np.float32), sinks=np.zeros(8, np.float32),
                                  k_descale=np.ones((2, 2), np.float32), v_descale=np.ones((2, 2), np.float32))
    problem = dataclasses_replace(problem, device="cuda")
    for capability, reasons in ((None, []), (90, []), (89, []),
                                (80, ["reads a float8_e4m3fn cache with the e4m3 conversions of compute capability "
                                      "8.9 and newer, not 8.0"])):
        monkeypatch.setattr(flashx_cupy, "compute_capability", lambda index, answer=capability: answer)
        assert backend.supports(problem) == reasons
    monkeypatch.setattr(flashx_cupy, "compute_capability", lambda index: pytest.fail("asked without an FP8 cache"))
    assert backend.supports(dataclasses_replace(_decode_problem()[0], device="cuda")) == []


def _fp8_problem(dtype="float8_e4m3fn", shape=(1, 4, 2, 64), shape_v=None, **options):
    """The Problem of an FP8 call on CPU torch tensors, moved to "cuda" (the host side reads no data)."""
    import torch

    q = torch.zeros(shape, dtype=getattr(torch, dtype))
    v = torch.zeros(shape_v or shape, dtype=q.dtype)
    return dataclasses_replace(flashx.explain(q, q, v, **options).problem, device="cuda")


@pytest.mark.parametrize("capability, options, reasons", [
    (90, {}, []),
    (None, {}, []),  # CuPy cannot tell: the backend is unavailable, dispatch asks nothing of it
    (90, {"causal": True, "softcap": 5.0, "out_dtype": "float16"}, []),
    (90, {"mask": "pairs"}, []),
    (89, {}, ["runs FP8 attention on compute capability 9.0 only (wgmma's e4m3 products), not 8.9"]),
    (100, {}, ["runs FP8 attention on compute capability 9.0 only (wgmma's e4m3 products), not 10.0"]),
    (90, {"shape": (1, 4, 2, 256)}, ["takes FP8 head dims up to 128, not 256"]),
    (90, {"shape": (1, 4, 2, 40)}, ["takes FP8 head dims that are multiples of 16 (16-byte copies), not 40/40"]),
    (90, {"shape_v": (1, 4, 2, 24)}, ["takes FP8 head dims that are multiples of 16 (16-byte copies), not 64/24"]),
    (90, {"block_mask": "blocks", "mask": "pairs"}, []),
])
def test_fp8_forward_declarations(monkeypatch, capability, options, reasons):
    """Attention on float8_e4m3fn q, k, v runs on the wgmma forward: compute capability 9.0, head
    dims up to 128 in whole 16-byte chunks; each limit is said. float8_e5m2 is
    declined by the base's undeclared dtype; dropout by the base for every FP8 call."""
    import flashx_cupy
    import torch

    monkeypatch.setattr(flashx_cupy, "compute_capability", lambda index: capability)
    if options.get("mask") == "pairs":
        options["mask"] = torch.ones((4, 4), dtype=torch.bool)
    if options.get("block_mask") == "blocks":
        options["block_mask"] = flashx.BlockMask(torch.ones((1, 1), dtype=torch.bool), 64)
    backend = flashx.registry.get("cupy")
    assert backend.supports(_fp8_problem(**options)) == reasons
    assert backend.supports(_fp8_problem("float8_e5m2")) == ["does not implement FP8 (float8_e5m2) yet"]


def test_fp8_forward_variant():
    """FP8 inputs build forward_fp8_sm90 with o's dtype as DTYPE, for sm_90a, a producer warpgroup,
    and shared memory of Q and two K tiles of 128-byte rows, three V^T tiles of whole 128-key panels
    and a tile of zeros in bytes, each on a 1024-byte boundary."""
    for dim, out_dtype in ((32, "bfloat16"), (64, "float16"), (128, "bfloat16"), (96, "float16")):
        problem = _fp8_problem(shape=(1, 4, 2, dim), out_dtype=out_dtype)
        variant = variants.choose(variants.forward_kernel(problem, True, "90"), problem, aligned=True)
        assert variant.kernel == "forward_fp8_sm90" and variant.entry_point == "flashx_forward_fp8_sm90"
        assert variant.dtype == out_dtype and variant.macros["DTYPE"] == variants.DTYPE_CODES[out_dtype]
        assert (variant.block_m, variant.block_n, variant.warps) == variants.FORWARD_FP8_TILES[variant.dim_qk, False]
        assert variant.dim_qk == variant.dim_v == flashx.problem.head_dim_class(dim)
        assert "--gpu-architecture=sm_90a" in variant.options
        assert variant.threads == 32 * (variant.warps + variants.PRODUCER_WARPS)
        q, k, v = variant.block_m * 128, variant.block_n * 128, variant.dim_v * -(-variant.block_n // 128) * 128
        assert all(size % 1024 == 0 for size in (q, k, v))
        assert variant.shared_memory == q + 2 * k + 4 * v + 128 <= 227 * 1024
    import torch

    masked = _fp8_problem(shape=(1, 4, 2, 128), mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
    variant = variants.choose(variants.forward_kernel(masked, True, "90"), masked, aligned=True)
    assert variant.block_n == variants.FP8_MASKED_KEYS < variants.FORWARD_FP8_TILES[128, False][1]
    blocks = flashx.BlockMask(torch.ones((1, 1), dtype=torch.bool), 64)
    for dim in (64, 128):  # the block mask's tile votes take two warpgroups and 128 keys
        voted = _fp8_problem(shape=(1, 4, 2, dim), block_mask=blocks)
        variant = variants.choose(variants.forward_kernel(voted, True, "90"), voted, aligned=True)
        assert (variant.block_m, variant.block_n, variant.warps) == (128, variants.FP8_MASKED_KEYS, 8)
    text = variants.source("forward_fp8_sm90.cu")
    assert f"#define PRODUCER_THREADS {32 * variants.PRODUCER_WARPS} " in text
    for name in ("forward_fp8_sm90.cu", "forward_sm90.cu"):  # one CTA and kernel, forward_sm90.cuh's
        assert variants.source(name).count("struct ForwardCtaSm90 : ForwardRows {") == 1
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in text


def _e4m3_key_column(key: int) -> int:
    """The kernel's ``e4m3_key_column`` (kernels/wgmma_e4m3.cuh), evaluated from its source."""
    text = (variants.KERNELS / "wgmma_e4m3.cuh").read_text()
    body = re.search(r"int e4m3_key_column\(int k\) \{\s*return (.+?);", text).group(1)
    return eval(body.replace("/", "//"), {"k": key})  # C's integer arithmetic, on non-negative ints


def test_e4m3_key_column_is_the_relabelling_of_p():
    """Column 4t + i of a 16-key group holds key 2t + (i & 1) + 8 (i >> 1): the key whose weight
    lane t packs into byte i of its register (the A fragment of an e4m3 product); one key a column."""
    for group in range(3):
        columns = {_e4m3_key_column(16 * group + 2 * t + (i & 1) + 8 * (i >> 1)): (t, i) for t in range(4) for i in range(4)}
        assert columns == {16 * group + 4 * t + i: (t, i) for t in range(4) for i in range(4)}


def test_keys_in_fp8_order():
    """V as the FP8 forward reads it: (B, Hk, Dv, Nk') bytes, Nk' rounded up to 16, key k at the
    kernel's column for it, zero past each sequence; packed sequences each from column 0."""
    import torch

    generator = torch.Generator().manual_seed(0)
    v = torch.randint(0, 255, (2, 37, 3, 16), dtype=torch.uint8, generator=generator)
    columns = [_e4m3_key_column(key) for key in range(48)]
    for strided in (v, v.transpose(0, 1).contiguous().transpose(0, 1)):
        vt = launch.keys_in_fp8_order(SimpleNamespace(seqlen_k=37, varlen=False, batch=2), strided.view(torch.float8_e4m3fn))
        assert vt.dtype == torch.uint8 and vt.shape == (2, 3, 16, 48) and vt.is_contiguous()
        assert torch.equal(vt[..., columns[:37]], v.permute(0, 2, 3, 1))
        assert not vt[..., columns[37:]].any()
    packed = torch.randint(0, 255, (28, 3, 16), dtype=torch.uint8, generator=generator)  # 3 rows past the sequences
    problem = SimpleNamespace(seqlen_k=20, varlen=True, batch=3, cu_seqlens_k=torch.tensor([0, 5, 5, 25], dtype=torch.int32))
    vt = launch.keys_in_fp8_order(problem, packed.view(torch.float8_e4m3fn))
    assert vt.shape == (3, 3, 16, 32)
    for b, (start, length) in enumerate(((0, 5), (5, 0), (5, 20))):
        assert torch.equal(vt[b][..., columns[:length]], packed[start:start + length].permute(1, 2, 0))
        assert not vt[b][..., columns[length:32]].any()


def test_fp8_descales():
    """The FP8 forward takes the scores' factor q_descale * k_descale as k_descale, v_descale as
    it is; a missing descale is 1 (null, absent from the call's fields)."""
    import torch

    descales = {name: torch.full((2, 3), value) for name, value in (("q_descale", 2.0), ("k_descale", 0.25),
                                                                    ("v_descale", 3.0))}
    fields = launch.fp8_descales(SimpleNamespace(**descales))
    assert torch.equal(fields["k_descale"], torch.full((2, 3), 0.5)) and fields["v_descale"] is descales["v_descale"]
    assert launch.fp8_descales(SimpleNamespace(**(descales | {"q_descale": None})))["k_descale"] is descales["k_descale"]
    assert launch.fp8_descales(SimpleNamespace(q_descale=None, k_descale=None, v_descale=None)) == {}


def _nvrtc_ptx(variant):
    """The PTX of ``variant`` by NVRTC (flashx_cupy.resources), or a skip where NVRTC is missing."""
    from flashx_cupy import resources

    pytest.importorskip("cuda.bindings.nvrtc")
    try:
        return resources.ptx(variant, "90")
    except RuntimeError as error:  # cuda.pathfinder's DynamicLibNotFoundError
        pytest.skip(f"no NVRTC library here: {error}")


@pytest.mark.parametrize("dim, out_dtype, features", [
    (64, "bfloat16", {}), (128, "float16", {}), (128, "bfloat16", {"causal": True, "softcap": 5.0}),
    (128, "bfloat16", {"mask": True, "varlen": True}), (64, "float16", {"alibi": True, "sinks": True, "seqlens": True}),
])
def test_fp8_forward_compiles(dim, out_dtype, features):
    """NVRTC compiles the FP8 forward's variants to sm_90a PTX with e4m3 products of both kinds (K = 32,
    shared and register A) and P's rounding to e4m3 (skipped where NVRTC's library is missing)."""
    problem = _problem(dtype="float8_e4m3fn", head_dim=dim, head_dim_v=dim, band=(-1, 0) if features.get("causal") else None,
                       softcap=features.get("softcap"), mask=object() if features.get("mask") else None,
                       varlen=features.get("varlen", False), alibi_slopes=object() if features.get("alibi") else None,
                       sinks=object() if features.get("sinks") else None,
                       seqlens_k=object() if features.get("seqlens") else None)
    problem.out_dtype = out_dtype
    variant = variants.choose("forward_fp8_sm90", problem, aligned=True)
    ptx = _nvrtc_ptx(variant)
    assert ".target sm_90a" in ptx and ".entry flashx_forward_fp8_sm90" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    assert re.search(rf"wgmma.mma_async.sync.aligned.m64n{dim}k32.f32.e4m3.e4m3 \{{[^}}]*\}}, \{{", ptx)  # P from registers
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "setmaxnreg" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx  # the descaled Params stay in registers


def test_fp8_decode_variant():
    """An FP8 cache picks the FP8 build (FP8_CACHE, the "8" tiles, the queries' DTYPE) for all three
    kernels, at most DECODE_FP8_ROWS rows a CTA; a 16-bit cache's decode build says FP8_CACHE=0,
    and the other kernels carry no such macro (no rebuild of them)."""
    for dim in variants.HEAD_DIM_CLASSES:
        problem, *_ = _decode_problem(cache_dtype="float8_e4m3fn", dtype="float16", head_dim=dim, page_size=16)
        built = [variants.choose_decode(kernel, problem, aligned=True) for kernel in variants.DECODE_KERNELS]
        assert len({variant.options for variant in built}) == 1
        fp8 = built[0]
        assert fp8.fp8_cache and fp8.macros["FP8_CACHE"] == 1 and fp8.macros["DTYPE"] == 0 and fp8.macros["PAGED"]
        assert (fp8.block_n, fp8.warps, fp8.stages) == variants.DECODE_TILES["8", dim]
        pad, stages = 8, fp8.stages  # one widened 16-bit tile, the stages in bytes, two tiles' (page, slot)
        assert fp8.shared_memory == (16 * (dim + pad) * 2 + 64 * 2 * (dim + pad) * 2 + stages * 64 * 2 * dim + 2 * 64 * 8
                                     + stages * 8)  # and a barrier a stage
        plain, *_ = _decode_problem(dtype="float16", head_dim=dim)
        assert variants.choose_decode("decode", plain, aligned=True).macros["FP8_CACHE"] == 0
    assert "FP8_CACHE" not in variants.choose("forward", _problem(), aligned=True).macros
    wide = dict(heads_q=32, heads_k=2, seqlen_q=4, head_dim=64)  # 64 rows of a GQA group
    assert variants.choose_decode("decode", _decode_problem(**wide)[0], aligned=True).block_m == 64
    fp8_wide = variants.choose_decode("decode", _decode_problem(cache_dtype="float8_e4m3fn", **wide)[0], aligned=True)
    assert fp8_wide.block_m == variants.DECODE_FP8_ROWS == 32
    text = variants.source("decode.cu")
    assert text.count("widen_e4m3x4(u32 w)") == 1 and not re.search(r'^#include "', text, re.MULTILINE)


def test_fp8_resources_build_the_shipped_variants():
    """``python -m flashx_cupy.resources --features fp8_cache=1`` compiles the FP8 build with its tiles
    and row counts."""
    from flashx_cupy import resources

    built = resources.decode_variants("decode", "bfloat16", 64, [16, 32, 64], {"fp8_cache": True, "paged": True}, "90")
    assert [variant.block_m for variant in built] == [16, 32]
    assert all((v.fp8_cache, v.stages, v.block_n) == (True, variants.DECODE_TILES["8", 64][2], 64) for v in built)


def test_fp8_aligned():
    """An FP8 cache is read in 16-byte chunks of 16 values: its head dims are whole chunks of 16,
    the queries' of 8."""
    import torch

    def tensors(dim):
        q = torch.zeros(2, 1, 8, dim, dtype=torch.bfloat16)
        cache = torch.zeros(2, 64, 2, dim, dtype=torch.float8_e4m3fn)
        return q, cache, cache

    for dim, want in ((32, True), (64, True), (40, False), (48, True)):
        q, k_cache, v_cache = tensors(dim)
        problem = SimpleNamespace(head_dim=dim, head_dim_v=dim)
        assert launch.aligned(problem, q, k_cache, v_cache) == want
        assert launch.aligned(problem, q)  # a multiple of 8: the bf16 queries alone are aligned


def test_decode_kernels_share_one_build():
    """The append, split and merge kernels of a problem are one module: the same text and macros."""
    problem, *_ = _decode_problem(page_size=16, seqlen_q=4, mask=np.ones((4, 4), bool), softcap=5.0)
    built = [variants.choose_decode(kernel, problem, aligned=True) for kernel in variants.DECODE_KERNELS]
    assert len({variant.options for variant in built}) == 1
    assert {variant.entry_point for variant in built} == {"flashx_decode", "flashx_decode_merge", "flashx_decode_append"}
    split = built[0]
    assert (split.block_m, split.dim_qk, split.dim_v) == (16, 128, 128)
    assert split.macros["PAGED"] == split.macros["MASK"] == split.macros["SOFTCAP"] == 1
    assert split.macros["STAGES"] == variants.DECODE_TILES["16", 128][2] and split.macros["ALIBI"] == 0
    assert "STAGES" not in variants.choose("forward", _problem(), aligned=True).macros  # no rebuild of the others
    text = variants.source("decode.cu")
    assert not re.search(r'^#include "', text, re.MULTILINE) and text.count("struct Params {") == 1
    contiguous, *_ = _decode_problem(dtype="float32", head_dim=256, head_dim_v=64, seqlen_q=3)
    variant = variants.choose_decode("decode", contiguous, aligned=False)
    assert variant.macros["PAGED"] == variant.macros["ALIGNED"] == 0 and variant.macros["DTYPE"] == 2
    assert (variant.dim_qk, variant.dim_v, variant.block_m, variant.block_n) == (256, 64, 16, 32)


@pytest.mark.parametrize("capability, is_aligned, row_bytes, bulk", [
    ("90", True, 256, True),  # bf16 d128
    ("90", False, 256, False),  # a row's copy must be 16-byte aligned, a whole number of 16 bytes
    ("90", True, 128, False),  # an FP8 cache at d128, bf16 at d64: no fewer instructions, and slower
    ("80", True, 256, False),  # bulk copies and mbarrier waits are sm_90's
    ("89", True, 256, False),
    ("100", True, 256, False),
])
def test_decode_bulk_choice(monkeypatch, capability, is_aligned, row_bytes, bulk):
    """Decoding copies K and V rows in bulk on compute capability 9.0 for aligned operands of rows
    of 256 bytes or more; the switch brings back cp.async."""
    monkeypatch.delenv(variants.DECODE_BULK_ENV, raising=False)
    assert variants.decode_bulk(is_aligned, capability, row_bytes) is bulk
    monkeypatch.setenv(variants.DECODE_BULK_ENV, "0")
    assert variants.decode_bulk(is_aligned, capability, row_bytes) is False
    monkeypatch.setenv(variants.DECODE_BULK_ENV, "1")
    assert variants.decode_bulk(is_aligned, capability, row_bytes) is bulk


def test_decode_bulk_variant():
    """The load path is the BULK macro of all three decoding kernels' one build; it changes neither
    the tiles nor the shared memory (the stages' barriers are reserved either way), so the split
    count and the CTAs an SM are the same for both paths."""
    for cache_dtype, page_size in ((None, None), ("float8_e4m3fn", 16)):
        problem, *_ = _decode_problem(cache_dtype=cache_dtype, page_size=page_size)
        bulk = [variants.choose_decode(kernel, problem, aligned=True, bulk=True) for kernel in variants.DECODE_KERNELS]
        assert len({variant.options for variant in bulk}) == 1 and bulk[0].macros["BULK"] == 1
        plain = variants.choose_decode("decode", problem, aligned=True)
        assert plain.macros["BULK"] == 0 and not plain.decode_bulk
        assert plain.shared_memory == bulk[0].shared_memory
        assert decode.count_splits(problem, plain, 132, 228 * 1024) == decode.count_splits(problem, bulk[0], 132,
                                                                                         228 * 1024)
    assert "BULK" not in variants.choose("forward", _problem(), aligned=True).macros  # no rebuild of the others
    text = variants.source("decode.cu")
    assert text.count("void bulk_load(") == 1 and text.count("void bar_wait(") == 1  # mbarrier.cuh's, inlined once


@pytest.mark.parametrize("capability, switch, is_aligned, bulk", [
    ("90", None, True, True),
    ("90", "0", True, False),
    ("90", None, False, False),
    ("80", None, True, False),
])
def test_decode_launches_bulk(monkeypatch, capability, switch, is_aligned, bulk):
    """``decode`` builds the split kernel with bulk copies as ``variants.decode_bulk`` says for the
    device and the operands, and the append and merge kernels from the same build."""
    import contextlib

    if switch is None:
        monkeypatch.delenv(variants.DECODE_BULK_ENV, raising=False)
    else:
        monkeypatch.setenv(variants.DECODE_BULK_ENV, switch)
    problem, q, (k_cache, v_cache), tokens = _decode_problem(batch=2, seqlen_q=1, slots=256, new=1, num_splits=3)
    device = SimpleNamespace(id=0, compute_capability=capability)
    launched = []
    monkeypatch.setattr(decode, "caller_stream", lambda problem, x: contextlib.nullcontext((device, None)))
    monkeypatch.setattr(decode, "aligned", lambda problem, *tensors: is_aligned)
    monkeypatch.setattr(decode, "device_size", lambda device_id: (132, 228 * 1024))
    monkeypatch.setattr(decode, "launch", lambda variant, *args: launched.append(variant))
    decode.decode(problem, q, k_cache, v_cache, tokens["k_new"], tokens["v_new"])
    assert [variant.kernel for variant in launched] == ["decode_append", "decode", "decode_merge"]
    assert {variant.decode_bulk for variant in launched} == {bulk} and len({v.options for v in launched}) == 1


def test_resources_build_decoding_as_the_host_does():
    """``python -m flashx_cupy.resources`` builds decoding's bulk copies for sm_90 and cp.async
    elsewhere, unless the features say ``decode_bulk``."""
    from flashx_cupy import resources

    assert all(v.decode_bulk for v in resources.decode_variants("decode", "bfloat16", 128, [16, 32], {}, "90"))
    assert not any(v.decode_bulk for v in resources.decode_variants("decode", "bfloat16", 128, [16], {}, "80"))
    assert not any(v.decode_bulk for v in resources.decode_variants("decode", "bfloat16", 128, [16],
                                                                    {"aligned": False}, "90"))
    assert not any(v.decode_bulk for v in resources.decode_variants("decode", "bfloat16", 128, [16],
                                                                    {"decode_bulk": False}, "90"))
    for dim, features in ((64, {}), (128, {"fp8_cache": True})):  # rows of 128 bytes
        assert not any(v.decode_bulk for v in resources.decode_variants("decode", "bfloat16", dim, [16], features, "90"))


@pytest.mark.parametrize("features", [
    {},
    {"paged": True, "mask": True, "softcap": True, "alibi": True, "sinks": True},
    {"fp8_cache": True, "paged": True},
])
def test_decode_bulk_compiles(features):
    """NVRTC builds the bulk-copy decoding kernel for sm_90: one bulk copy a row on the stage's
    mbarrier, no cp.async of K or V (Q's alone)."""
    _nvrtc()
    from flashx_cupy import resources

    texts = {bulk: resources.ptx(resources.decode_variants("decode", "bfloat16", 128, [16],
                                                          {"decode_bulk": bulk, **features}, "90")[0], "90")
             for bulk in (True, False)}
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in texts[True]
    assert "mbarrier.try_wait.parity" in texts[True] and "mbarrier.arrive.expect_tx" in texts[True]
    assert "mbarrier" not in texts[False] and "cp.async.bulk" not in texts[False]
    copies = [text.count("cp.async.cg.shared.global") for text in (texts[True], texts[False])]
    assert 0 < copies[0] < copies[1]  # Q's alone


def test_count_splits():
    """num_splits as asked, never more than the capacity's key tiles; 0 takes the core's rule
    (``flashx.splits``) from the capacity (the lengths live on the device), the CTAs resident per SM
    (two of 109 KB on an H100) and the rows' tiles."""
    problem, *_ = _decode_problem(batch=1, heads_k=8, heads_q=32, slots=65536)
    variant = variants.choose_decode("decode", problem, aligned=True)
    assert decode.ctas_per_sm(variant, 228 * 1024) == 2
    assert decode.count_splits(problem, variant, 132, 228 * 1024) == 32  # 8 CTAs: one wave of 256
    assert decode.count_splits(dataclasses_replace(problem, num_splits=5), variant, 132, 228 * 1024) == 5
    short, *_ = _decode_problem(batch=1, slots=100, num_splits=64)
    assert decode.count_splits(short, variants.choose_decode("decode", short, aligned=True), 132, 228 * 1024) == 2
    big_group, *_ = _decode_problem(batch=2, heads_k=2, heads_q=32, seqlen_q=4, slots=65536)  # 64 rows: 2 CTAs of 32
    variant = variants.choose_decode("decode", big_group, aligned=True)
    assert variant.block_m == 32 and decode.count_splits(big_group, variant, 132, 228 * 1024) == 32
    full, *_ = _decode_problem(batch=32, heads_k=8, heads_q=32, slots=4096)  # 256 CTAs fill the GPU alone
    assert decode.count_splits(full, variants.choose_decode("decode", full, aligned=True), 132, 228 * 1024) == 1


def test_pack_decode():
    """The band's unbounded sides become a reach past every key; the cache's geometry and the new
    tokens travel; the scale and softcap are the attention kernels' fields."""
    problem, *_ = _decode_problem(page_size=16, slots=64, seqlen_q=3, new=2, window=(7, -1), softcap=10.0)
    params = decode.pack_decode(problem, splits=3)[0]
    assert (params["left"], params["right"]) == (7, 0)  # causal folds into the right side
    assert (params["page_size"], params["new_tokens"], params["splits"], params["seqlen_q"]) == (16, 2, 3, 3)
    assert params["group"] == 4 and params["softcap_scale"] == np.float32(problem.softmax_scale / 10.0)
    unbounded, *_ = _decode_problem(slots=64, causal=False)
    params = decode.pack_decode(unbounded)[0]
    assert params["left"] == params["right"] == 64 + 1 and params["page_size"] == 0


def test_decode_fields():
    """Caches by their (page or sequence, slot, head, dim) strides, whatever their layout; the
    new tokens', the table's row and the tree mask's broadcast strides."""
    import torch

    problem, q, (k_cache, v_cache), tokens = _decode_problem(batch=3, seqlen_q=4, page_size=16, slots=64, new=4,
                                                             mask=np.ones((4, 4), bool), head_dim_v=64)
    v_cache = v_cache.transpose(0, 1).contiguous().transpose(0, 1)  # slots outermost
    mask = torch.ones(4, 4, dtype=torch.bool)
    problem = dataclasses_replace(problem, mask=mask)
    o = torch.empty(problem.o_shape)
    lse = torch.empty(problem.lse_shape)
    fields = decode.decode_fields(problem, q, k_cache, v_cache, tokens["k_new"], tokens["v_new"], o, lse)
    assert [fields[f"v_{axis}"] for axis in "bnhd"] == list(v_cache.stride()) and fields["v_n"] > fields["v_b"]
    assert [fields[f"kn_{axis}"] for axis in "bnhd"] == list(tokens["k_new"].stride())
    assert fields["table_b"] == 4 and fields["block_table"] == problem.block_table.data_ptr()
    assert [fields[f"mask_{axis}"] for axis in "bhij"] == [0, 0, 4, 1]
    assert (fields["lse_b"], fields["lse_h"]) == (8 * 4, 4)
    params = decode.pack_decode(problem, **fields)[0]
    assert params["k"] == k_cache.data_ptr() and params["cache_seqlens"] == problem.cache_seqlens.data_ptr()
    assert params["k_descale"] == params["v_descale"] == 0  # no FP8 cache: null


def test_decode_fields_of_an_fp8_cache():
    """An FP8 cache travels by its address and its strides in bytes (elements); its descales as
    the addresses of the core's contiguous float32 (B, Hk) arrays, null where None (1); nothing is
    read on the host."""
    import torch

    descale = np.full((3, 2), 0.5, np.float32)
    problem, q, (k_cache, v_cache), tokens = _decode_problem(batch=3, cache_dtype="float8_e4m3fn", page_size=16,
                                                             slots=64, new=2, k_descale=descale)
    assert problem.fp8 and problem.v_descale is None
    o, lse = torch.empty(problem.o_shape), torch.empty(problem.lse_shape)
    fields = decode.decode_fields(problem, q, k_cache, v_cache, tokens["k_new"], tokens["v_new"], o, lse)
    params = decode.pack_decode(problem, **fields)[0]
    assert params["k_descale"] == problem.k_descale.data_ptr() and params["v_descale"] == 0
    assert [params[f"k_{axis}"] for axis in "bnhd"] == list(k_cache.stride()) == [16 * 2 * 128, 2 * 128, 128, 1]
    assert params["k"] == k_cache.data_ptr() and params["kn_n"] == tokens["k_new"].stride(1)


# -- the kernels, on a GPU ------------------------------------------------------------------

gpu = pytest.mark.skipif(not _gpu(), reason=f"cupy backend unavailable: {unavailable_reason()}")

CASES = {
    "bf16-causal-gqa": dict(dtype="bfloat16", shape=(2, 300, 8, 2, 128, 128), causal=True),
    "fp16-window-dv": dict(dtype="float16", shape=(1, 130, 4, 4, 64, 40), window=(20, 5)),
    "fp32-dropout": dict(dtype="float32", shape=(2, 70, 2, 1, 96, 96), dropout_p=0.3, seed=11),
    "fp16-dropout-offsets": dict(dtype="float16", shape=(1, 90, 2, 2, 64, 64), dropout_p=0.2, seed=5,
                                 dropout_offsets=(3, 130), causal=True),
    "bf16-d256-causal": dict(dtype="bfloat16", shape=(1, 150, 2, 2, 256, 256), causal=True),
    "bf16-deterministic-gqa": dict(dtype="bfloat16", shape=(2, 300, 8, 2, 128, 128), causal=True, deterministic=True),
    "bf16-gqa-fused-dq": dict(dtype="bfloat16", shape=(2, 300, 8, 2, 128, 128)),
    "fp16-dropout-fused-dq": dict(dtype="float16", shape=(1, 200, 2, 1, 64, 64), dropout_p=0.2, seed=4),
}


@gpu
@pytest.mark.parametrize("name", list(CASES))
def test_against_the_oracle(name):
    import torch

    spec = dict(CASES[name])
    dtype, (batch, seqlen, heads_q, heads_k, dim, dim_v) = spec.pop("dtype"), spec.pop("shape")
    rng = np.random.default_rng(0)
    shapes = {"q": (batch, seqlen, heads_q, dim), "k": (batch, seqlen + 17, heads_k, dim),
              "v": (batch, seqlen + 17, heads_k, dim_v), "do": (batch, seqlen, heads_q, dim_v)}
    tensors = {n: torch.from_numpy(rng.standard_normal(s)).to("cuda", getattr(torch, dtype)) for n, s in shapes.items()}
    o, res = flashx.attention_forward(tensors["q"], tensors["k"], tensors["v"], backend="cupy", **spec)
    grads = flashx.attention_backward(tensors["do"], tensors["q"], tensors["k"], tensors["v"], o, res, backend="cupy",
                                      **spec)
    inputs = {n: t.double().cpu().numpy() for n, t in tensors.items()}
    want = oracle.forward_backward(inputs["do"], inputs["q"], inputs["k"], inputs["v"], **spec)
    got = (o, res.lse, *grads)
    bound = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}[dtype]
    for label, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        x = x.double().cpu().numpy()
        finite = np.isfinite(y)
        assert (np.isfinite(x) == finite).all(), label
        err = np.abs(x[finite] - y[finite]).max() / max(1.0, np.abs(y[finite]).max())
        assert err < bound, f"{label}: {err}"


@gpu
def test_cupy_arrays_on_a_cupy_stream():
    """CuPy arrays in, CuPy arrays out, computed on CuPy's current (non-default) stream."""
    import cupy

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 64, 2, 64)).astype(np.float32) for _ in range(3))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        o = flashx.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True, backend="cupy")
        stream.synchronize()
    assert isinstance(o, cupy.ndarray)
    want = oracle.forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)[0]
    np.testing.assert_allclose(o.get(), want, atol=1e-5)


#: FP8-cache decoding beyond the conformance suite's cases (head dim 32, up to 40 tokens): many key
#: tiles through the four stages (d128, d256), the unaligned element path (d40), pages of 1 and 256
#: slots, a tree mask with every score modification, fixed and chosen splits, and a GQA group of 64
#: rows (two CTAs of DECODE_FP8_ROWS).
FP8_DECODE_CASES = {
    "d128-contiguous-chosen-splits": dict(lengths=[1000, 3, 517], new=1, head_dim=128, num_splits=0),
    "d128-page1-3-splits": dict(lengths=[300, 64], new=2, seqlen_q=2, head_dim=128, page_size=1, num_splits=3),
    "d64-page256-tree-mods": dict(lengths=[700, 40], new=4, seqlen_q=4, head_dim=64, page_size=256,
                                  mask=np.tril(np.ones((4, 4), bool)) | np.eye(4, k=2, dtype=bool), softcap=20.0,
                                  alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32),
                                  sinks=np.array([0.5, -1.0, 2.0, 0.0])),
    "d40-unaligned-window": dict(lengths=[200, 90], new=1, head_dim=40, page_size=16, window=(50, 0)),
    "d256-fp16-2-splits": dict(lengths=[400, 129], new=1, head_dim=256, dtype="float16", num_splits=2),
    "group-of-64-rows": dict(lengths=[300, 5], new=4, seqlen_q=4, heads_q=32, head_dim=64, page_size=16),
}


@gpu
@pytest.mark.parametrize("name", list(FP8_DECODE_CASES))
def test_fp8_decode_against_the_oracle(name):
    """The conformance suite's grading (o, lse and the new tokens' bytes) on random descales."""
    import zlib

    from flashx_conformance.harness import Target
    from flashx_conformance.test_decode import check, make_decode_case

    spec = dict(FP8_DECODE_CASES[name])
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    descales = {key: (2.0 ** rng.uniform(-2, 2, (len(spec["lengths"]), 2))).astype(np.float32)
                for key in ("k_descale", "v_descale")}
    case = make_decode_case(rng, dtype=spec.pop("dtype", "bfloat16"), cache_dtype="float8_e4m3fn", **spec, **descales)
    check(Target("cupy", "cuda", "full"), case)


@gpu
def test_fp8_decode_in_a_cuda_graph():
    """validate=False with an FP8 cache: captured in a CUDA graph and replayed after the descales
    change in place (read on the device at each replay, never on the host), it gives the bits and
    the cache bytes of an eager call."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(0)

    def normal(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=generator, device="cuda").to(dtype)

    q, k_new, v_new = normal(2, 1, 8, 128), normal(2, 1, 2, 128), normal(2, 1, 2, 128)
    caches = [normal(2, 300, 2, 128, dtype=torch.float8_e4m3fn) for _ in range(2)]
    eager_caches = [cache.clone() for cache in caches]
    lengths = torch.tensor([200, 37], dtype=torch.int32, device="cuda")
    descales = [torch.full((2, 2), 0.5, device="cuda"), torch.full((2, 2), 2.0, device="cuda")]

    def step(k_cache, v_cache):
        return flashx.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k_new, v_new=v_new,
                                             k_descale=descales[0], v_descale=descales[1], validate=False,
                                             return_lse=True, backend="cupy")

    step(*eager_caches)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = step(*caches)
    for descale in descales:
        descale.mul_(3.0)
    graph.replay()
    want_o, want_lse = step(*eager_caches)
    torch.cuda.synchronize()
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    for cache, eager in zip(caches, eager_caches):
        assert torch.equal(cache.view(torch.uint8), eager.view(torch.uint8))


#: The FP8 forward beyond the conformance suite's cases (head dims up to 64, up to 96 keys): many
#: key tiles at d128 with a GQA group and a band, Dv < D, a window with softcap and ALiBi, and
#: packed sequences whose key offsets are not multiples of 16 (each sequence's V^T from column 0).
FP8_FORWARD_CASES = {
    "d128-causal-gqa-tall": dict(heads_q=4, heads_k=2, seqlen_q=700, seqlen_k=1000, head_dim=128, causal=True),
    "d128-dv64": dict(batch=1, seqlen_q=260, seqlen_k=390, head_dim=128, head_dim_v=64),
    "d64-window-softcap-alibi": dict(seqlen_q=300, seqlen_k=300, head_dim=64, window=(100, 20), softcap=10.0,
                                     alibi_slopes=np.array([0.25, 0.0625], np.float32)),
}


@gpu
@pytest.mark.parametrize("name", [*FP8_FORWARD_CASES, "varlen-odd-offsets"])
def test_fp8_forward_against_the_oracle(name):
    """The conformance suite's grading of FP8 (twice plain FP8's error on the dequantized inputs)
    on random descales."""
    import zlib

    from flashx_conformance.harness import Target, make_case, make_varlen_case
    from flashx_conformance.test_fp8 import quantized

    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if name == "varlen-odd-offsets":
        case = make_varlen_case(rng, lengths_q=[130, 7, 260], lengths_k=[211, 33, 300], spare_rows=5, heads_q=4,
                                heads_k=2, head_dim=128, dtype="float8_e4m3fn", causal=True)
    else:
        case = make_case(rng, dtype="float8_e4m3fn", **FP8_FORWARD_CASES[name])
    Target("cupy", "cuda", "full").check(quantized(rng, case))


@gpu
def test_fp8_nan_in_v_reaches_exactly_the_rows_that_read_it():
    """NaN in V, causal, 200 keys: at key 40 (head 0, feature 3) it lies in a masked tile of the first
    query tile (poisoned and cleared: forward_fp8_sm90.cu) and an unmasked one of the second (the
    product's own NaN); at key 150 (head 1, feature 9), in a masked tile. Exactly the rows that read
    each get NaN, in its head and feature alone."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((1, 200, 2, 128), generator=generator, device="cuda").to(torch.float8_e4m3fn)
               for _ in range(3))
    bits = v.view(torch.uint8)
    bits[0, 40, 0, 3] = bits[0, 150, 1, 9] = 0x7F  # e4m3's NaN
    o = flashx.attention(q, k, v, causal=True, backend="cupy")
    want = torch.zeros(o.shape, dtype=torch.bool, device="cuda")
    want[0, 40:, 0, 3] = want[0, 150:, 1, 9] = True
    assert torch.equal(o.isnan(), want)


# -- the wgmma forward's TMA copies (host side) ---------------------------------------------

def _kv(batch=2, seqlen=300, heads=4, dim=128, dtype="bfloat16"):
    import torch

    return torch.zeros(batch, seqlen, heads, dim, dtype=getattr(torch, dtype))


def test_tma_takes_strided_16_bit_tensors_and_not_varlen():
    """TMA describes K and V, (B, Nk, Hk, D), whatever their layout, where each stride is a positive
    multiple of 16 bytes (dims of one element aside) and the base is 16-byte aligned; packed
    sequences keep cp.async."""
    import torch

    plain, varlen = _problem(), _problem(varlen=True)
    k = _kv()
    assert tma.usable(plain, k, k) and not tma.usable(varlen, k, k)
    assert tma.usable(plain, _kv(heads=4).transpose(1, 2).contiguous().transpose(1, 2), k)  # (B, Hk, Nk, D) storage
    assert tma.usable(plain, _kv(dim=256)[..., :96], k)  # rows of 512 bytes, 96 features read
    assert not tma.usable(plain, _kv(dim=68)[..., :64], k)  # rows 136 bytes apart
    assert not tma.usable(plain, torch.zeros(2 * 300 * 4 * 128 + 4, dtype=torch.bfloat16)[4:].view(2, 300, 4, 128), k)  # base 8 bytes off
    assert not tma.usable(plain, _kv(heads=1).expand(2, 300, 4, 128), k)  # a stride of 0 over 4 heads
    assert not tma.usable(plain, k, _kv(seqlen=0))  # no keys: no map
    # a dim of one element: its stride is never stepped along
    one = torch.zeros(1, 300, 1, 128, dtype=torch.bfloat16).as_strided((1, 300, 1, 128), (7, 128, 3, 1))
    assert tma.usable(plain, one, one)


def test_without_cuda_bindings_every_problem_keeps_cp_async(monkeypatch):
    """CuPy runs without cuda-bindings, which alone encodes the maps: where it does not import, no
    problem takes TMA (rather than failing at its first forward)."""
    import sys

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails
    tma.driver_present.cache_clear()
    try:
        assert not tma.usable(_problem(), _kv(), _kv())
    finally:
        tma.driver_present.cache_clear()


def test_tma_map_arguments(monkeypatch):
    """K's and V's maps: (head_dim, heads, rows, sequences) with their strides in bytes, boxes of 64
    columns (one 128-byte swizzled panel) and BLOCK_N rows of one head, the 128-byte swizzle and
    zeros past the map; the driver is called once per distinct tensor."""
    from cuda.bindings import driver

    calls = []

    def encode(*args):
        calls.append(args)
        return driver.CUresult.CUDA_SUCCESS, SimpleNamespace(opaque=list(range(len(calls) * 16, len(calls) * 16 + 16)))

    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled", encode)
    tma.encode.cache_clear()
    k = _kv(batch=2, seqlen=300, heads=4, dim=128)
    v = _kv(batch=2, seqlen=300, heads=4, dim=256, dtype="float16")[..., :64]
    maps = tma.kv_maps(k, v, rows=128)
    assert maps.dtype == tma.MAPS and len(calls) == 2
    assert list(maps[0]["k"]) == list(range(16, 32)) and list(maps[0]["v"]) == list(range(32, 48))
    for (element, rank, address, dims, strides, box, steps, interleave, swizzle, l2, fill), x, width, stored in (
            (calls[0], k, 128, 128), (calls[1], v, 64, 256)):
        assert element == getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{'BFLOAT16' if x is k else 'FLOAT16'}")
        assert rank == 4 and address == x.data_ptr()
        assert [int(n) for n in dims] == [width, 4, 300, 2]
        assert [int(s) for s in strides] == [stored * 2, 4 * stored * 2, 300 * 4 * stored * 2]
        assert [int(n) for n in box] == [64, 1, 128, 1] and [int(n) for n in steps] == [1, 1, 1, 1]
        assert interleave == driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
        assert swizzle == driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
        assert fill == driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE  # zeros
    tma.kv_maps(k, v, rows=128)
    assert len(calls) == 2  # cached
    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled", lambda *args: (driver.CUresult.CUDA_ERROR_INVALID_VALUE, None))
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled"):
        tma.kv_maps(k, v, rows=64)


def test_tma_strides_of_single_element_dims():
    """A dim of one element takes a dense stride, a multiple of 16 bytes, whatever the tensor's."""
    import torch

    x = torch.zeros(300 * 72, dtype=torch.bfloat16).as_strided((1, 300, 1, 64), (5, 72, 3, 1))
    assert tma.byte_strides(x) == (128, 144, 144 * 300)


def test_kv_maps_layout_matches_the_struct():
    """MAPS is ``struct KvMaps``: two 128-byte TensorMaps, 64-byte aligned."""
    text = variants.source("forward_sm90.cu")
    assert re.search(r"struct alignas\(64\) TensorMap \{\s*u64 opaque\[16\];\s*\};", text)
    assert re.search(r"struct KvMaps \{\s*TensorMap k, v;\s*\};", text)
    assert tma.MAPS.names == ("k", "v") and [tma.MAPS.fields[name][1] for name in ("k", "v")] == [0, 128]
    assert tma.MAPS.itemsize == tma.OPAQUE.itemsize == 256 and tma.OPAQUE.names is None
    assert "FORWARD_SM90(const Params p, const __grid_constant__ KvMaps maps)" in text


def test_tma_variant():
    """TMA is a build of its own (the TMA macro) of forward_sm90 alone."""
    problem = _problem(band=(-1, 0))  # a tile that both loads take
    plain, by_tma = (variants.choose("forward_sm90", problem, aligned=True, tma=tma_) for tma_ in (False, True))
    assert plain.macros["TMA"] == 0 and by_tma.macros["TMA"] == 1 and plain.shared_memory == by_tma.shared_memory
    assert "TMA" not in variants.choose("forward_fp8_sm90", _problem(dtype="float8_e4m3fn"), aligned=True).macros
    assert "TMA" not in variants.choose("forward", problem, aligned=True).macros


@pytest.mark.parametrize("changes, capability, takes", [
    ({}, "90", True),
    ({"seqlens_k": np.array([200, 300], np.int32)}, "90", True),  # the short sequences' last tiles by cp.async
    ({}, "80", False),  # the mma.sync forward
])
def test_forward_passes_the_maps(monkeypatch, changes, capability, takes):
    """The forward picks the TMA build where ``tma.usable`` holds and hands the wgmma forward its maps."""


    from cuda.bindings import driver

    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled",
                        lambda *args: (driver.CUresult.CUDA_SUCCESS, SimpleNamespace(opaque=[7] * 16)))
    tma.encode.cache_clear()
    problem = _torch_problem(dtype="bfloat16", seqlen_q=300, seqlen_k=300, heads_q=4, heads_k=4, head_dim=128,
                             head_dim_v=128, **changes)
    q = k = v = _kv()
    launched = []
    _route_launches(monkeypatch, SimpleNamespace(id=0, compute_capability=capability),
                    lambda variant, grid, params, extra: launched.append((variant, extra)))
    launch.forward(problem, q, k, v)
    (variant, extra), = launched
    assert variant.tma is takes
    if capability == "90":
        (maps,) = extra
        assert maps.dtype == tma.OPAQUE and (maps.view(tma.MAPS)[0]["k"] == 7).all()
    else:
        assert extra == ()


def test_tma_forward_compiles():
    """NVRTC builds the TMA forward: one thread's bulk tensor copies, and with seqlens the producer's
    cp.async for a short sequence's last tile, between barriers of the producer's threads."""
    _nvrtc()
    from flashx_cupy import resources

    tiles = 128, 128, 8
    plain = resources.ptx(variants.Variant("forward_sm90", "bfloat16", 128, 128, *tiles, tma=True), "90")
    short = resources.ptx(variants.Variant("forward_sm90", "bfloat16", 128, 128, *tiles, tma=True, seqlens_k=True), "90")
    for text in (plain, short):
        assert "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes" in text
        assert "mbarrier.arrive.expect_tx.shared::cta.b64" in text
    assert "bar.sync 2, 128;" in short and "cp.async.cg.shared.global" in short


@pytest.mark.parametrize("dim", [64, 128])
def test_sm90_forward_dropout_compiles(dim):
    """The wgmma forward with dropout (the tiles ``choose`` gives it) draws Philox's words (its
    multipliers) and keeps the exact path's barrier: a dropped pair reads no V, so a non-finite V
    of a tile without a mask goes through the clearing too."""
    _nvrtc()
    from flashx_cupy import resources

    variant = variants.choose("forward_sm90", _problem(head_dim=dim, head_dim_v=dim, dropout_p=0.1), aligned=True, tma=True)
    text = resources.ptx(variant, "90")
    assert variant.dropout and "-766435501" in text and "-845247145" in text  # 0xD2511F53, 0xCD9E8D57
    assert f"bar.sync 1, {32 * variant.warps};" in text


@pytest.mark.parametrize("tile, tma_, registers, product", [
    ((128, 128, 8, 3), True, (40, 232), "m64n128k16"),
    ((128, 176, 8, 2), True, (24, 240), "m64n176k16"),
    ((192, 128, 12, 3), False, (24, 160), "m64n128k16"),
])
def test_sm90_forward_tiles_compile(tile, tma_, registers, product):
    """NVRTC builds each tile shape: S's product of BLOCK_N keys, setmaxnreg's split of the registers
    (within what the CTA holds from its launch: 65536 over its threads, in 8s, each), the computing
    threads' barrier of their warpgroups."""
    _nvrtc()
    from flashx_cupy import resources

    block_m, block_n, warps, v_buffers = tile
    dim = 64 if block_m == 192 else 128
    text = resources.ptx(variants.Variant("forward_sm90", "bfloat16", dim, dim, block_m, block_n, warps, tma=tma_,
                                          v_buffers=v_buffers, softcap=True), "90")
    producer, computing = registers
    threads = 32 * (warps + variants.PRODUCER_WARPS)
    assert 128 * producer + 32 * warps * computing <= threads * (65536 // threads // 8 * 8)
    assert f"setmaxnreg.dec.sync.aligned.u32 {producer};" in text and f"setmaxnreg.inc.sync.aligned.u32 {computing};" in text
    assert f"wgmma.mma_async.sync.aligned.{product}.f32.bf16.bf16" in text
    assert f"bar.sync 1, {32 * warps};" in text  # the exact path's barrier of the computing threads
