"""The Triton backend's FP8 (the contract's FP8 section) under Triton's interpreter.

The conformance suite holds FP8 calls to twice plain FP8's error, which a kernel that skipped the
rounding of P would also meet; these tests pin the conversions themselves (``flashx_triton.fp8``)
to torch's, and the forward in one key tile to plain attention in FP8.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (they import lazily)

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="the Triton backend needs triton (pip install 'flashx-attention[triton]')")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from flashx_conformance import oracle  # noqa: E402
from flashx_triton.fp8 import keys_contiguous, on_e4m3_grid, quantized_e4m3, widened  # noqa: E402

import flashx  # noqa: E402


def test_triton_declares_fp8_in_attention_and_decoding():
    """Both FP8 formats in attention and an e4m3 cache in decoding are taken, with no FP8 reason."""
    backend = flashx.registry.get("triton")
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = torch.zeros((1, 4, 2, 16), dtype=dtype)
        assert backend.supports(flashx.explain(q, q, q).problem) == []
    cache = torch.zeros((1, 8, 2, 16), dtype=torch.float8_e4m3fn)
    q = torch.zeros((1, 1, 2, 16), dtype=torch.bfloat16)
    decoding = flashx.kvcache.explain(q, cache, cache, cache_seqlens=torch.tensor([3], dtype=torch.int32)).problem
    assert backend.supports(decoding) == []


@triton.jit
def _widen(X, OUT, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(OUT + i, widened(tl.load(X + i), True))


@triton.jit
def _round(X, GRID, BYTES, n, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(X + i, mask=i < n)
    tl.store(GRID + i, on_e4m3_grid(x), mask=i < n)
    tl.store(BYTES + i, quantized_e4m3(x, True), mask=i < n)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_widened_reads_every_byte_as_torch_does(dtype):
    """NaN, infinities and subnormals included, which the interpreter's own conversion misreads."""
    x = torch.arange(256, dtype=torch.uint8).view(dtype)
    out = torch.empty(256)
    _widen[(1,)](x, out, 256)
    assert torch.equal(out.isnan(), x.float().isnan())
    assert torch.equal(out.nan_to_num(), x.float().nan_to_num())


def test_rounding_to_e4m3_is_torchs_saturating_conversion():
    """Every e4m3 value, the midpoints between neighbours (ties to even), random magnitudes from
    below the subnormals to past 448, infinities and NaN: rounded as torch rounds the float32
    value clamped to ±448, both onto the grid in float32 and into the cache's bytes."""
    values = torch.arange(255, dtype=torch.uint8)[torch.arange(255) != 127].view(torch.float8_e4m3fn).float()
    positive = values[values > 0].sort().values
    midpoints = (positive[1:] + positive[:-1]) / 2
    generator = torch.Generator().manual_seed(0)
    magnitudes = 2.0 ** (torch.rand(4000, generator=generator) * 22 - 13)
    signs = torch.where(torch.rand(4000, generator=generator) < 0.5, -1.0, 1.0)
    x = torch.cat([values, midpoints, -midpoints, magnitudes * signs,
                   torch.tensor([0.0, -0.0, 448.0, 464.0, 465.0, 1e30, float("inf"), float("-inf"), float("nan")])])
    grid, bytes_ = torch.empty_like(x), torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    _round[(1,)](x, grid, bytes_, x.numel(), triton.next_power_of_2(x.numel()))
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    for got in (grid, bytes_.float()):
        assert torch.equal(got.isnan(), want.isnan())
        mismatch = (got.nan_to_num() != want.nan_to_num()).nonzero()
        assert mismatch.numel() == 0, f"at {x[mismatch[:4, 0]].tolist()}: {got[mismatch[:4, 0]].tolist()}"


@pytest.mark.parametrize("varlen", [False, True])
def test_v_is_read_with_its_keys_contiguous_in_a_view_of_its_own_shape(varlen):
    v = torch.randn((7, 3, 5) if varlen else (2, 7, 3, 5)).to(torch.float8_e4m3fn)
    got = keys_contiguous(v, varlen)
    assert got.shape == v.shape and got.stride(0 if varlen else 1) == 1
    assert torch.equal(got.view(torch.uint8), v.view(torch.uint8))
    assert keys_contiguous(got, varlen) is got  # a caller's keys-contiguous V is not copied again
    # masked tiles read up to 15 keys past a sequence's end: a keys-contiguous V without that
    # much memory after its last element is copied
    tight = v.permute((1, 2, 0) if varlen else (0, 2, 3, 1)).contiguous()
    tight = tight.permute((2, 0, 1) if varlen else (0, 3, 1, 2))
    assert keys_contiguous(tight, varlen) is not tight
    assert torch.equal(keys_contiguous(tight, varlen).view(torch.uint8), v.view(torch.uint8))


@pytest.mark.parametrize("scale", [0.3, -0.3])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_one_key_tile_is_plain_attention_in_fp8(dtype, scale):
    """With every key in one tile the kernel's weights are plain FP8's, rounded to e4m3 against
    the row's maximum: o agrees with ``oracle.naive_fp8`` far inside the effect of that rounding
    (a negative scale runs on q with its sign bits flipped)."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=generator) * 4 for shape in ((2, 20, 4, 16), (2, 24, 2, 16), (2, 24, 2, 16)))
    q8, k8, v8 = (x.to(dtype) for x in (q, k, v))
    descales = {name: 2.0 ** torch.randn((2, 2), generator=generator) for name in ("q_descale", "k_descale",
                                                                                       "v_descale")}
    options = {"softmax_scale": scale, "causal": True, "out_dtype": "float16"}
    o, res = flashx.attention_forward(q8, k8, v8, backend="triton", **descales, **options)
    plain = oracle.naive_fp8(*(x.double().numpy() for x in (q8, k8, v8)),
                             **{name: x.numpy() for name, x in descales.items()}, **options)
    np.testing.assert_allclose(o.double().numpy(), plain[0], rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(res.lse.numpy(), plain[1], rtol=1e-5, atol=1e-5)
    # unrounded weights land far outside that tolerance: the test sees the rounding
    real = [x.double() * descales[name].double().repeat_interleave(x.shape[2] // 2, 1)[:, None, :, None]
            for x, name in ((q8, "q_descale"), (k8, "k_descale"), (v8, "v_descale"))]
    exact = oracle.forward(*(x.numpy() for x in real), softmax_scale=scale, causal=True)[0]
    got = o.double().numpy()
    assert np.abs(got - exact).max() > 10 * np.abs(got - plain[0]).max()
