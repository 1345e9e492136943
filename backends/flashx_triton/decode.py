"""Decoding with a KV cache on the GPU: split-KV attention (FlashDecoding) over contiguous or paged caches.

Up to three launches on the caller's stream, none of which reads a device value on the host (so a
call with ``validate=False`` can be captured in a CUDA graph):

1. ``_append_kernel``, with new tokens only: one program per new token writes its keys and values
   into their slot of the cache, found through the block table when the cache is paged.
2. ``_split_kernel``: one program per (sequence, kv head, row tile, split). A row tile holds the
   query rows of every query head that reads the kv head (Nq x group rows, query-major, padded
   to at least 16 for the tensor cores), so each split's keys and values are read from memory
   once for the whole GQA group. The program folds its split's key tiles into an online softmax
   in base 2: tiles that every row of the tile may use in full run without a compare, and only
   the edge tiles of the band and the tiles over the tree mask's last Nq keys are masked, where a
   NaN or inf stored at a disallowed pair never reaches a product (``masked_dot``). Keys outside
   the rows' band and past the sequence are never loaded, so stale slots and unused pages are
   never read. In a paged cache a key tile whose rows lie in one page (page_size a multiple of
   the tile) costs one block-table read; otherwise each row is found through the table.
3. ``_merge_kernel``, with more than one split: each (sequence, query row, head) combines the
   splits' normalised outputs and LSEs as "Merging partial results" says, an empty split (LSE
   -inf) weighing exactly 0. With one split the split kernel writes o and lse itself.

On sm_90 the launches are programmatic dependent ones (``programmatic``): each may start while
the one before it ends, and waits for it before reading anything.

An FP8 cache (float8_e4m3fn, the contract's FP8 section) is read as the queries' 16-bit dtype,
which holds its values exactly; k_descale joins the scores' scale and v_descale o's factor, per
program, and new tokens are quantized into it by the append (``flashx_triton.fp8.quantized_e4m3``).

The score modifications are the prefill kernels' own (``flashx_triton.score_mods``): softcap and
ALiBi modify each tile's scores, ALiBi's distance measured from each row's position Lk - Nq + i
whatever split holds the key. A split is computed without the sink, which joins each row once, in
the merge's logsumexp (``with_sink``), or, with one split, after the split's last tile
(``_outputs``, which both kernels end with): an empty split adds nothing, the sink included.

A split covers a fixed share of the key tiles its rows may see, computed on the device from the
sequence's length, so a fixed ``num_splits`` gives bitwise the same result on every call.
``num_splits=0`` takes the core's rule (``flashx.splits``, FA3's heuristic in units of programs),
with this kernel's tiles and the programs an SM holds (``programs_per_sm``): by shared memory,
and at most ``PROGRAMS_PER_SM``. On an H200, 32 splits of 8 kv heads (256 programs, two an SM)
read faster than 16 (one an SM) at B=1, L=16k and 128k, and 2 than 1 at B=16, L=8k
(benchmarks/results/decode-h200.md); more an SM were not timed. The count is chosen from the
cache's capacity, never from the lengths, which only the device holds, and so it is the same with
and without ``validate`` and in a CUDA graph replayed with other lengths.

Tiles (``config``), chosen on the H100 with the split count of one program an SM that preceded the
core's rule: a contiguous cache takes 64 keys, 4 warps and 3 stages, whose 64 KB in flight kept one
program per SM at the copy bandwidth (32-key tiles needed two programs per SM, so twice the splits,
and ran slower). A paged cache takes the same tiles, its pages read a tile ahead (``_tile_pages``):
with each tile's addresses waiting on a table read of its own, Triton's pipeline did not overlap
the copies (no tile passed 0.81x the contiguous cache's rate on an H200 at B=16, L=8k). Read a
tile ahead, 64 keys and two programs an SM hold 0.95-0.96x (pages of 16) and 0.98-0.99x (pages of
256) of it from B·L = 64k tokens (B=4, L=16k; B=16, L=4k and 8k; B=64, L=4k), where 128 keys of 3
stages, one program an SM and so half the splits, held 0.76-0.84x and 0.85-0.94x.

An FP8 cache of up to 32 rows, contiguous or paged, takes 64 keys, 4 warps and 5 stages: two
programs an SM (88 KB of shared memory and 223 registers at d128 for sm_90, no spills), each with
five 8 KB tiles in flight. On an H200 (Hq 32, Hk 8, d128, CUDA-graph replays) it read 1.84 (B=1,
L=32k), 2.16 (B=4, L=16k), 2.38 (B=16, L=8k) and 2.47 TB/s (B=64, L=4k) of FP8 cache, 1.12-1.14x the
bfloat16 cache's tokens a second, where the earlier 128 keys, 8 warps and 4 stages (one program an
SM: 139 KB and 215 registers) read 1.60-1.97 TB/s; 32-key tiles of 6 stages read 1.48-1.90, and 128
keys under 4 warps spilled. Paged, those tiles hold 0.89-0.91x (pages of 16) and 0.95-0.98x (pages
of 256) of the contiguous FP8 rate from B·L = 64k tokens, where 128 keys under 8 warps and 3 stages
held 0.72-0.79x and 0.77-0.86x. More rows keep 8 warps sharing each tile's widening: 64 keys and 4
stages (3 paged), compiled without spilling, where 4 warps of 64 rows spill; not timed on a GPU.
Widening, not memory, bounds an FP8 cache's tiles: V is widened in the layout it is loaded in
(features contiguous) and reaches its product with P through shared memory as 16-bit values, read by
ldmatrix.trans, since the tensor-core operand wants V's keys in pairs where the cache holds features
together, and widened in that operand's layout its bytes are read from shared memory one at a time.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashx.splits import decode_splits
from flashx_triton.arguments import dot_precision, tile_widths
from flashx_triton.fp8 import cache_values, descale_factors, fp8_mode, quantized_e4m3
from flashx_triton.launch import Launch, layout
from flashx_triton.products import dot, masked_dot
from flashx_triton.score_mods import (LOG2E, ROW_MAX_START, descaled_scores, modified_scores, score_mod_args,
                                      score_rule, with_sink)

PROGRAMS_PER_SM = 2  # the most split programs an SM is counted to hold (the module docstring says why)
RESERVED_SHARED = 1024  # shared memory the driver keeps per program beside the kernel's
INTERPRETED_SMS = 4  # the stand-in SM count under TRITON_INTERPRET, so that tiny problems split too
_LIMIT = 256  # launches remembered; past it the memory starts again empty
LN2 = tl.constexpr(0.6931471805599453)  # base-2 logarithms to natural ones


@triton.jit
def _tile_pages(TABLE_ROW, stride_tj, t, t_hi, lo, hi, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr):
    """The pages of key tile ``t``, int64: one where a page holds whole tiles, one a key otherwise
    (0 for a contiguous cache). Read a tile ahead of their use, so that a tile's copies wait on no
    table read of their own. Past the last tile (``t_hi`` - 1) the last tile's are read again,
    since the table's entries past the sequence may hold anything, and under MASKED only the
    entries of keys in [lo, hi)."""
    if PAGE_SIZE == 0:
        return 0
    else:
        tile = tl.maximum(tl.minimum(t, t_hi - 1), 0)
        if PAGE_SIZE % BLOCK_N == 0:
            return tl.load(TABLE_ROW + (tile * BLOCK_N // PAGE_SIZE) * stride_tj).to(tl.int64)
        else:
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            if MASKED:
                pages = tl.load(TABLE_ROW + (cols // PAGE_SIZE) * stride_tj, mask=(cols >= lo) & (cols < hi), other=0)
            else:
                pages = tl.load(TABLE_ROW + (cols // PAGE_SIZE) * stride_tj)
            return pages.to(tl.int64)


@triton.jit
def _slot_rows(pages, start, cols, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(page, slot) of the keys ``cols`` (a tile starting at ``start``, whose ``_tile_pages`` are
    ``pages``), int64: a contiguous cache's sequence is page 0 of its own base pointer."""
    if PAGE_SIZE == 0:
        return 0, cols.to(tl.int64)
    elif PAGE_SIZE % BLOCK_N == 0:
        return pages, (start % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
    else:
        return pages, (cols % PAGE_SIZE).to(tl.int64)


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, K_HEAD, V_HEAD, TABLE_ROW, mask_rows, t_lo, t_hi, lo, hi, diag, i, valid, left,
                  right, scale_log2, rule, stride_tj, stride_kp, stride_ks, stride_kd, stride_vp, stride_vs,
                  stride_vd, stride_mj, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_MASK: tl.constexpr,
                  MASKED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, FAST_TANH: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, FP8: tl.constexpr):
    """Fold key tiles [t_lo, t_hi) into the running (acc, m_i, l_i). MASKED tiles load only the keys
    in [lo, hi) and test every pair; the others lie wholly inside every valid row's band. Scores
    are modified by ``rule`` (``score_rule``) under SOFTCAP and ALIBI. An FP8 cache's tiles are
    read as q's dtype, which holds every e4m3 value (``cache_values``)."""
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    pages = _tile_pages(TABLE_ROW, stride_tj, t_lo, t_hi, lo, hi, PAGE_SIZE, BLOCK_N, MASKED)
    for t in range(t_lo, t_hi):
        start = t * BLOCK_N
        cols = start + tl.arange(0, BLOCK_N)
        used = (cols >= lo) & (cols < hi)
        page, slot = _slot_rows(pages, start, cols, PAGE_SIZE, BLOCK_N)
        pages = _tile_pages(TABLE_ROW, stride_tj, t + 1, t_hi, lo, hi, PAGE_SIZE, BLOCK_N, MASKED)
        k_ptrs = K_HEAD + (page * stride_kp + slot * stride_ks)[:, None] + dims[None, :] * stride_kd
        v_ptrs = V_HEAD + (page * stride_vp + slot * stride_vs)[:, None] + dims_v[None, :] * stride_vd
        if MASKED:
            k = cache_values(tl.load(k_ptrs, mask=used[:, None] & (dims[None, :] < HEAD_DIM), other=0.0), q.dtype, FP8,
                             False)
            v = cache_values(tl.load(v_ptrs, mask=used[:, None] & (dims_v[None, :] < HEAD_DIM_V), other=0.0), q.dtype,
                             FP8, True)
            position = diag + i  # each row's query position among the keys
            ok = (valid[:, None] & used[None, :] & (cols[None, :] >= position[:, None] - left)
                  & (cols[None, :] <= position[:, None] + right))
            if HAS_MASK:
                column = cols - diag  # the tree mask's column: >= 0 over the last Nq keys
                tree = column >= 0
                allowed = tl.load(mask_rows[:, None] + column[None, :] * stride_mj, mask=ok & tree[None, :], other=0)
                ok &= ~tree[None, :] | (allowed != 0)
            s, _ = modified_scores(dot(q, tl.trans(k), None, DOT_PRECISION), i[:, None], cols[None, :], scale_log2,
                                   rule, SOFTCAP, ALIBI, FAST_TANH)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # never -inf: ROW_MAX_START
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = masked_dot(p.to(v.dtype), v, ok, acc * alpha[:, None], True, DOT_PRECISION)
        else:
            k = cache_values(tl.load(k_ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0), q.dtype, FP8, False)
            v = cache_values(tl.load(v_ptrs, mask=dims_v[None, :] < HEAD_DIM_V, other=0.0), q.dtype, FP8, True)
            s, _ = modified_scores(dot(q, tl.trans(k), None, DOT_PRECISION), i[:, None], cols[None, :], scale_log2,
                                   rule, SOFTCAP, ALIBI, FAST_TANH)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _outputs(m, l, SINKS, h, HAS_SINKS: tl.constexpr):
    """(the factor that turns a row's accumulator into o, its lse in natural log) from its running
    max ``m`` and sum ``l`` in base 2, with the sink's column of query head ``h`` joined once under
    HAS_SINKS. l = 0 only where no key was allowed or every allowed score is -inf (a row's maximum
    contributes 1 otherwise): o = 0 there, and lse = the sink, or -inf. NaN rows stay NaN."""
    empty = l == 0.0
    if HAS_SINKS:
        sink = tl.load(SINKS + h)
        m, l, alpha = with_sink(m, l, sink * LOG2E)
        no_key = sink
    else:
        alpha = 1.0
        no_key = float("-inf")
    l_safe = tl.where(empty, 1.0, l)
    return tl.where(empty, 0.0, alpha / l_safe), tl.where(empty, no_key, (m + tl.log2(l_safe)) * LN2)


