"""flashx.compat against what it imitates: torch's SDPA on the same inputs, flash-attn 2's semantics
(bottom-right causal, windows, packed sequences, KV caches) through the float64 oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import flashx  # noqa: E402
from flashx import compat  # noqa: E402
from flashx_conformance import oracle  # noqa: E402


def _randn(*shape, seed=0, grad=False):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.requires_grad_(grad)


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got.detach()), np.asarray(want.detach() if hasattr(want, "detach") else want),
                               rtol=1e-10, atol=1e-12)


def _both(inputs, flashx_call, torch_call):
    """Outputs and gradients of both calls on the same leaves, for the same upstream gradient."""
    results = []
    for call in (flashx_call, torch_call):
        out = call(*inputs)
        results.append((out, *torch.autograd.grad(out, inputs, torch.cos(out).detach())))
    return results


# --- scaled_dot_product_attention ------------------------------------------------------------------

@pytest.mark.parametrize("heads_k, enable_gqa", [(4, False), (2, True)])
@pytest.mark.parametrize("length_q, length_k", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_matches_torch(length_q, length_k, is_causal, heads_k, enable_gqa):
    """Top-left causal at every shape: L < S drops keys no query may read, L > S is a band."""
    inputs = (_randn(2, 4, length_q, 8, grad=True), _randn(2, heads_k, length_k, 8, seed=1, grad=True),
              _randn(2, heads_k, length_k, 6, seed=2, grad=True))
    keywords = dict(is_causal=is_causal, enable_gqa=enable_gqa, scale=0.3)
    ours, theirs = _both(inputs, lambda *x: compat.scaled_dot_product_attention(*x, **keywords),
                         lambda *x: F.scaled_dot_product_attention(*x, **keywords))
    for got, want in zip(ours, theirs):
        _close(got, want)


@pytest.mark.parametrize("kind", ["bool", "float 0/-inf"])
@pytest.mark.parametrize("shape_q, mask_shape", [
    ((2, 3, 6, 8), (2, 1, 6, 5)),     # per batch, shared by the heads
    ((2, 3, 6, 8), (6, 5)),           # one for all
    ((3, 6, 8), (3, 6, 5)),           # no batch dim
    ((2, 2, 3, 6, 8), (2, 1, 1, 6, 5)),  # two batch dims
])
def test_sdpa_masks_match_torch(kind, shape_q, mask_shape):
    keys = shape_q[:-2] + (5, 8)
    inputs = (_randn(*shape_q, grad=True), _randn(*keys, seed=1, grad=True), _randn(*keys, seed=2, grad=True))
    allowed = torch.rand(mask_shape, generator=torch.Generator().manual_seed(3)) > 0.4
    allowed[..., 0, :] = False  # a row with no allowed key: 0, as SDPA gives
    mask = allowed if kind == "bool" else torch.zeros(mask_shape, dtype=torch.float64).masked_fill(~allowed, -math.inf)
    ours, theirs = _both(inputs, lambda *x: compat.scaled_dot_product_attention(*x, attn_mask=mask),
                         lambda *x: F.scaled_dot_product_attention(*x, attn_mask=mask))
    for got, want in zip(ours, theirs):
        _close(got, want)


@pytest.mark.parametrize("shape_q", [(2, 3, 0, 8), (0, 3, 5, 8), (2, 2, 3, 0, 8), (0, 2, 3, 5, 8)])
def test_sdpa_takes_empty_tensors_as_sdpa_does(shape_q):
    """No query rows or no batch: an empty output of SDPA's shape (not an error of the
    merge of the leading dims, which has no size to infer from an empty tensor)."""
    q = _randn(*shape_q)
    k = v = _randn(*shape_q[:-2], 4, 8, seed=1)
    got, want = compat.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v)
    assert got.shape == want.shape == shape_q


def test_sdpa_dropout_is_flashx_dropout_in_sdpa_layout():
    """Dropout draws flashx's Philox mask, seeded from torch's generator as flashx.attention seeds it."""
    q, k, v = _randn(1, 2, 16, 8), _randn(1, 2, 16, 8, seed=1), _randn(1, 2, 16, 8, seed=2)
    torch.manual_seed(5)
    ours = compat.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    torch.manual_seed(5)
    expected = flashx.attention(*(x.transpose(1, 2) for x in (q, k, v)), dropout_p=0.3, causal=True)
    assert torch.equal(ours, expected.transpose(1, 2))
    assert not torch.equal(ours, compat.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_sdpa_declines_a_float_bias():
    q = _randn(1, 2, 4, 8)
    bias = torch.zeros(4, 4, dtype=torch.float64)
    bias[1, 2] = 0.5
    with pytest.raises(flashx.UnsupportedError, match="additive bias"):
        compat.scaled_dot_product_attention(q, q, q, attn_mask=bias)
    bias[1, 2] = torch.finfo(torch.float64).min  # "masked" as transformers' eager masks write it: not -inf
    with pytest.raises(flashx.UnsupportedError, match="0 and -inf"):
        compat.scaled_dot_product_attention(q, q, q, attn_mask=bias)


def test_sdpa_refuses_what_sdpa_refuses():
    q, k = _randn(1, 4, 4, 8), _randn(1, 2, 4, 8)
    with pytest.raises(flashx.ShapeError, match="enable_gqa"):
        compat.scaled_dot_product_attention(q, k, k)
    with pytest.raises(flashx.ShapeError, match="is_causal"):
        compat.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(flashx.DTypeError, match="attn_mask"):
        compat.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(flashx.UnsupportedError, match="leading"):
        compat.scaled_dot_product_attention(q, _randn(2, 4, 4, 8), _randn(2, 4, 4, 8))


@pytest.mark.parametrize("change, error, words", [
    (lambda q, k, v, o: (q, _randn(2, 3, 7, 8), _randn(2, 3, 7, 8), o), flashx.ShapeError,
     "k: expected a head count dividing"),
    (lambda q, k, v, o: (q, _randn(1, 2, 7, 8), v, o), flashx.UnsupportedError, "leading (batch) dims"),
    (lambda q, k, v, o: (q, k, v, dict(o, enable_gqa=False)), flashx.ShapeError, "enable_gqa=False"),
    (lambda q, k, v, o: (q, k.float(), v, o), flashx.DTypeError, "k: expected the dtype of q"),
    (lambda q, k, v, o: (q, k, v.to("meta"), o), flashx.DeviceError, "v: expected an array on q's device cpu"),
    (lambda q, k, v, o: (q, k, v, dict(o, scale=math.nan)), flashx.OptionError, "softmax_scale: expected a finite"),
    (lambda q, k, v, o: (q, k, v, dict(o, dropout_p=1.5)), flashx.OptionError, "dropout_p: expected a number in"),
    (lambda q, k, v, o: (q, k, v, dict(o, softcap=-1.0)), flashx.OptionError, "softcap"),
    (lambda q, k, v, o: (q[..., :4], k, v, o), flashx.ShapeError, "k: expected head dim 4"),
])
def test_a_remembered_sdpa_call_meets_every_check_again_when_one_field_changes(change, error, words):
    """``sdpa_as_flashx`` remembers a call without a mask whole, under its keywords and its
    tensors' metadata: a call that differs in one field (a shape, a dtype, a device, a keyword)
    meets every check again and raises; the remembered call still computes what SDPA does."""
    from flashx import plan

    q, k, v = _randn(2, 4, 5, 8), _randn(2, 2, 7, 8, seed=1), _randn(2, 2, 7, 8, seed=2)
    right = dict(is_causal=True, scale=0.3, enable_gqa=True, softcap=None, backend="numpy")
    for _ in range(2):
        compat.sdpa_as_flashx(q, k, v, **right)
    given = dict(softcap=None, attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.3,
                 enable_gqa=True)  # as sdpa_as_flashx orders them: its other keywords first
    assert plan.prepared(plan.call_key(q, k, v, "numpy", given, "sdpa_as_flashx")) is not None
    q2, k2, v2, options = change(q, k, v, right)
    with pytest.raises(error) as caught:
        compat.sdpa_as_flashx(q2, k2, v2, **options)
    assert words in str(caught.value)
    for seed in (3, 4):
        inputs = _randn(2, 4, 5, 8, seed=seed), k, _randn(2, 2, 7, 8, seed=seed + 10)
        got = compat.sdpa_as_flashx(*inputs, **right).transpose(1, 2)
        _close(got, F.scaled_dot_product_attention(*inputs, is_causal=True, scale=0.3, enable_gqa=True))


# --- flash-attn 2 -----------------------------------------------------------------------------------

def _numpy(*xs):
    return tuple(x.detach().numpy() for x in xs)


@pytest.mark.parametrize("keywords, options", [
    ({"causal": True}, {"causal": True}),  # 5 queries over 9 keys, aligned bottom-right
    ({"window_size": (2, 1), "softmax_scale": 0.5}, {"window": (2, 1), "softmax_scale": 0.5}),
    ({"window_size": (3, -1), "causal": True}, {"window": (3, -1), "causal": True}),
    ({"window_size": (-1, -1), "softcap": 0.0}, {}),
    ({"softcap": 1.5, "causal": True}, {"softcap": 1.5, "causal": True}),
    ({"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}, {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])}),
])
def test_flash_attn_func_matches_the_oracle(keywords, options):
    q, k, v = _randn(2, 5, 4, 8, grad=True), _randn(2, 9, 2, 8, seed=1, grad=True), _randn(2, 9, 2, 6, seed=2, grad=True)
    o, lse, probs = compat.flash_attn_func(q, k, v, return_attn_probs=True, **keywords)
    assert probs is None  # never materialised
    do = torch.cos(o).detach()
    grads = torch.autograd.grad(o, (q, k, v), do)
    want = oracle.forward_backward(*_numpy(do, q, k, v), **options)
    for got, expected in zip((o, lse, *grads), want):
        _close(got, expected)
    assert torch.equal(compat.flash_attn_func(q, k, v, **keywords), o)


def test_flash_attn_dropout_is_flashx_dropout():
    q, k, v = _randn(2, 8, 2, 8), _randn(2, 8, 2, 8, seed=1), _randn(2, 8, 2, 8, seed=2)
    torch.manual_seed(9)
    ours = compat.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
    torch.manual_seed(9)
    assert torch.equal(ours, flashx.attention(q, k, v, dropout_p=0.2, causal=True))


def test_flash_attn_varlen_func_matches_the_oracle():
    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 6, 7, 12], dtype=torch.int32)
    q, k, v = _randn(8, 4, 8, grad=True), _randn(12, 2, 8, seed=1, grad=True), _randn(12, 2, 8, seed=2, grad=True)
    o, lse, _ = compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True, window_size=(4, 0),
                                              return_attn_probs=True)
    do = torch.cos(o).detach()
    grads = torch.autograd.grad(o, (q, k, v), do)
    want = oracle.forward_backward(*_numpy(do, q, k, v), cu_seqlens_q=cu_q.numpy(), cu_seqlens_k=cu_k.numpy(),
                                   causal=True, window=(4, 0))
    for got, expected in zip((o, lse, *grads), want):
        _close(got, expected)
    with pytest.raises(flashx.ShapeError, match="max_seqlen_k"):
        compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5)  # a hint below the longest sequence
    with pytest.raises(flashx.UnsupportedError, match="block_table"):
        compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, block_table=torch.zeros(3, 1, dtype=torch.int32))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("keywords, options", [
    ({}, {}),
    ({"softcap": 1.5}, {"softcap": 1.5}),
    ({"alibi_slopes": torch.tensor([[0.5, 0.25, 0.125, 1.0], [2.0, 0.75, 0.0625, 0.5]], dtype=torch.float32)},
     {"alibi_slopes": np.array([[0.5, 0.25, 0.125, 1.0], [2.0, 0.75, 0.0625, 0.5]])}),
], ids=["plain", "softcap", "alibi"])
def test_flash_attn_with_kvcache_matches_the_oracle(paged, keywords, options):
    """Softcap and ALiBi (per sequence and head) decode as flash-attn's do: query i at key Lk - Nq + i."""
    batch, capacity = 2, 12
    q, k_new, v_new = _randn(batch, 2, 4, 8), _randn(batch, 2, 2, 8, seed=1), _randn(batch, 2, 2, 8, seed=2)
    lengths = torch.tensor([3, 10], dtype=torch.int32)
    if paged:  # pages of 4 slots, handed out in a shuffled order
        k_cache, v_cache = _randn(7, 4, 2, 8, seed=3), _randn(7, 4, 2, 8, seed=4)
        block_table = torch.tensor([[5, 0, 3], [6, 2, 1]], dtype=torch.int32)
    else:
        k_cache, v_cache = _randn(batch, capacity, 2, 8, seed=3), _randn(batch, capacity, 2, 8, seed=4)
        block_table = None
    want_k, want_v, k, v, options = oracle.kvcache(
        *_numpy(q, k_cache, v_cache), cache_seqlens=lengths.numpy(), k_new=k_new.numpy(), v_new=v_new.numpy(),
        block_table=None if block_table is None else block_table.numpy(), causal=True, **options)
    o, lse = compat.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                            block_table=block_table, causal=True, return_softmax_lse=True, **keywords)
    want_o, want_lse = oracle.forward(q.numpy(), k, v, **options)
    _close(o, want_o)
    _close(lse, want_lse)
    np.testing.assert_array_equal(k_cache.numpy(), want_k)  # the new tokens written in place
    np.testing.assert_array_equal(v_cache.numpy(), want_v)


def test_flash_attn_with_kvcache_defaults():
    """causal=False by default, as in flash-attn; an int cache_seqlens is every sequence's length."""
    q, k_cache, v_cache = _randn(2, 3, 2, 8), _randn(2, 6, 2, 8, seed=1), _randn(2, 6, 2, 8, seed=2)
    o = compat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4)
    want, _ = oracle.forward(*_numpy(q, k_cache, v_cache), seqlens_k=np.array([4, 4]))
    _close(o, want)
    o = compat.flash_attn_with_kvcache(q, k_cache, v_cache)  # None: the whole cache
    _close(o, oracle.forward(*_numpy(q, k_cache, v_cache))[0])
    for name, value in (("rotary_cos", torch.ones(6, 4)), ("cache_batch_idx", torch.arange(2)),
                        ("cache_leftpad", torch.zeros(2, dtype=torch.int32))):
        with pytest.raises(flashx.UnsupportedError, match=name):
            compat.flash_attn_with_kvcache(q, k_cache, v_cache, **{name: value})
