"""Decoding with a KV cache (``flashx.attention_with_kvcache``) on the CuPy backend: the host side
of ``kernels/decode.cu``.

Up to three launches on the caller's stream: the new tokens into the cache, the splits, and (with
more than one split) their merge. Nothing reads a device value on the host, and the only
allocations are torch's (o, lse, the splits' partial results), so a call with ``validate=False``
can be captured in a CUDA graph.

A float8_e4m3fn cache (the contract's FP8 section) is the same three launches of the module's FP8
build (``Variant.fp8_cache``): the caches arrive as torch float8 tensors, read through their
addresses as bytes, and the (B, Hk) descales as float32 tensors or None, passed as addresses
(null: 1) that no host code reads, so that such a call is as capturable as any.

``num_splits=0`` takes the core's rule (``flashx.splits``, FA3's heuristic in units of CTAs),
with the variant's tiles and the CTAs an SM holds by their shared memory and threads
(``ctas_per_sm``). It is chosen from the cache's capacity (S, or max_pages x page_size), never from
the lengths, which only the device holds, so the choice is the same with and without ``validate``
and in a CUDA graph replayed with other lengths.
"""

from __future__ import annotations

import dataclasses

from flashx.splits import decode_splits
from flashx_cupy import variants
from flashx_cupy.launch import (DECODE_PARAMS, aligned, caller_stream, device_size, launch, record, row_stat_fields,
                                score_mod_fields, tiles)

#: Shared memory the driver keeps per CTA beside its dynamic shared memory.
RESERVED_SHARED_PER_CTA = 1024
MAX_THREADS_PER_SM = 2048


def decode(problem, q, k_cache, v_cache, k_new, v_new):
    """(o, lse) after the new tokens are written into the caches; o in q's dtype, lse float32."""
    import torch

    with caller_stream(problem, q) as (device, stream):
        o = torch.empty(problem.o_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=q.device)
        is_aligned = aligned(problem, q, k_cache, v_cache)
        bulk = variants.decode_bulk(is_aligned, device.compute_capability, problem.head_dim * k_cache.element_size())
        variant = variants.choose_decode("decode", problem, is_aligned, bulk)
        splits = count_splits(problem, variant, *device_size(device.id))
        fields = decode_fields(problem, q, k_cache, v_cache, k_new, v_new, o, lse)
        rows = problem.batch * problem.seqlen_q * problem.heads_q
        if splits > 1 and rows:
            o_part = torch.empty((splits, rows, variant.dim_v), dtype=torch.float32, device=q.device)
            lse_part = torch.empty((splits, rows), dtype=torch.float32, device=q.device)
            fields.update(o_part=o_part.data_ptr(), lse_part=lse_part.data_ptr())
        row_tiles = tiles(problem.seqlen_q * problem.group, variant.block_m)
        params = pack_decode(problem, splits=splits, tiles_m=row_tiles, **fields)
        same_build = {kernel: dataclasses.replace(variant, kernel=kernel) for kernel in variants.DECODE_KERNELS}
        launch(same_build["decode_append"], device, stream, problem.batch * problem.new_tokens, params)
        if rows:
            launch(variant, device, stream, problem.batch * problem.heads_k * row_tiles * splits, params)
            if splits > 1:
                launch(same_build["decode_merge"], device, stream, tiles(rows, variant.warps), params)
    return o, lse


def pack_decode(problem, **fields):
    """The ``DECODE_PARAMS`` record of a DecodeProblem: the band's sides with an unbounded one as a reach
    past every key (so that a kernel tests each side with one compare), the cache's geometry."""
    reach = problem.capacity + problem.seqlen_q
    assert reach < 2**29, "positions plus the band's reach must stay within int32"
    left, right = problem.band or (-1, -1)
    return record(problem, DECODE_PARAMS, dict(left=reach if left == -1 else left,
                                               right=reach if right == -1 else right, new_tokens=problem.new_tokens,
                                               page_size=problem.page_size or 0) | fields)


def decode_fields(problem, q, k_cache, v_cache, k_new, v_new, o, lse) -> dict:
    """The tensors' addresses and strides for ``pack_decode``. A cache's strides are (page or
    sequence, slot, head, dim)."""
    fields = score_mod_fields(problem)
    for name, x in (("q", q), ("k", k_cache), ("v", v_cache), ("o", o)):
        fields[name] = x.data_ptr()
        fields.update({f"{name}_{axis}": stride for axis, stride in zip("bnhd", x.stride())})
    fields.update(row_stat_fields("lse", lse, varlen=False))
    for name, x in (("kn", k_new), ("vn", v_new)):
        if x is not None:
            fields["k_new" if name == "kn" else "v_new"] = x.data_ptr()
            fields.update({f"{name}_{axis}": stride for axis, stride in zip("bnhd", x.stride())})
    fields["cache_seqlens"] = problem.cache_seqlens.data_ptr()  # int32, contiguous: the core's
    for name in ("k_descale", "v_descale"):  # float32 (B, Hk), contiguous: the core's; None stays null
        if getattr(problem, name) is not None:
            fields[name] = getattr(problem, name).data_ptr()
    if problem.paged:
        fields.update(block_table=problem.block_table.data_ptr(), table_b=problem.block_table.stride(0))
    if problem.mask is not None:
        mask = problem.mask.expand(*problem.lse_shape, problem.seqlen_q)
        fields.update(mask=mask.data_ptr(), **dict(zip(("mask_b", "mask_h", "mask_i", "mask_j"), mask.stride())))
    return fields


def count_splits(problem, variant, sm_count: int, shared_per_sm: int) -> int:
    """How many splits a call runs: ``flashx.splits.decode_splits`` with ``variant``'s tiles on a
    GPU of ``sm_count`` SMs of ``shared_per_sm`` bytes of shared memory."""
    return decode_splits(problem, sm_count=sm_count, block_n=variant.block_n, block_m=variant.block_m,
                         per_sm=ctas_per_sm(variant, shared_per_sm)).count


def ctas_per_sm(variant, shared_per_sm: int) -> int:
    """How many CTAs of the split kernel an SM holds by their shared memory and threads."""
    by_shared = shared_per_sm // (variant.shared_memory + RESERVED_SHARED_PER_CTA)
    return max(1, min(by_shared, MAX_THREADS_PER_SM // variant.threads))