@triton.jit(do_not_specialize=["keys", "left", "right", "num_splits"])
def _split_kernel(
    Q, K, V, SEQLENS, TABLE, MASK, SLOPES, SINKS, K_DESCALE, V_DESCALE, O, LSE,
    stride_qb, stride_qn, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd, stride_tb, stride_tj, stride_mb, stride_mh, stride_mi, stride_mj,
    stride_os, stride_ob, stride_on, stride_oh, stride_od, stride_ls, stride_lb, stride_lh, stride_ln,
    heads_k, seqlen_q, group, new_tokens, keys, left, right, scale_log2, num_splits, mods,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    """One split of one (sequence, kv head, row tile): its normalised o and its lse (natural log),
    into O and LSE at index ``split`` of their leading axis (stride 0 without splits). HAS_SINKS
    only where the split is the only one: then its rows are whole and take the sink. An FP8
    cache's k_descale joins the scale of the scores, its v_descale o's factor. Under PDL
    (``programmatic``) it reads nothing before the launch before it is done, and lets the merge
    launch once its keys are read. Without SEQLENS every sequence holds ``keys`` keys: attention
    as decoding (``attention_as_decoding``)."""
    if PDL:
        gdc_wait()
    rows_total = seqlen_q * group
    row_tiles = tl.cdiv(rows_total, BLOCK_M)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    row_tile = tile % row_tiles
    kv_head = (tile // row_tiles) % heads_k
    b = tile // (row_tiles * heads_k)
    b64 = b.to(tl.int64)

    r = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = r < rows_total
    i = r // group  # query row
    h = kv_head * group + r % group  # query head
    if SEQLENS is None:
        length = keys
    else:
        length = tl.load(SEQLENS + b) + new_tokens  # Lk of this sequence
    diag = length - seqlen_q  # query i sits at key position diag + i
    first_i = row_tile * BLOCK_M // group
    last_i = (tl.minimum(row_tile * BLOCK_M + BLOCK_M, rows_total) - 1) // group
    # Keys [lo, hi) are seen by some valid row; [full_lo, full_hi) by every one, in full.
    lo = tl.maximum(diag + first_i - left, 0)
    hi = tl.maximum(tl.minimum(diag + last_i + right + 1, length), lo)
    full_lo = tl.maximum(diag + last_i - left, 0)
    full_hi = tl.minimum(diag + first_i + right + 1, length)
    if HAS_MASK:
        full_hi = tl.minimum(full_hi, diag)  # the tree mask's keys are tested pair by pair
    t_lo = lo // BLOCK_N
    t_hi = tl.where(hi > lo, tl.cdiv(hi, BLOCK_N), t_lo)
    per_split = tl.cdiv(t_hi - t_lo, num_splits)
    s_lo = tl.minimum(t_lo + split * per_split, t_hi)
    s_hi = tl.minimum(s_lo + per_split, t_hi)
    f_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), s_lo), s_hi)
    f_hi = tl.minimum(tl.maximum(full_hi // BLOCK_N, f_lo), s_hi)

    dims = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b64 * stride_qb + (i * stride_qn + h * stride_qh).to(tl.int64)[:, None] + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    if PAGE_SIZE == 0:
        K_HEAD = K + b64 * stride_kp + kv_head.to(tl.int64) * stride_kh
        V_HEAD = V + b64 * stride_vp + kv_head.to(tl.int64) * stride_vh
        TABLE_ROW = TABLE
    else:
        K_HEAD = K + kv_head.to(tl.int64) * stride_kh
        V_HEAD = V + kv_head.to(tl.int64) * stride_vh
        TABLE_ROW = TABLE + b64 * stride_tb
    mask_rows = MASK + b64 * stride_mb + (h * stride_mh + i * stride_mi).to(tl.int64) if HAS_MASK else 0
    rule = score_rule(SLOPES, b, h[:, None], seqlen_q, length, mods, ALIBI)  # slopes per row: rows mix heads
    if FP8 != "":
        score_factor, out_factor = descale_factors(None, K_DESCALE, V_DESCALE, b * heads_k + kv_head)
        scale_log2, rule = descaled_scores(scale_log2, rule, score_factor)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], ROW_MAX_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for part in tl.static_range(3):  # masked tiles, full tiles, masked tiles: in key order
        if part == 0:
            a, z = s_lo, f_lo
        elif part == 1:
            a, z = f_lo, f_hi
        else:
            a, z = f_hi, s_hi
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, K_HEAD, V_HEAD, TABLE_ROW, mask_rows, a, z, lo, hi, diag, i,
                                      valid, left, right, scale_log2, rule, stride_tj, stride_kp, stride_ks,
                                      stride_kd, stride_vp, stride_vs, stride_vd, stride_mj, HEAD_DIM, HEAD_DIM_V,
                                      BLOCK_D, BLOCK_DV, BLOCK_N, PAGE_SIZE, HAS_MASK, part != 1, SOFTCAP, ALIBI,
                                      FAST_TANH, DOT_PRECISION, FP8)
    if PDL:
        gdc_launch_dependents()

    factor, lse = _outputs(m_i, l_i, SINKS, h, HAS_SINKS)
    if FP8 != "":
        factor *= out_factor
    o = acc * factor[:, None]
    dims_v = tl.arange(0, BLOCK_DV)
    rows_out = split.to(tl.int64) * stride_os + b64 * stride_ob + (i * stride_on + h * stride_oh).to(tl.int64)
    tl.store(O + rows_out[:, None] + dims_v[None, :] * stride_od, o.to(O.dtype.element_ty),
             mask=valid[:, None] & (dims_v[None, :] < HEAD_DIM_V))
    tl.store(LSE + split.to(tl.int64) * stride_ls + b64 * stride_lb + (h * stride_lh + i * stride_ln).to(tl.int64), lse, mask=valid)


