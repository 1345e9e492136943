"""Decoding with a KV cache: ``attention_with_kvcache``, the public function.

The contract's "Decoding with a KV cache" section (docs/contract.md) defines the call. A few
query rows per sequence attend to a cache of keys and values, contiguous (B, S, Hk, D) or paged
(P, page_size, Hk, D) through a block table, after the new tokens (``k_new``, ``v_new``) are
written into it in place. It is an operation like attention: validated into a ``DecodeProblem``
(``flashx.validation.build_decode_problem``), planned (``flashx.plan.plan_decode``), executed by
``flashx.execute.run_decode`` through the chosen backend's ``decode``.

Shapes, dtypes and devices are always checked: they cost no device access. The values of
``cache_seqlens`` and ``block_table`` are checked on the host only with ``validate=True`` (one
small copy each), because a wrong one would make a kernel read or write outside the cache. With
``validate=False`` nothing reads a device value, so the call makes no host synchronization and
can be captured in a CUDA graph.
"""

from __future__ import annotations

from flashx import arrays, dispatch
from flashx.execute import run_decode
from flashx.plan import plan_decode
from flashx.validation import build_decode_problem


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None,
                           causal=True, window=None, softmax_scale=None, softcap=None, alibi_slopes=None, sinks=None,
                           mask=None, num_splits=0, validate=True, k_descale=None, v_descale=None, return_lse=False,
                           backend="auto"):
    """Attention of a few new query rows per sequence over a KV cache, after appending k_new, v_new.

    q (B, Nq, Hq, D); k_cache, v_cache (B, S, Hk, D|Dv), or (P, page_size, Hk, D|Dv) pages with
    ``block_table`` (B, max_pages); ``cache_seqlens`` (B,) tokens already cached. The new tokens
    (B, Nn, Hk, D|Dv) are written into the cache in place at positions cache_seqlens[b] onwards;
    ``cache_seqlens`` is not advanced. Returns o (B, Nq, Hq, Dv), and lse (B, Hq, Nq) with
    ``return_lse``. ``mask`` (broadcastable to (B, Hq, Nq, Nq)) applies to the last Nq keys: a
    speculative-decoding tree. ``softcap``, ``alibi_slopes`` ((Hq,) or (B, Hq)) and ``sinks``
    ((Hq,)) as in attention, query i of sequence b at key position Lk[b] - Nq + i; a split is
    computed without the sink, which joins each row once. ``num_splits``: parts of each
    sequence's keys computed in parallel (0: the backend chooses). ``validate=False``: no host
    synchronization (the caller promises valid lengths, tables and descales), capturable in a CUDA
    graph. A cache in float8_e4m3fn under bfloat16 or float16 queries holds each element as
    x8 * descale[b, h] (``k_descale``, ``v_descale`` (B, Hk) float32; None: 1); new tokens are
    quantized into it by those descales (the contract's FP8 section).
    """
    keywords = dict(cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new, block_table=block_table, causal=causal,
                    window=window, softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes,
                    sinks=sinks, mask=mask, num_splits=num_splits, validate=validate, k_descale=k_descale,
                    v_descale=v_descale)
    if arrays.traced(q):
        from flashx.ops import attention_with_kvcache as traced_call

        return traced_call(q, k_cache, v_cache, **keywords, return_lse=return_lse, backend=backend)
    problem, impl = plan_decode(q, k_cache, v_cache, backend, keywords)
    o, lse = run_decode(impl, problem, q, k_cache, v_cache, k_new, v_new)
    return (o, lse) if return_lse else o


def explain(q, k_cache, v_cache, *, return_lse=False, backend="auto", **keywords) -> dispatch.Explanation:
    """Which backend ``attention_with_kvcache`` would run for these arguments, and why not the others."""
    return dispatch.explain(build_decode_problem(q, k_cache, v_cache, **keywords), backend)
