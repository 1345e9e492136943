"""Drop-in functions for code written against flash-attn 2 or PyTorch's SDPA, computed by flashx.

Each function has the signature, layout and semantics of the one it imitates (the contract's
Framework integration section), and goes through ``flashx.attention`` (or
``attention_with_kvcache``): differentiable, traced by ``torch.compile`` as flashx's operators,
and run by whichever backend ``backend="auto"`` picks. What flashx cannot compute exactly
(rotary embeddings inside the kernel, an additive bias, ...) raises ``UnsupportedError`` with
the reason; nothing is approximated or silently dropped.

Dropout draws its mask from the contract's Philox stream, seeded from torch's default generator:
the same distribution and scaling as flash-attn's and SDPA's, not the same bits.

- ``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``: flash-attn 2.6's
  (B, N, H, D) and packed (T, H, D) layouts, bottom-right causal, ``window_size`` with -1 for
  unbounded, ``softcap=0.0`` for none. ``return_attn_probs=True`` returns (out, lse, None): the
  softmax matrix, a testing aid in flash-attn, is never materialised here.
- ``scaled_dot_product_attention``: SDPA's (..., H, L, E) layout, its top-left ``is_causal``,
  ``scale``, ``enable_gqa``, a bool ``attn_mask`` (True = attend), and a float ``attn_mask`` where it
  is exactly 0 (attend) or -inf (masked): reading that takes one look at the mask's values on the
  host (a synchronisation on CUDA, and a graph break under ``torch.compile``); a bool mask takes none.
"""

from __future__ import annotations

import math