@triton.jit
def _merge_kernel(
    O_PART, LSE_PART, SINKS, O, LSE,
    stride_ps, stride_pb, stride_pn, stride_ph, stride_pd, stride_qs, stride_qb, stride_qh, stride_qn,
    stride_ob, stride_on, stride_oh, stride_od, stride_lb, stride_lh, stride_ln,
    heads_q, seqlen_q, num_splits,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    """One (sequence, query row, head): lse = logsumexp of the splits' lse (and of the sink under
    HAS_SINKS), o = their outputs weighted by exp(lse_split - lse). Splits with lse -inf weigh
    exactly 0; NaN propagates. In base 2, as the split kernel's running sums."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    h = pid % heads_q
    i = (pid // heads_q) % seqlen_q
    b = (pid // (heads_q * seqlen_q)).to(tl.int64)
    lse_row = LSE_PART + b * stride_qb + h * stride_qh + i * stride_qn
    splits = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_row + splits * stride_qs, mask=splits < num_splits, other=float("-inf")) * LOG2E
    m = tl.max(lse, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m_ref), 0)
    dims = tl.arange(0, BLOCK_DV)
    o_row = O_PART + b * stride_pb + i * stride_pn + h * stride_ph
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for first in range(0, num_splits, CHUNK):
        chunk = first + tl.arange(0, CHUNK)
        inside = chunk < num_splits
        weight = tl.exp2(tl.load(lse_row + chunk * stride_qs, mask=inside, other=float("-inf")) * LOG2E - m_ref)
        part = tl.load(o_row + chunk[:, None].to(tl.int64) * stride_ps + dims[None, :] * stride_pd,
                       mask=inside[:, None] & (dims[None, :] < HEAD_DIM_V), other=0.0)
        acc += tl.sum(tl.where(weight[:, None] == 0.0, 0.0, weight[:, None] * part), 0)
    factor, lse_out = _outputs(m, total, SINKS, h, HAS_SINKS)
    tl.store(O + b * stride_ob + i * stride_on + h * stride_oh + dims * stride_od, (acc * factor).to(O.dtype.element_ty),
             mask=dims < HEAD_DIM_V)
    tl.store(LSE + b * stride_lb + h * stride_lh + i * stride_ln, lse_out)


@triton.jit
def _copy_token(SOURCE, stride_sh, stride_sd, TARGET, stride_th, stride_td, heads, DESCALE, WIDTH: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, FP8: tl.constexpr):
    """One token's (heads, WIDTH) rows from SOURCE to TARGET; into an FP8 cache quantized by the
    contract's rule: the float32 quotient by the row's head's descale (``DESCALE``, None: 1),
    correctly rounded, then rounded to e4m3 (``quantized_e4m3``)."""
    rows = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_W)[None, :]
    inside = (rows < heads) & (cols < WIDTH)
    x = tl.load(SOURCE + rows * stride_sh + cols * stride_sd, mask=inside)
    if FP8 != "":
        x = x.to(tl.float32)
        if DESCALE is not None:
            x = tl.div_rn(x, tl.load(DESCALE + rows, mask=rows < heads, other=1.0))
        x = quantized_e4m3(x, FP8 == "emulated")
    tl.store(TARGET + rows * stride_th + cols * stride_td, x, mask=inside)


@triton.jit
def _append_kernel(
    K_NEW, V_NEW, K, V, SEQLENS, TABLE, K_DESCALE, V_DESCALE,
    stride_nb, stride_nn, stride_nh, stride_nd, stride_wb, stride_wn, stride_wh, stride_wd,
    stride_kp, stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd, stride_tb, stride_tj,
    heads_k, new_tokens,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    """New token t of sequence b into its cache slot, at position cache_seqlens[b] + t; an FP8
    cache's by its (B, Hk) descales (None: 1)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()  # the split kernel waits for all of this one anyway
    pid = tl.program_id(0)
    b = (pid // new_tokens).to(tl.int64)
    t = pid % new_tokens
    position = tl.load(SEQLENS + b).to(tl.int64) + t
    if PAGE_SIZE == 0:
        page, slot = b, position
    else:
        page = tl.load(TABLE + b * stride_tb + (position // PAGE_SIZE) * stride_tj).to(tl.int64)
        slot = position % PAGE_SIZE
    k_descale = K_DESCALE + b * heads_k if K_DESCALE is not None else None
    v_descale = V_DESCALE + b * heads_k if V_DESCALE is not None else None
    _copy_token(K_NEW + b * stride_nb + t * stride_nn, stride_nh, stride_nd, K + page * stride_kp + slot * stride_ks,
                stride_kh, stride_kd, heads_k, k_descale, HEAD_DIM, BLOCK_H, BLOCK_D, FP8)
    _copy_token(V_NEW + b * stride_wb + t * stride_wn, stride_wh, stride_wd, V + page * stride_vp + slot * stride_vs,
                stride_vh, stride_vd, heads_k, v_descale, HEAD_DIM_V, BLOCK_H, BLOCK_DV, FP8)


#: The longest query an attention call may have to run as decoding (``attention_as_decoding``).
SHORT_QUERY = 16


def attention_as_decoding(problem):
    """The attention ``problem`` as decoding (``Problem.as_decode``) where this backend computes it
    so, else None: a query of at most SHORT_QUERY rows whose rows of each kv head fill one row
    tile (Nq x group <= 64), the shape of a decoding step that reaches ``flashx.attention`` (a
    transformers ``generate()`` step). The forward kernel would run one program per query head over
    all its keys, reading each kv head's keys once per query head and leaving most SMs idle; the
    split kernel reads them once per GQA group, in as many splits as fill the GPU."""
    if problem.seqlen_q > SHORT_QUERY or problem.seqlen_q * problem.group > 64:
        return None
    return problem.as_decode()


def config(problem) -> dict:
    """The split kernel's tiles, warps and pipeline depth for this problem (see the module docstring)."""
    rows = problem.seqlen_q * problem.group
    block_m = min(64, max(16, triton.next_power_of_2(max(rows, 1))))
    if _interpreting():
        return dict(BLOCK_M=block_m, BLOCK_N=16, num_warps=1, num_stages=1)
    if max(problem.head_dim, problem.head_dim_v) > 128 or problem.dtype == "float32":
        return dict(BLOCK_M=block_m, BLOCK_N=32, num_warps=4, num_stages=2)
    if problem.fp8 and block_m <= 32:
        return dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=4, num_stages=5)
    if problem.fp8:
        return dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=8, num_stages=3 if problem.paged else 4)
    return dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=4, num_stages=3)


def splits(problem, device: torch.device) -> int:
    """How many splits a call runs: ``flashx.splits.decode_splits`` with this kernel's tiles
    (``config``) on ``device``."""
    tiles = config(problem)
    sm_count, shared_memory = _device_size(device)
    return decode_splits(problem, sm_count=sm_count, block_n=tiles["BLOCK_N"], block_m=tiles["BLOCK_M"],
                         per_sm=programs_per_sm(problem, tiles, shared_memory)).count


def programs_per_sm(problem, tiles: dict, shared_memory: int) -> int:
    """The split programs an SM of ``shared_memory`` bytes is counted to hold: at least 1, at most
    ``PROGRAMS_PER_SM``, by an estimate of a program's shared memory made before it compiles (the
    count sizes its grid). The estimate errs high, so that an SM is never counted to hold more
    programs than it does: the K and V tiles of the pipeline's stages but one (as Triton's
    pipeliner allocates them), an FP8 cache's 16-bit V tile, the query tile, and the rows' scores
    and features in float32. ``tests/test_lowering_sm90.py`` holds the count to at most what the
    compiled kernels' own shared memory gives for sm_90 (at d128, bf16 queries: 70 KB over a 16-bit
    cache, paged or not, and 88 KB over an FP8 cache of up to 32 rows; two an SM)."""
    widths = tile_widths(problem.head_dim, problem.head_dim_v)
    size = 1 if problem.fp8 else 4 if problem.dtype == "float32" else 2
    staged = (tiles["num_stages"] - 1) * tiles["BLOCK_N"] * (widths["BLOCK_D"] + widths["BLOCK_DV"]) * size
    widened = tiles["BLOCK_N"] * widths["BLOCK_DV"] * 2 if problem.fp8 else 0
    query = tiles["BLOCK_M"] * widths["BLOCK_D"] * (4 if problem.dtype == "float32" else 2)
    rows = tiles["BLOCK_M"] * (widths["BLOCK_D"] + tiles["BLOCK_N"]) * 4
    return max(1, min(PROGRAMS_PER_SM, shared_memory // (staged + widened + query + rows + RESERVED_SHARED)))


def decode(problem, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new, v_new):
    """(o, lse) after the new tokens are written into the caches; o in q's dtype, lse float32."""
    seqlens, table = problem.cache_seqlens, problem.block_table
    descales = (problem.k_descale, problem.v_descale)  # an FP8 cache's (None: 1)
    if problem.new_tokens and problem.batch:
        _launch("append", problem, (k_new, v_new, k_cache, v_cache, seqlens, table, *descales))
    o = torch.empty(problem.o_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=q.device)
    if problem.batch * problem.seqlen_q * problem.heads_q == 0:
        return o, lse
    count = _split_count(problem, q.device)
    mask = None if problem.mask is None else problem.mask.expand(*problem.lse_shape, problem.seqlen_q)
    reads = (q, k_cache, v_cache, seqlens, table, mask, problem.alibi_slopes, problem.sinks, *descales)
    if count == 1:
        _launch("split", problem, (*reads, o[None], lse[None]), count)
        return o, lse
    o_part = torch.empty((count, *problem.o_shape), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((count, *problem.lse_shape), dtype=torch.float32, device=q.device)
    _launch("split", problem, (*reads, o_part, lse_part), count)
    _launch("merge", problem, (o_part, lse_part, problem.sinks, o, lse), count)
    return o, lse


def _launch(kernel: str, problem, tensors: tuple, count: int = 1) -> None:
    """``kernel`` on ``tensors``, through a ``Launch`` kept per static problem, layout and split count."""
    key = (kernel, problem.static_key, layout(*tensors), count)
    launch = _launches.get(key)
    if launch is None:
        if len(_launches) >= _LIMIT:
            _launches.clear()
        launch = _launches[key] = _BUILD[kernel](problem, tensors, count)
    launch(*tensors)


_launches: dict[tuple, Launch] = {}


def _split_count(problem, device: torch.device) -> int:
    """``splits`` of the call's static problem, remembered as its launches are: a decoding loop
    asks for it at every step, and its answer depends on no length."""
    key = (problem.static_key, device)
    count = _split_counts.get(key)
    if count is None:
        if len(_split_counts) >= _LIMIT:
            _split_counts.clear()
        count = _split_counts[key] = splits(problem, device)
    return count


_split_counts: dict[tuple, int] = {}


def _strides(x, count: int) -> tuple:
    return tuple(x.stride()) if x is not None else (0,) * count


def _build_split(problem, tensors, count) -> Launch:
    q, k_cache, v_cache, _, table, mask, _, _, _, _, o, lse = tensors
    tiles = config(problem)
    left, right = problem.band or (-1, -1)
    unbounded = problem.capacity + problem.seqlen_q  # a reach past every key: one compare serves both sides
    bound = dict(zip(
        ("stride_qb", "stride_qn", "stride_qh", "stride_qd", "stride_kp", "stride_ks", "stride_kh", "stride_kd",
         "stride_vp", "stride_vs", "stride_vh", "stride_vd", "stride_tb", "stride_tj", "stride_mb", "stride_mh",
         "stride_mi", "stride_mj", "stride_os", "stride_ob", "stride_on", "stride_oh", "stride_od", "stride_ls",
         "stride_lb", "stride_lh", "stride_ln"),
        (*q.stride(), *k_cache.stride(), *v_cache.stride(), *_strides(table, 2), *_strides(mask, 4),
         0 if count == 1 else o.stride(0), *o.stride()[1:], 0 if count == 1 else lse.stride(0), *lse.stride()[1:]),
    ))
    grid = (problem.batch * problem.heads_k * _row_tiles(problem, tiles), count)
    mods = score_mod_args(problem, problem.softmax_scale)
    mods["HAS_SINKS"] &= count == 1  # with splits, the merge joins the sink
    return Launch(_split_kernel, grid, _options(problem, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"]),
                  **bound, **mods,
                  heads_k=problem.heads_k, seqlen_q=problem.seqlen_q, group=problem.group,
                  new_tokens=problem.new_tokens, keys=problem.capacity, left=unbounded if left == -1 else left,
                  right=unbounded if right == -1 else right, scale_log2=problem.scale_log2,
                  num_splits=count, HEAD_DIM=problem.head_dim, HEAD_DIM_V=problem.head_dim_v,
                  **tile_widths(problem.head_dim, problem.head_dim_v), BLOCK_M=tiles["BLOCK_M"],
                  BLOCK_N=tiles["BLOCK_N"], PAGE_SIZE=problem.page_size or 0, HAS_MASK=mask is not None,
                  DOT_PRECISION=dot_precision(problem.dtype), FP8=fp8_mode(problem.fp8), PDL=programmatic(problem))


def _build_merge(problem, tensors, count) -> Launch:
    o_part, lse_part, _, o, lse = tensors
    block_s = triton.next_power_of_2(count)
    bound = dict(zip(
        ("stride_ps", "stride_pb", "stride_pn", "stride_ph", "stride_pd", "stride_qs", "stride_qb", "stride_qh",
         "stride_qn", "stride_ob", "stride_on", "stride_oh", "stride_od", "stride_lb", "stride_lh", "stride_ln"),
        (*o_part.stride(), *lse_part.stride(), *o.stride(), *lse.stride()),
    ))
    grid = (problem.batch * problem.seqlen_q * problem.heads_q,)
    return Launch(_merge_kernel, grid, _options(problem, num_warps=4 if not _interpreting() else 1), **bound,
                  heads_q=problem.heads_q, seqlen_q=problem.seqlen_q, num_splits=count,
                  HEAD_DIM_V=problem.head_dim_v, BLOCK_DV=tile_widths(problem.head_dim, problem.head_dim_v)["BLOCK_DV"],
                  BLOCK_S=block_s, CHUNK=min(block_s, 32), HAS_SINKS=problem.sinks is not None,
                  PDL=programmatic(problem))


def _build_append(problem, tensors, count) -> Launch:
    k_new, v_new, k_cache, v_cache, _, table, _, _ = tensors
    bound = dict(zip(
        ("stride_nb", "stride_nn", "stride_nh", "stride_nd", "stride_wb", "stride_wn", "stride_wh", "stride_wd",
         "stride_kp", "stride_ks", "stride_kh", "stride_kd", "stride_vp", "stride_vs", "stride_vh", "stride_vd",
         "stride_tb", "stride_tj"),
        (*k_new.stride(), *v_new.stride(), *k_cache.stride(), *v_cache.stride(), *_strides(table, 2)),
    ))
    return Launch(_append_kernel, (problem.batch * problem.new_tokens,),
                  _options(problem, num_warps=4 if not _interpreting() else 1), **bound, heads_k=problem.heads_k,
                  new_tokens=problem.new_tokens, HEAD_DIM=problem.head_dim,
                  HEAD_DIM_V=problem.head_dim_v, BLOCK_H=triton.next_power_of_2(problem.heads_k),
                  BLOCK_D=triton.next_power_of_2(problem.head_dim), BLOCK_DV=triton.next_power_of_2(problem.head_dim_v),
                  PAGE_SIZE=problem.page_size or 0, FP8=fp8_mode(problem.fp8), PDL=programmatic(problem))


def programmatic(problem) -> bool:
    """Whether a step's launches are programmatic dependent launches (PDL, sm_90 on): each
    kernel's programs may become resident while the launch before it ends, and wait for it
    (``gdc_wait``) before they read anything, so the two or three launches of a step lose most of
    the gap between them, a visible share of a step over a short cache. Waiting for the whole
    launch before makes it safe after any kernel, the caller's included. On an H200 (CUDA-graph
    replays, Hq 32, Hk 8, d128) it read 1-3.5% faster over contiguous caches and FP8 caches paged
    or not, and 0-3% faster over 16-bit paged caches (pages of 16 and 256, B=1 and 16). The split
    lets the merge in once its loop is done: at its start, 1-10% slower.
    """
    if _interpreting():
        return False
    return triton.runtime.driver.active.get_current_target().arch >= 90


def _options(problem, **options) -> dict:
    return {**options, "launch_pdl": True} if programmatic(problem) else options


_BUILD = {"split": _build_split, "merge": _build_merge, "append": _build_append}


def _row_tiles(problem, tiles: dict) -> int:
    return triton.cdiv(problem.seqlen_q * problem.group, tiles["BLOCK_M"])


def _interpreting() -> bool:
    from flashx_triton.tuning import interpreting

    return interpreting()


@functools.cache
def _device_size(device: torch.device) -> tuple[int, int]:
    """(SMs, shared memory a program may take in bytes) of a GPU; under the interpreter a stand-in
    of ``INTERPRETED_SMS`` SMs holding one program each."""
    if device.type != "cuda":
        return INTERPRETED_SMS, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (torch.cuda.get_device_properties(index).multi_processor_count,
            triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
