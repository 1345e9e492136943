"""The GPU tier: sizes that break 32-bit offsets and grid limits, very long rows, other devices.

Run on a CUDA device (``--flashx-device cuda``, the default where there is one); each case
skips with a reason when the device lacks the memory. Deselect with ``-m "not slow"``.
Inputs are drawn on the device with torch (flashx hands them to any backend through DLPack);
the outputs are checked on slices small enough for the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashx
from flashx_conformance.harness import OUTPUTS, Case, Target, conformance_failures, make_case
from flashx_conformance.tolerance import EPS

pytestmark = pytest.mark.slow
GiB = 2**30


@pytest.fixture
def gpu(flashx_target):
    if not flashx_target.device.startswith("cuda"):
        pytest.skip(f"GPU tier: needs a CUDA device, the suite runs on {flashx_target.device}")
    if not flashx_target.full:
        pytest.skip("GPU tier: runs in the full tier")
    return flashx_target


def _random(torch, shape, dtype, device, offset=0.0):
    return (torch.randn(shape, device=device, dtype=torch.float32) + offset).to(getattr(torch, dtype))


def _check_batches(target, tensors: dict, outputs: dict, dtype: str, batches, **options):
    """Hold batch elements ``batches`` of a large padded run to the oracle (one element at a time)."""
    for b in batches:
        inputs = {name: target.numpy(x[b : b + 1]) for name, x in tensors.items()}
        got = {name: target.numpy(x[b : b + 1]) for name, x in outputs.items()}
        case = Case(inputs, dtype, options)
        failures = conformance_failures(case, got)
        assert not failures, f"batch element {b}: " + case.describe() + "\n" + "\n".join(failures)


def _run(target, tensors, **options):
    q, k, v, do = (tensors[n] for n in ("q", "k", "v", "do"))
    target.skip_unless_supported(q, k, v, **options)
    o, res = flashx.attention_forward(q, k, v, backend=target.name, **options)
    dq, dk, dv = flashx.attention_backward(do, q, k, v, o, res, backend=target.name, **options)
    return dict(zip(OUTPUTS, (o, res.lse, dq, dk, dv)))


def test_int32_offsets(gpu):
    """q, k, v, o and their gradients hold more than 2**31 elements: offsets must be 64-bit."""
    torch = pytest.importorskip("torch")
    dtype = "bfloat16"
    batch, seqlen, heads, dim = 2**31 // (256 * 16 * 128) + 1, 256, 16, 128  # 2**31 + 2**19 elements each
    gpu.require_free_memory(9 * batch * seqlen * heads * dim * 2 + 4 * GiB)
    shape = (batch, seqlen, heads, dim)
    tensors = {name: _random(torch, shape, dtype, gpu.device) for name in ("q", "k", "v", "do")}
    outputs = _run(gpu, tensors, causal=True)
    _check_batches(gpu, tensors, outputs, dtype, [0, batch - 1], causal=True)


def test_grid_limits(gpu):
    """B * H = 65600 > 65535, the limit of CUDA grid axes 1 and 2."""
    torch = pytest.importorskip("torch")
    dtype = "float16"
    batch, seqlen, heads, dim = 4100, 64, 16, 64
    gpu.require_free_memory(16 * batch * seqlen * heads * dim * 2 + GiB)
    tensors = {name: _random(torch, (batch, seqlen, heads, dim), dtype, gpu.device) for name in ("q", "k", "v", "do")}
    outputs = _run(gpu, tensors)
    _check_batches(gpu, tensors, outputs, dtype, [0, 2047, 4095, batch - 1])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_long_rows(gpu, dtype):
    """N = 131072 keys with q = k = 0: every weight is 1/N, so o = mean(v), dv = mean(dO), dq = dk = 0."""
    torch = pytest.importorskip("torch")
    seqlen, heads, dim = 131072, 2, 64
    gpu.require_free_memory(16 * seqlen * heads * dim * 2 + GiB)
    shape = (1, seqlen, heads, dim)
    zeros = torch.zeros(shape, device=gpu.device, dtype=getattr(torch, dtype))
    # offset 1: the means are O(1), so that an error in the normalisation cannot hide under rounding
    tensors = {"q": zeros, "k": zeros.clone(), "v": _random(torch, shape, dtype, gpu.device, 1.0), "do": _random(torch, shape, dtype, gpu.device, 1.0)}
    got = {name: gpu.numpy(x) for name, x in _run(gpu, tensors).items()}
    mean_v, mean_do = (gpu.numpy(tensors[n]).mean(axis=1, keepdims=True) for n in ("v", "do"))
    allowed = 4 * EPS[dtype]
    for name, expected in (("o", mean_v), ("dv", mean_do)):
        error = np.abs(got[name] - expected).max() / np.abs(expected).max()
        assert error <= allowed, f"{name}: relative error {error:.3e} > {allowed:.3e}"
    assert np.allclose(got["lse"], np.log(seqlen), rtol=0, atol=1e-4), f"lse: {got['lse'].min()} .. {got['lse'].max()}, expected ln N"
    for name in ("dq", "dk"):
        assert (got[name] == 0).all(), f"{name}: expected exactly 0 (q = k = 0), max |{name}| = {np.abs(got[name]).max()}"


def test_other_device(gpu, flashx_rng):
    """Tensors on a CUDA device other than the default one: outputs stay there and are right."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs a second CUDA device")
    other = Target(gpu.name, "cuda:1", gpu.tier)
    other.check(make_case(flashx_rng, heads_q=4, heads_k=2, seqlen_q=97, seqlen_k=143, dtype=other.dtype, causal=True))