from flashx import arrays
from flashx.api import as_given, attention
from flashx.plan import call_key, prepared, remember
from flashx.errors import DTypeError, ShapeError, UnsupportedError


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's ``flash_attn_func``: q (B, Nq, Hq, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv) -> out (B, Nq, Hq, Dv).

    With ``return_attn_probs``: (out, softmax_lse (B, Hq, Nq), None).
    """
    o, lse = attention(q, k, v, return_lse=True, **_flash_keywords(dropout_p, softmax_scale, causal, window_size,
                                                                     softcap, alibi_slopes, deterministic))
    return (o, lse, None) if return_attn_probs else o


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's ``flash_attn_varlen_func``: packed q (Tq, Hq, D), k (Tk, Hk, D), v (Tk, Hk, Dv) with
    int32 ``cu_seqlens_q``/``cu_seqlens_k`` (B + 1,) -> out (Tq, Hq, Dv); lse (Hq, Tq) with ``return_attn_probs``.
    """
    if block_table is not None:
        raise UnsupportedError("block_table: flashx has no paged varlen layout; flash_attn_with_kvcache (flashx's "
                               "attention_with_kvcache) reads paged caches")
    o, lse = attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, return_lse=True,
                       **_flash_keywords(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                         deterministic))
    return (o, lse, None) if return_attn_probs else o


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's ``flash_attn_with_kvcache``: q (B, Nq, Hq, D) over a cache (B, S, Hk, D), or pages
    (P, page_size, Hk, D) with ``block_table``, after writing the new k, v (B, Nn, Hk, D) into it in place
    at ``cache_seqlens`` (an int, or (B,) int32; None: every sequence fills the cache).

    The lengths and the block table are checked on the host (flashx's ``validate=True``).
    """
    from flashx.kvcache import attention_with_kvcache

    declined = {
        "rotary_cos": (rotary_cos is not None, "rotary embedding is not applied inside flashx; rotate q and k first"),
        "rotary_sin": (rotary_sin is not None, "rotary embedding is not applied inside flashx; rotate q and k first"),
        "cache_batch_idx": (cache_batch_idx is not None, "flashx reads cache row b for sequence b"),
        "cache_leftpad": (cache_leftpad is not None, "flashx's caches start at slot 0"),
    }
    for name, (given, reason) in declined.items():
        if given:
            raise UnsupportedError(f"{name}: {reason}")
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        full = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        cache_seqlens = arrays.full(q, (q.shape[0],), full if cache_seqlens is None else cache_seqlens, "int32")
    return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k, v_new=v,
                                  block_table=block_table, causal=causal, window=_window(window_size),
                                  softmax_scale=softmax_scale, softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
                                  num_splits=num_splits, return_lse=return_softmax_lse)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``: query (..., Hq, L, E), key (..., Hk, S, E),
    value (..., Hk, S, Ev) -> (..., Hq, L, Ev), with ``is_causal`` aligned top-left as SDPA aligns it."""
    o = sdpa_as_flashx(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                       scale=scale, enable_gqa=enable_gqa)
    return o.transpose(-3, -2).reshape(*query.shape[:-3], o.shape[-2], o.shape[-3], o.shape[-1])


def sdpa_as_flashx(query, key, value, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, **keywords):
    """SDPA's call computed by ``flashx.attention``, the output left in flashx's layout (B, L, Hq, Ev).

    The leading dims of SDPA's (..., H, L, E) become flashx's batch. ``keywords`` go to
    ``flashx.attention`` as they are (transformers passes ``softcap`` this way).

    A call without a mask is remembered whole as ``flashx.attention`` remembers its own
    (``flashx.plan``), under its keywords and its tensors' metadata: a later call of the same
    runs the views this one made of its tensors and the function ``flashx.attention``
    remembered for them, none of the checks (a decoding step's layers repeat one call each).
    """
    backend = keywords.pop("backend", "auto")  # flashx.attention's own parameter, as its key holds it
    given = dict(keywords, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                 enable_gqa=enable_gqa)
    remembered = (call_key(query, key, value, backend, given, "sdpa_as_flashx")
                  if attn_mask is None and "return_lse" not in keywords and as_given(query, key, value) else None)
    run = None if remembered is None else prepared(remembered)
    if run is not None:
        return run(query, key, value)
    if arrays.kind_of(query) != "torch":
        raise DTypeError(f"query: expected a torch tensor (SDPA's interface), got {type(query).__name__}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise ShapeError(f"{name}: expected (..., H, L, E) with at least 3 dims, got shape {tuple(x.shape)}")
    shape_q, shape_k, shape_v = query.shape, key.shape, value.shape  # each read once: a tenth of a microsecond
    lead = shape_q[:-3]
    for name, shape in (("key", shape_k), ("value", shape_v)):
        if shape[:-3] != lead:
            raise UnsupportedError(f"{name}: flashx needs the leading (batch) dims of query {tuple(lead)}, "
                                   f"got shape {tuple(shape)}; SDPA would broadcast them")
    if shape_k[-3] != shape_q[-3] and not enable_gqa:
        raise ShapeError(f"key: expected {shape_q[-3]} heads like query (enable_gqa=False), "
                         f"got shape {tuple(shape_k)}")
    length_q, length_k = shape_q[-2], shape_k[-2]
    causal, window, keys = False, None, None
    if attn_mask is not None:
        if is_causal:
            raise ShapeError("attn_mask: expected None with is_causal=True (SDPA's rule), got a mask")
        attn_mask = _bool_mask(attn_mask, query.ndim, lead)
    elif is_causal:
        # SDPA aligns the causal diagonal top-left (j <= i); flashx bottom-right (j <= i + S - L).
        if length_k > length_q:  # keys past L are allowed to no query: drop them, the square is aligned alike
            keys = length_q
        if length_k >= length_q:
            causal = True
        else:  # the band j <= i, written in flashx's bottom-right terms
            window = (-1, length_q - length_k)
    views = _flashx_views(lead, keys, (query.ndim, key.ndim, value.ndim) == (4, 4, 4))
    q, k, v = views(query, key, value)
    options = dict(causal=causal, window=window, mask=attn_mask, softmax_scale=scale, dropout_p=dropout_p, **keywords)
    o = attention(q, k, v, backend=backend, **options)
    forward = None if remembered is None else prepared(call_key(q, k, v, backend, options))
    if forward is not None:  # flashx.attention remembered the call: so is this one, once it has returned
        remember(remembered, lambda query, key, value: forward(*views(query, key, value))[0])
    return o


def _flashx_views(lead, keys, four_dims: bool):
    """The function that makes flashx's (B, L, H, E) views of SDPA's query, key and value: the
    leading dims ``lead`` merged into B, keys past ``keys`` dropped (None: none). The tensors of
    four dims are transposed alone (a view costs a call a microsecond of host time)."""
    if four_dims and keys is None:
        return lambda query, key, value: (query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))

    def views(query, key, value):
        if keys is not None:
            key, value = key[..., :keys, :], value[..., :keys, :]
        return tuple(_batch_leading(x, lead).transpose(1, 2) for x in (query, key, value))

    return views


def _batch_leading(x, lead):
    """(..., H, L, E) as (B, H, L, E), the leading dims ``lead`` merged into B: ``x`` itself when
    it has four dims, and B given, not -1, so that an empty tensor has one."""
    return x if x.ndim == 4 else x.reshape(math.prod(lead), *x.shape[-3:])


def _flash_keywords(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic) -> dict:
    """flash-attn 2's keywords as flashx.attention's."""
    return dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window=_window(window_size),
                softcap=_softcap(softcap), alibi_slopes=alibi_slopes, deterministic=deterministic)


def _softcap(softcap):
    """flash-attn's softcap=0.0 means no softcap; flashx's None does."""
    return None if softcap == 0 else softcap


def _window(window_size):
    """flash-attn's (-1, -1) means no window; flashx's None does."""
    return None if tuple(window_size) == (-1, -1) else tuple(window_size)


def _bool_mask(mask, ndim: int, lead):
    """SDPA's attn_mask as flashx's bool mask, its leading dims merged as the batch is."""
    import torch

    if mask.dtype != torch.bool:
        if not mask.is_floating_point():
            raise DTypeError(f"attn_mask: expected a bool or float mask, got dtype {mask.dtype}")
        allowed = mask == 0
        if not bool((allowed | (mask == -math.inf)).all()):
            raise UnsupportedError("attn_mask: a float mask holding values other than 0 and -inf is an additive bias, "
                                   "which flashx does not add to the scores; only a 0/-inf mask (or a bool one) is served")
        mask = allowed
    if mask.ndim > ndim:
        raise ShapeError(f"attn_mask: expected at most {ndim} dims (broadcastable to query's scores), "
                         f"got shape {tuple(mask.shape)}")
    if len(lead) > 1:
        mask = mask.reshape((1,) * (ndim - mask.ndim) + tuple(mask.shape))
        mask = _batch_leading(mask.expand(*lead, *mask.shape[-3:]), lead)
    return mask
