"""The core's side of the contract's FP8 section: descales and out_dtype checked with errors that
name them, forward only, dropout declined by every backend, FP8 tensors handed to NumPy backends
as views of their bits, autocast and torch.compile leaving the inputs' dtype alone; decoding from
an FP8 cache, its new tokens written through the bits in place."""

from __future__ import annotations

import numpy as np
import pytest

import flashx

torch = pytest.importorskip("torch")

E4M3 = torch.float8_e4m3fn


def fp8_inputs(batch=2, seqlen_q=5, seqlen_k=7, heads_q=4, heads_k=2, dim=8, dtype=E4M3):
    generator = torch.Generator().manual_seed(0)
    shapes = ((batch, seqlen_q, heads_q, dim), (batch, seqlen_k, heads_k, dim), (batch, seqlen_k, heads_k, dim))
    return tuple(torch.randn(shape, generator=generator).to(dtype) for shape in shapes)


def descale(batch=2, heads_k=2, value=0.5):
    return torch.full((batch, heads_k), value)


def fp8_cache_call(q_dtype=torch.bfloat16, **keywords):
    """The arguments of a decoding call on a contiguous float8_e4m3fn cache of 2 sequences (3 and 5
    tokens cached) with 2 new tokens each."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn((2, 2, 4, 8), generator=generator).to(q_dtype)
    k_cache, v_cache = (torch.randn((2, 10, 2, 8), generator=generator).to(E4M3) for _ in range(2))
    k_new, v_new = (torch.randn((2, 2, 2, 8), generator=generator).to(q_dtype) for _ in range(2))
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=torch.tensor([3, 5]), k_new=k_new, v_new=v_new,
                **keywords)


def test_output_dtype_and_lse():
    q, k, v = fp8_inputs()
    o, lse = flashx.attention(q, k, v, q_descale=descale(), return_lse=True, backend="numpy")
    assert (o.dtype, tuple(o.shape)) == (torch.bfloat16, (2, 5, 4, 8))
    assert (lse.dtype, tuple(lse.shape)) == (torch.float32, (2, 4, 5))
    for out_dtype in ("float16", torch.float16):
        assert flashx.attention(q, k, v, out_dtype=out_dtype, backend="numpy").dtype == torch.float16


def test_descales_are_the_inputs_scale():
    """A descale of 2 on k doubles the scores: the same as softmax_scale doubled; on v it doubles o."""
    q, k, v = fp8_inputs()
    plain = flashx.attention(q, k, v, out_dtype="float16", backend="numpy", softmax_scale=0.5).float()
    scaled_k = flashx.attention(q, k, v, out_dtype="float16", backend="numpy", softmax_scale=0.25,
                                k_descale=descale(value=2.0)).float()
    scaled_v = flashx.attention(q, k, v, out_dtype="float16", backend="numpy", softmax_scale=0.5,
                                v_descale=descale(value=2.0)).float()
    assert torch.equal(plain, scaled_k)
    assert torch.equal(2 * plain, scaled_v)


@pytest.mark.parametrize("keywords, error, message", [
    ({"q_descale": torch.ones(2, 4)}, flashx.ShapeError,
     r"^q_descale: expected shape \(2, 2\) \(B, Hk\), got \(2, 4\)"),
    ({"k_descale": torch.ones(2, 2, dtype=torch.float16)}, flashx.DTypeError, "^k_descale: expected a float32 array"),
    ({"v_descale": np.ones((2, 2), np.float32)}, flashx.DTypeError, "^v_descale: expected a torch array like q"),
    ({"v_descale": torch.tensor([[1.0, 0.0], [1.0, 1.0]])}, flashx.OptionError,
     r"^v_descale: expected finite descales > 0, got 0.0 at \[0, 1\]"),
    ({"q_descale": torch.tensor([[1.0, 1.0], [-2.0, float("nan")]])}, flashx.OptionError,
     r"^q_descale: expected finite descales > 0, got -2.0 at \[1, 0\] \(2 of 4 are not\)"),
    ({"out_dtype": "float32"}, flashx.DTypeError, "^out_dtype: expected one of bfloat16, float16"),
    ({"out_dtype": torch.float8_e4m3fn}, flashx.DTypeError, "^out_dtype: expected one of bfloat16, float16"),
])
def test_argument_errors(keywords, error, message):
    with pytest.raises(error, match=message):
        flashx.attention(*fp8_inputs(), backend="numpy", **keywords)


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale", "out_dtype"])
def test_fp8_keywords_need_fp8_inputs(name):
    value = "bfloat16" if name == "out_dtype" else descale()
    with pytest.raises(flashx.DTypeError, match=f"^{name}: only for FP8 inputs .* got q of dtype bfloat16"):
        flashx.attention(*(x.bfloat16() for x in fp8_inputs()), **{name: value})


def test_one_fp8_dtype_for_q_k_v():
    q, k, v = fp8_inputs()
    with pytest.raises(flashx.DTypeError, match=r"^k: expected the dtype of q \(float8_e4m3fn\), got float8_e5m2"):
        flashx.attention(q, k.float().to(torch.float8_e5m2), v)
    with pytest.raises(flashx.DTypeError, match=r"^v: expected the dtype of q \(float8_e4m3fn\), got bfloat16"):
        flashx.attention(q, k, v.bfloat16())


def test_varlen_descales_have_one_row_per_sequence():
    q, k, v = (x.reshape(-1, *x.shape[2:]) for x in fp8_inputs(seqlen_q=6, seqlen_k=6))
    cu = torch.tensor([0, 4, 4, 12], dtype=torch.int32)  # three sequences, one empty
    with pytest.raises(flashx.ShapeError, match=r"^k_descale: expected shape \(3, 2\)"):
        flashx.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, k_descale=descale())
    o = flashx.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, k_descale=descale(batch=3), backend="numpy")
    assert tuple(o.shape) == (12, 4, 8)


def test_forward_only():
    """The backward declines FP8 with the reason, before any backend is asked; so does autograd."""
    q, k, v = fp8_inputs()
    o, res = flashx.attention_forward(q, k, v, backend="numpy")
    with pytest.raises(flashx.UnsupportedError, match="^attention_backward: FP8 attention is forward only"):
        flashx.attention_backward(o, q, k, v, o, res)
    q.requires_grad_()
    with pytest.raises(flashx.UnsupportedError, match="FP8 attention is forward only .* require grad"):
        flashx.attention(q, k, v, backend="numpy")
    with torch.no_grad():
        assert torch.equal(flashx.attention(q, k, v, backend="numpy"), o)
    assert "forward only (FP8)" in flashx.explain(q, k, v).problem.describe()


def test_every_backend_declines_dropout_and_says_why():
    explanation = flashx.explain(*fp8_inputs(), dropout_p=0.1)
    problem = explanation.problem
    for name, backend in flashx.registry.backends().items():
        assert any("no dropout with FP8 inputs" in reason for reason in backend.supports(problem)), name
    with pytest.raises(flashx.UnsupportedError, match="takes no dropout with FP8 inputs"):
        flashx.attention(*fp8_inputs(), dropout_p=0.1, backend="numpy")


def test_numba_declines_fp8_for_now():
    """Whether or not it is available here, its declaration declines FP8 with the reason, in
    attention and in decoding (triton takes FP8; cupy decodes from FP8 caches, test_cupy_backend.py)."""
    backend = flashx.registry.get("numba")
    problem = flashx.explain(*fp8_inputs(dtype=torch.float8_e5m2)).problem
    assert "does not implement FP8 (float8_e5m2) yet" in backend.supports(problem)
    decoding = flashx.kvcache.explain(**fp8_cache_call()).problem
    assert "does not implement FP8 (float8_e4m3fn) yet" in backend.supports(decoding)


def test_a_default_backend_does_not_claim_fp8():
    """FP8 inputs come with descales a backend must read: only one that names the FP8 dtypes takes them."""

    class Plain(flashx.Backend):
        devices = frozenset({"cpu"})

    problem = flashx.explain(*fp8_inputs()).problem
    assert Plain().supports(problem) == ["does not implement FP8 (float8_e4m3fn) yet"]


def test_fp8_reaches_numpy_as_its_bits():
    """NumPy has no FP8 dtype, and DLPack does not carry one: a uint8 view of the same memory."""
    q = fp8_inputs()[0][:, ::2]
    bits = flashx.arrays.convert(q, "numpy")
    assert bits.dtype == np.uint8 and bits.shape == tuple(q.shape)
    assert bits.ctypes.data == q.data_ptr()
    assert (bits == q.view(torch.uint8).numpy()).all()


def test_autocast_leaves_fp8_alone():
    q, k, v = fp8_inputs()
    expected = flashx.attention(q, k, v, backend="numpy")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(flashx.attention(q, k, v, backend="numpy"), expected)


def test_empty_problems_have_the_output_dtype():
    q, k, v = fp8_inputs(seqlen_k=0)
    o, lse = flashx.attention(q, k, v, out_dtype="float16", return_lse=True)
    assert o.dtype == torch.float16 and (o == 0).all() and (lse == -float("inf")).all()


def test_compiles_with_the_output_dtype():
    """Traced by torch.compile, the operator's fake output has out_dtype, and the values are eager's."""
    q, k, v = fp8_inputs()
    scales = descale(), descale(value=0.25), descale(value=4.0)

    def call(q, k, v, q_descale, k_descale, v_descale):
        return flashx.attention(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                out_dtype=torch.float16, causal=True, backend="numpy")

    torch._dynamo.reset()
    try:
        compiled = torch.compile(call, backend="aot_eager", fullgraph=True)(q, k, v, *scales)
    finally:
        torch._dynamo.reset()
    assert compiled.dtype == torch.float16
    assert torch.equal(compiled, call(q, k, v, *scales))


def test_fp8_cache_takes_new_tokens_quantized_in_place():
    """The new tokens are x / descale rounded as torch rounds to float8_e4m3fn, written into the
    caller's cache; o has q's dtype."""
    descales = {"k_descale": torch.tensor([[0.5, 2.0], [0.25, 1.0]]), "v_descale": torch.full((2, 2), 0.125)}
    arguments = fp8_cache_call(**descales)
    o = flashx.attention_with_kvcache(**arguments, backend="numpy")
    assert o.dtype == torch.bfloat16
    for name, new in (("k_cache", "k_new"), ("v_cache", "v_new")):
        descale = descales[name[0] + "_descale"]
        for b, start in enumerate((3, 5)):
            written = arguments[name][b, start:start + 2].view(torch.uint8)
            expected = (arguments[new][b].float() / descale[b][None, :, None]).to(E4M3).view(torch.uint8)
            assert torch.equal(written, expected), (name, b)


@pytest.mark.parametrize("keywords, error, message", [
    ({"k_descale": torch.ones(2, 4)}, flashx.ShapeError, r"^k_descale: expected shape \(2, 2\) \(B, Hk\)"),
    ({"v_descale": torch.zeros(2, 2)}, flashx.OptionError, "^v_descale: expected finite descales > 0, got 0.0"),
])
def test_fp8_cache_descale_errors(keywords, error, message):
    arguments = fp8_cache_call()
    with pytest.raises(error, match=message):
        flashx.attention_with_kvcache(**arguments, **keywords)


def test_fp8_cache_dtype_errors():
    arguments = fp8_cache_call(q_dtype=torch.float32)
    with pytest.raises(flashx.DTypeError, match=r"^k_cache: expected the dtype of q \(float32\), got float8_e4m3fn"):
        flashx.attention_with_kvcache(**arguments)
    arguments = fp8_cache_call()
    with pytest.raises(flashx.DTypeError, match=r"^v_cache: expected the dtype of k_cache \(float8_e4m3fn\), got bf"):
        flashx.attention_with_kvcache(**{**arguments, "v_cache": arguments["v_cache"].bfloat16()})
    with pytest.raises(flashx.DTypeError, match=r"^k_cache: expected the dtype of q \(bfloat16\) or float8_e4m3fn"):
        flashx.attention_with_kvcache(**{**arguments, "k_cache": arguments["k_cache"].to(torch.float8_e5m2)})
    bf16 = {**arguments, "k_cache": arguments["k_cache"].bfloat16(), "v_cache": arguments["v_cache"].bfloat16()}
    with pytest.raises(flashx.DTypeError, match="^v_descale: only for an FP8 cache .* got k_cache of dtype bfloat16"):
        flashx.attention_with_kvcache(**bf16, v_descale=torch.ones(2, 2))


def test_fp8_cache_descales_unread_without_validation():
    """validate=False reads no device value: descales are the caller's promise, like lengths."""
    arguments = fp8_cache_call(k_descale=torch.zeros(2, 2))
    assert flashx.kvcache.explain(**arguments, validate=False).problem.k_descale is not None


def test_fp8_cache_compiles():
    arguments = fp8_cache_call(k_descale=torch.full((2, 2), 0.5))
    eager = dict(arguments, k_cache=arguments["k_cache"].clone(), v_cache=arguments["v_cache"].clone())

    def call(**arguments):
        return flashx.attention_with_kvcache(**arguments, backend="numpy")

    torch._dynamo.reset()
    try:
        compiled = torch.compile(call, backend="aot_eager", fullgraph=True)(**arguments)
    finally:
        torch._dynamo.reset()
    assert compiled.dtype == torch.bfloat16
    assert torch.equal(compiled, call(**eager))
    assert torch.equal(arguments["k_cache"].view(torch.uint8), eager["k_cache"].view(torch.uint8))


def _pre_2_12_cast(monkeypatch):
    """torch's float32 -> float8_e4m3fn cast as before 2.12 (pytorch#178817): a magnitude that
    rounds past 448, infinities included, became NaN."""
    cast = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = cast(self, *args, **kwargs)
        if out.dtype == E4M3 and self.is_floating_point() and self.dtype != E4M3:
            overflow = (self.abs() > 464) | self.isinf()
            out = out.view(torch.uint8).masked_fill(overflow, 0x7F).view(E4M3)
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)


@pytest.mark.parametrize("cast", ["installed", "pre-2.12"])
def test_oracle_cache_saturates_whatever_torchs_cast(monkeypatch, cast):
    """The conformance oracle writes new tokens into an FP8 cache by the contract's rule, ±448
    past 448 (infinities too) and NaN kept, also where torch's own cast made an overflow NaN."""
    from flashx_conformance import oracle

    if cast == "pre-2.12":
        _pre_2_12_cast(monkeypatch)
    k_new = np.array([[[[3e4, -np.inf, np.nan, 464.0, 465.0, -1.0]]]])
    cache = np.zeros((1, 2, 1, 6))
    k_cache, *_ = oracle.kvcache(np.zeros((1, 1, 1, 6)), cache, cache, cache_seqlens=[1], k_new=k_new, v_new=k_new,
                                 cache_dtype="float8_e4m3fn", k_descale=np.array([[0.5]], np.float32))
    np.testing.assert_array_equal(k_cache[0, 1, 0], [448, -448, np.nan, 448, 448, -2])
