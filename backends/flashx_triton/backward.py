"""The backward: no atomics, so it is deterministic.

1. ``_prepare_kernel``: per query row, D = rowsum(dO * O) and the LSE in the forward's base-2
   scale (+inf for empty rows, so that exp2(s - lse) is exactly 0 there).
2. ``_gradients_kernel``, whose programs are of two kinds:
   - ``_dkdv_program``: one key tile, K/V resident, streaming the query tiles of every query head
     of its group: dV = P^T dO, dK = dS^T Q, summed over the group in registers;
   - ``_dq_program``: one query tile, Q/dO resident, streaming key tiles: dQ = dS K.
   Both kinds run in one launch, or each in a launch of its own with tiles of its own, whichever
   the tuner chose (``tuning.GRADIENTS``). As in the forward, a launch with masked tiles
   runs twice (``Passes``): plain products first, then exactly for the programs whose sums ended
   non-finite.

P is recomputed from the LSE; with dropout, Z is regenerated from (seed, rng_offset).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flashx_triton import tuning
from flashx_triton.arguments import LENGTHS, problem_args
from flashx_triton.dropout import DROPOUT_DRAW, dropout_keep_tile, dropout_state, kept_scale
from flashx_triton.launch import (Launch, Passes, call_args, flag_nonfinite, layout, next_program, per_problem,
                                  program_share)
from flashx_triton.loads import (allow_kernel_descriptors, head_descriptors, last_dim_contiguous, load_rows,
                                 lse_strides, row_descriptors, row_strides, tma_ready)
from flashx_triton.masking import (MASKED_PARTS, allowed_pairs, band_part, band_parts, band_tiles, diagonal_part,
                                   pair_rule, sequence_bounds)
from flashx_triton.products import any_nonfinite, dot, masked_dot
from flashx_triton.score_mods import alibi_split, modified_scores, score_mod_args, score_rule


@triton.jit(do_not_specialize=LENGTHS)
def _prepare_kernel(O, DO, LSE, DELTA, LSE2, CU_Q, SEQLENS_Q, SINKS, SINK_TERMS, o_strides, do_strides, stride_lb,
                    stride_lh, padded_q, heads_q, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_SEQLENS_Q: tl.constexpr,
                    HAS_SINKS: tl.constexpr):
    stride_ob, stride_on, stride_oh = o_strides
    stride_db, stride_dn, stride_dh = do_strides
    num_tiles = tl.cdiv(padded_q, BLOCK_M)
    pid = tl.program_id(0)
    head = pid // num_tiles
    m0 = (pid % num_tiles) * BLOCK_M
    b = head // heads_q
    h = head % heads_q
    q_start, q_len = sequence_bounds(b, CU_Q, SEQLENS_Q, padded_q, IS_VARLEN, HAS_SEQLENS_Q)
    rows_out = q_len if IS_VARLEN else padded_q
    if m0 >= rows_out:
        return
    b64 = b.to(tl.int64)
    rows_in_tile = tl.arange(0, BLOCK_M)
    rows = m0 + rows_in_tile
    dims = tl.arange(0, BLOCK_DV)
    valid = (rows[:, None] < q_len) & (dims[None, :] < HEAD_DIM_V)
    row0 = (q_start + m0).to(tl.int64)
    o = tl.load(O + b64 * stride_ob + row0 * stride_on + h.to(tl.int64) * stride_oh
                + rows_in_tile[:, None] * stride_on + dims[None, :], mask=valid, other=0.0)
    do = tl.load(DO + b64 * stride_db + row0 * stride_dn + h.to(tl.int64) * stride_dh
                 + rows_in_tile[:, None] * stride_dn + dims[None, :], mask=valid, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_offset = b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + m0 + rows_in_tile
    lse = tl.load(LSE + row_offset, mask=rows < q_len, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + row_offset, delta, mask=rows < rows_out)
    tl.store(LSE2 + row_offset, lse2, mask=rows < rows_out)
    if HAS_SINKS:
        # Each row's term of dsinks[h] (summed on the host, in a fixed order): the sink's
        # probability times delta. A row that read no key has o = 0 and lse = the sink (NaN for
        # a NaN sink), and adds 0 whatever its dO holds; a row that read one has lse > sink, or
        # o != 0, or a NaN o.
        sink = tl.load(SINKS + h)
        no_key = ((lse == sink) | (lse != lse)) & (tl.max(tl.abs(o.to(tl.float32)), 1) == 0.0)
        term = tl.where(no_key | (rows >= q_len), 0.0, tl.exp(sink - lse) * delta)
        tl.store(SINK_TERMS + row_offset, term, mask=rows < rows_out)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, q_base, do_base, seq, q_start, head, stride_qn, stride_dn, lse2_base,
                delta_base, n0, cols, lo, hi, first_row, end_row, pairs, scale_log2, rule, stream, dropout,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr,
                DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr,
                DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, HOST_DESCRIPTORS: tl.constexpr,
                EXACT: tl.constexpr, SIDE: tl.constexpr):
    """Add query tiles [lo, hi) into this key tile's (dk, dv), keys ``cols`` from ``n0``; scores are
    held transposed, keys x queries. MASKED tiles test every pair, and EXACT ones keep a
    non-finite Q or dO out of the keys that may not use it (``Passes``). SIDE as in the forward's
    ``_attend_tiles``."""
    rows_in_tile = tl.arange(0, BLOCK_M)
    q_len = pairs[0]  # pair_rule packs the query length first
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=1 if (MASKED and (EXACT or HAS_MASK or HAS_BLOCK_MASK))
                            or (DROPOUT and EXACT) else None):  # see _dq_tiles
        rows = start_m + rows_in_tile
        if MASKED:
            ok = allowed_pairs(rows[None, :], cols[:, None], pairs, HAS_MASK, HAS_BLOCK_MASK)
            if HAS_MASK or HAS_BLOCK_MASK:
                nonempty = tl.max(ok.to(tl.int32)) > 0
            else:
                nonempty = True
        else:
            nonempty = True
        if nonempty:
            if MASKED:
                lse2 = tl.load(lse2_base + rows, mask=rows < q_len, other=float("inf"))
                delta = tl.load(delta_base + rows, mask=rows < q_len, other=0.0)
                # Rows that no key of this tile may use are not loaded through pointers; TMA loads
                # them, and masked_dot keeps their non-finite values out of dK and dV, as it does
                # an empty row's (whose Q and dO may hold anything). A row whose allowed scores
                # are all -inf (lse2 = +inf too) is read: its pairs carry its infinities.
                used = (rows >= first_row) & (rows < end_row)
                q = load_rows(q_desc, q_base, seq, q_start, head, start_m, stride_qn, used, HEAD_DIM, BLOCK_M, BLOCK_D,
                              USE_TMA, True, False, HOST_DESCRIPTORS)
                do = load_rows(do_desc, do_base, seq, q_start, head, start_m, stride_dn, used, HEAD_DIM_V, BLOCK_M,
                               BLOCK_DV, USE_TMA, True, False, HOST_DESCRIPTORS)
                s = dot(k, tl.trans(q), None, DOT_PRECISION)
                scores, capped = modified_scores(s, rows[None, :], cols[:, None], scale_log2, rule, SOFTCAP, ALIBI,
                                                 FAST_TANH)
                p = tl.exp2(tl.where(ok, scores, float("-inf")) - lse2[None, :])
            else:
                lse2 = tl.load(lse2_base + rows)
                delta = tl.load(delta_base + rows)
                q = load_rows(q_desc, q_base, seq, q_start, head, start_m, stride_qn, rows, HEAD_DIM, BLOCK_M, BLOCK_D,
                              USE_TMA, False, HOST_DESCRIPTORS=HOST_DESCRIPTORS)
                do = load_rows(do_desc, do_base, seq, q_start, head, start_m, stride_dn, rows, HEAD_DIM_V, BLOCK_M,
                               BLOCK_DV, USE_TMA, False, HOST_DESCRIPTORS=HOST_DESCRIPTORS)
                s = dot(k, tl.trans(q), None, DOT_PRECISION)
                scores, capped = modified_scores(s, rows[None, :], cols[:, None], scale_log2, rule, SOFTCAP,
                                                 ALIBI and SIDE == 0, FAST_TANH)
                if ALIBI and SIDE != 0:  # P = exp2(scores + the key's term - (LSE - the query's term))
                    key_terms, row_terms = alibi_split(rows, cols, n0, rule, SIDE)
                    p = tl.exp2(scores + key_terms[:, None] - (lse2 - row_terms)[None, :])
                else:
                    p = tl.exp2(scores - lse2[None, :])
            dp = dot(v, tl.trans(do), None, DOT_PRECISION)
            if EXACT and (MASKED or DROPOUT):
                if USE_TMA:
                    suspect = any_nonfinite(s) | any_nonfinite(dp)  # of Q and dO (K and V too)
                else:
                    # Through pointers (misaligned or Dv != D) the branch costs ptxas its last
                    # registers (allocation failed at 255, D = 40, Dv = 80): the exact path always.
                    suspect = True
            if DROPOUT:
                keep = dropout_keep_tile(rows, n0, cols.shape[0], stream, dropout, KEYS_FIRST=True)
                p_kept = tl.where(keep, p * kept_scale(dropout), 0.0)
                dp = tl.where(keep, dp * kept_scale(dropout), 0.0)
            else:
                p_kept = p
            ds = p * (dp - delta[None, :])
            if SOFTCAP:  # through the cap, to the scaled score
                ds = ds * (1.0 - capped * capped)
            if MASKED and EXACT:
                # P is NaN at a disallowed pair of a row whose LSE is NaN, and dS wherever dP is
                # non-finite (a non-finite row of V or dO): both are masked here. A dropped pair
                # reads no dO for dV (its dS, -P * delta, is a real term of dK).
                read = ok & keep if DROPOUT else ok
                dv = masked_dot(tl.where(read, p_kept, 0.0).to(do.dtype), do, read, dv, suspect, DOT_PRECISION)
                dk = masked_dot(tl.where(ok, ds, 0.0).to(q.dtype), q, ok, dk, suspect, DOT_PRECISION)
            elif EXACT and DROPOUT:
                dv = masked_dot(p_kept.to(do.dtype), do, keep, dv, suspect, DOT_PRECISION)
                dk = dot(ds.to(q.dtype), q, dk, DOT_PRECISION)
            else:
                dv = dot(p_kept.to(do.dtype), do, dv, DOT_PRECISION)
                dk = dot(ds.to(q.dtype), q, dk, DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(
    head_k, n0, Q, K, V, DO, q_desc, do_desc, DK, DV, LSE2, DELTA, REDO, strides, stride_lb, stride_lh,
    CU_Q, CU_K, SEQLENS_Q, SEQLENS_K, MASK, BLOCKS, SLOPES, padded_q, padded_k, heads_q, group, left, right, masks,
    dropout, scales, mods,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_SEQLENS_Q: tl.constexpr,
    HAS_SEQLENS_K: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, PARTS: tl.constexpr, HOST_DESCRIPTORS: tl.constexpr, EXACT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """dK and dV of key tile [n0, n0 + BLOCK_N) of key head ``head_k``, the query rows streamed BLOCK_M at a time.
    The strides and lengths are _gradients_kernel's."""
    q_strides, k_strides, v_strides, do_strides, dq_strides, dk_strides, dv_strides = strides
    stride_qb, stride_qn, stride_qh = q_strides
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh = v_strides
    stride_db, stride_dn, stride_dh = do_strides
    stride_dkb, stride_dkn, stride_dkh = dk_strides
    stride_dvb, stride_dvn, stride_dvh = dv_strides
    softmax_scale, scale_log2 = scales
    heads_k = heads_q // group
    b = head_k // heads_k
    hk = head_k % heads_k
    q_start, q_len = sequence_bounds(b, CU_Q, SEQLENS_Q, padded_q, IS_VARLEN, HAS_SEQLENS_Q)
    k_start, k_len = sequence_bounds(b, CU_K, SEQLENS_K, padded_k, IS_VARLEN, HAS_SEQLENS_K)
    rows_out = k_len if IS_VARLEN else padded_k
    if n0 < rows_out:
        b64 = b.to(tl.int64)
        key_row0 = (k_start + n0).to(tl.int64)
        cols_in_tile = tl.arange(0, BLOCK_N)
        cols = n0 + cols_in_tile
        dims = tl.arange(0, BLOCK_D)
        dims_v = tl.arange(0, BLOCK_DV)
        live = cols[:, None] < k_len
        k = tl.load(K + b64 * stride_kb + key_row0 * stride_kn + hk.to(tl.int64) * stride_kh
                    + cols_in_tile[:, None] * stride_kn + dims[None, :], mask=live & (dims[None, :] < HEAD_DIM),
                    other=0.0)
        v = tl.load(V + b64 * stride_vb + key_row0 * stride_vn + hk.to(tl.int64) * stride_vh
                    + cols_in_tile[:, None] * stride_vn + dims_v[None, :], mask=live & (dims_v[None, :] < HEAD_DIM_V),
                    other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        # Seen from the keys, the band is mirrored: left and right swap.
        first, full_lo, full_hi, end = band_tiles(n0, k_len, q_len, right, left, BLOCK_N, BLOCK_M,
                                                  HAS_MASK or HAS_BLOCK_MASK)
        seq = 0 if IS_VARLEN else b  # the descriptors' batch axis (a varlen tensor gets one of length 1)
        for g in range(group):
            head = hk * group + g
            h = head.to(tl.int64)
            q_base = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qn + h * stride_qh
            do_base = DO + b64 * stride_db + q_start.to(tl.int64) * stride_dn + h * stride_dh
            lse2_base = LSE2 + b64 * stride_lb + h * stride_lh + q_start
            delta_base = DELTA + b64 * stride_lb + h * stride_lh + q_start
            pairs = pair_rule(b, head, q_len, k_len, left, right, MASK, BLOCKS, masks, HAS_MASK, HAS_BLOCK_MASK)
            rule = score_rule(SLOPES, b, head, q_len, k_len, mods, ALIBI)
            stream = b * heads_q + h
            q_tiles, do_tiles = head_descriptors(q_desc, do_desc, q_base, do_base, q_len, stride_qn, stride_dn,
                                                 HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D, BLOCK_DV, USE_TMA,
                                                 HOST_DESCRIPTORS)
            SPLIT_PART: tl.constexpr = 1 if ALIBI else -1  # ALiBi's full tiles run by side of the diagonal
            for part in tl.static_range(3):  # masked tiles, full tiles, masked tiles (band_part)
                if PARTS >> part & 1:  # the parts this problem can have (band_parts)
                    lo, hi = band_part(part, first // BLOCK_M * BLOCK_M, full_lo, full_hi, end)
                    # ALiBi's full tiles, by side of the diagonal (mirrored: queries before it give a
                    # negative i + Lk - Lq - j)
                    for side in tl.static_range(3 if part == SPLIT_PART else 1):
                        start, stop = (diagonal_part(side, lo, hi, n0, q_len - k_len, BLOCK_N, BLOCK_M)
                                       if part == SPLIT_PART else (lo, hi))
                        dk, dv = _dkdv_tiles(dk, dv, k, v, q_tiles, do_tiles, q_base, do_base, seq, q_start, head,
                                             stride_qn, stride_dn, lse2_base, delta_base, n0, cols, start, stop, first,
                                             end, pairs, scale_log2, rule, stream, dropout, HEAD_DIM, HEAD_DIM_V,
                                             BLOCK_D, BLOCK_DV, BLOCK_M, part != 1, HAS_MASK, HAS_BLOCK_MASK, DROPOUT,
                                             SOFTCAP, FAST_TANH, ALIBI, DOT_PRECISION, USE_TMA, HOST_DESCRIPTORS,
                                             EXACT, side - 1 if part == SPLIT_PART else 0)
        if not EXACT:
            finite = flag_nonfinite(REDO, tl.sum(dk) + tl.sum(dv))

        # Padded keys past k_len get zero gradients, whatever K and V hold there.
        dk = tl.where(live, dk * softmax_scale, 0.0)
        dv = tl.where(live, dv, 0.0)
        store_rows = cols[:, None] < rows_out
        dk_at = (DK + b64 * stride_dkb + key_row0 * stride_dkn + hk.to(tl.int64) * stride_dkh
                 + cols_in_tile[:, None] * stride_dkn + dims[None, :])
        dv_at = (DV + b64 * stride_dvb + key_row0 * stride_dvn + hk.to(tl.int64) * stride_dvh
                 + cols_in_tile[:, None] * stride_dvn + dims_v[None, :])
        dk_rows = store_rows & (dims[None, :] < HEAD_DIM)
        dv_rows = store_rows & (dims_v[None, :] < HEAD_DIM_V)
        if ACCUMULATE:  # DK and DV hold running sums: this program is their one writer in the launch
            if not EXACT:  # a flagged program adds in the exact launch (flag_nonfinite)
                dk_rows = tl.where(finite, dk_rows, False)
                dv_rows = tl.where(finite, dv_rows, False)
            dk += tl.load(dk_at, mask=dk_rows, other=0.0)
            dv += tl.load(dv_at, mask=dv_rows, other=0.0)
        tl.store(dk_at, dk.to(DK.dtype.element_ty), mask=dk_rows)
        tl.store(dv_at, dv.to(DV.dtype.element_ty), mask=dv_rows)


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, seq, k_start, kv_head, stride_kn, stride_vn, rows,
              lo, hi, first_col, end_col, pairs, scale_log2, rule, stream, dropout,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr,
              DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr,
              DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, HOST_DESCRIPTORS: tl.constexpr,
              EXACT: tl.constexpr, SIDE: tl.constexpr):
    """Add key tiles [lo, hi) into this query tile's dq; MASKED, EXACT and SIDE as in _dkdv_tiles."""
    cols_in_tile = tl.arange(0, BLOCK_N)
    # A masked loop with a branch on data around its products is not software-pipelined: Triton
    # 3.6 miscompiles the pipelined loop around masked_dot's branch on ``suspect`` (wrong causal
    # 16-bit gradients with more keys than queries; conformance's test_causal_16bit holds it).
    # The plain masked tiles have no such branch unless a mask can leave a tile empty.
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=1 if MASKED and (EXACT or HAS_MASK or HAS_BLOCK_MASK)
                            else None):
        cols = start_n + cols_in_tile
        if MASKED:
            ok = allowed_pairs(rows[:, None], cols[None, :], pairs, HAS_MASK, HAS_BLOCK_MASK)
            if HAS_MASK or HAS_BLOCK_MASK:
                nonempty = tl.max(ok.to(tl.int32)) > 0
            else:
                nonempty = True
            used = (cols >= first_col) & (cols < end_col)
        else:
            used = cols_in_tile  # not read: unmasked tiles lie inside the band and the sequence
            nonempty = True
        if nonempty:
            k = load_rows(k_desc, k_base, seq, k_start, kv_head, start_n, stride_kn, used, HEAD_DIM, BLOCK_N, BLOCK_D,
                          USE_TMA, MASKED, False, HOST_DESCRIPTORS)
            v = load_rows(v_desc, v_base, seq, k_start, kv_head, start_n, stride_vn, used, HEAD_DIM_V, BLOCK_N,
                          BLOCK_DV, USE_TMA, MASKED, False, HOST_DESCRIPTORS)
            s = dot(q, tl.trans(k), None, DOT_PRECISION)
            scores, capped = modified_scores(s, rows[:, None], cols[None, :], scale_log2, rule, SOFTCAP,
                                             ALIBI and SIDE == 0, FAST_TANH)
            if MASKED:
                if EXACT:
                    if USE_TMA:
                        suspect = any_nonfinite(s)  # of K (and Q)
                    else:
                        suspect = True  # as in _dkdv_tiles
                p = tl.exp2(tl.where(ok, scores, float("-inf")) - lse2[:, None])
            elif ALIBI and SIDE != 0:  # as in _dkdv_tiles
                key_terms, row_terms = alibi_split(rows, cols, start_n, rule, SIDE)
                p = tl.exp2(scores + key_terms[None, :] - (lse2 - row_terms)[:, None])
            else:
                p = tl.exp2(scores - lse2[:, None])
            dp = dot(do, tl.trans(v), None, DOT_PRECISION)
            if DROPOUT:
                keep = dropout_keep_tile(rows, start_n, BLOCK_N, stream, dropout)
                dp = tl.where(keep, dp * kept_scale(dropout), 0.0)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * (1.0 - capped * capped)
            if MASKED and EXACT:
                # as in _dkdv_tiles
                dq = masked_dot(tl.where(ok, ds, 0.0).to(k.dtype), k, ok, dq, suspect, DOT_PRECISION)
            else:
                dq = dot(ds.to(k.dtype), k, dq, DOT_PRECISION)
    return dq


@triton.jit
def _dq_program(
    head, m0, Q, K, V, DO, k_desc, v_desc, DQ, LSE2, DELTA, REDO, strides, stride_lb, stride_lh,
    CU_Q, CU_K, SEQLENS_Q, SEQLENS_K, MASK, BLOCKS, SLOPES, padded_q, padded_k, heads_q, group, left, right, masks,
    dropout, scales, mods,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_SEQLENS_Q: tl.constexpr,
    HAS_SEQLENS_K: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, PARTS: tl.constexpr, HOST_DESCRIPTORS: tl.constexpr, EXACT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """dQ of query tile [m0, m0 + BLOCK_M) of query head ``head``, the keys streamed BLOCK_N at a time.
    The strides and lengths are _gradients_kernel's."""
    q_strides, k_strides, v_strides, do_strides, dq_strides, dk_strides, dv_strides = strides
    stride_qb, stride_qn, stride_qh = q_strides
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh = v_strides
    stride_db, stride_dn, stride_dh = do_strides
    stride_dqb, stride_dqn, stride_dqh = dq_strides
    softmax_scale, scale_log2 = scales
    b = head // heads_q
    h = head % heads_q
    q_start, q_len = sequence_bounds(b, CU_Q, SEQLENS_Q, padded_q, IS_VARLEN, HAS_SEQLENS_Q)
    k_start, k_len = sequence_bounds(b, CU_K, SEQLENS_K, padded_k, IS_VARLEN, HAS_SEQLENS_K)
    rows_out = q_len if IS_VARLEN else padded_q
    if m0 < rows_out:
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)
        row0 = (q_start + m0).to(tl.int64)
        rows_in_tile = tl.arange(0, BLOCK_M)
        rows = m0 + rows_in_tile
        dims = tl.arange(0, BLOCK_D)
        dims_v = tl.arange(0, BLOCK_DV)
        lse_offset = b64 * stride_lb + h64 * stride_lh + q_start + m0
        lse2 = tl.load(LSE2 + lse_offset + rows_in_tile, mask=rows < q_len, other=float("inf"))
        delta = tl.load(DELTA + lse_offset + rows_in_tile, mask=rows < q_len, other=0.0)
        # Padding is never read. An empty row's Q and dO may hold anything: no pair of it is
        # allowed, so it lies in masked tiles alone, whose exact products keep them out (masked_dot).
        live = (rows < q_len)[:, None]
        q = tl.load(Q + b64 * stride_qb + row0 * stride_qn + h64 * stride_qh + rows_in_tile[:, None] * stride_qn
                    + dims[None, :], mask=live & (dims[None, :] < HEAD_DIM), other=0.0)
        do = tl.load(DO + b64 * stride_db + row0 * stride_dn + h64 * stride_dh + rows_in_tile[:, None] * stride_dn
                     + dims_v[None, :], mask=live & (dims_v[None, :] < HEAD_DIM_V), other=0.0)
        kv_head = h // group
        k_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + kv_head.to(tl.int64) * stride_kh
        v_base = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vn + kv_head.to(tl.int64) * stride_vh
        seq = 0 if IS_VARLEN else b  # the descriptors' batch axis (a varlen tensor gets one of length 1)
        k_tiles, v_tiles = head_descriptors(k_desc, v_desc, k_base, v_base, k_len, stride_kn, stride_vn, HEAD_DIM,
                                            HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, HOST_DESCRIPTORS)
        pairs = pair_rule(b, h, q_len, k_len, left, right, MASK, BLOCKS, masks, HAS_MASK, HAS_BLOCK_MASK)
        rule = score_rule(SLOPES, b, h, q_len, k_len, mods, ALIBI)
        stream = b * heads_q + h

        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        first, full_lo, full_hi, end = band_tiles(m0, q_len, k_len, left, right, BLOCK_M, BLOCK_N,
                                                  HAS_MASK or HAS_BLOCK_MASK)
        SPLIT_PART: tl.constexpr = 1 if ALIBI else -1  # ALiBi's full tiles run by side of the diagonal
        for part in tl.static_range(3):  # masked tiles, full tiles, masked tiles (band_part)
            if PARTS >> part & 1:  # the parts this problem can have (band_parts)
                lo, hi = band_part(part, first // BLOCK_N * BLOCK_N, full_lo, full_hi, end)
                for side in tl.static_range(3 if part == SPLIT_PART else 1):
                    start, stop = (diagonal_part(side, lo, hi, m0, k_len - q_len, BLOCK_M, BLOCK_N)
                                   if part == SPLIT_PART else (lo, hi))
                    dq = _dq_tiles(dq, q, do, lse2, delta, k_tiles, v_tiles, k_base, v_base, seq, k_start, kv_head,
                                   stride_kn, stride_vn, rows, start, stop, first, end, pairs, scale_log2, rule, stream,
                                   dropout, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, part != 1, HAS_MASK,
                                   HAS_BLOCK_MASK, DROPOUT, SOFTCAP, FAST_TANH, ALIBI, DOT_PRECISION, USE_TMA,
                                   HOST_DESCRIPTORS, EXACT, 1 - side if part == SPLIT_PART else 0)
        if not EXACT:
            finite = flag_nonfinite(REDO, tl.sum(dq))

        dq = tl.where(live, dq * softmax_scale, 0.0)
        dq_at = (DQ + b64 * stride_dqb + row0 * stride_dqn + h64 * stride_dqh + rows_in_tile[:, None] * stride_dqn
                 + dims[None, :])
        dq_rows = (rows[:, None] < rows_out) & (dims[None, :] < HEAD_DIM)
        if ACCUMULATE:  # as in _dkdv_program
            if not EXACT:
                dq_rows = tl.where(finite, dq_rows, False)
            dq += tl.load(dq_at, mask=dq_rows, other=0.0)
        tl.store(dq_at, dq.to(DQ.dtype.element_ty), mask=dq_rows)


# Passes's program count, LENGTHS and DROPOUT_DRAW: one compile for any
@triton.jit(do_not_specialize=["programs", *LENGTHS, *DROPOUT_DRAW])
def _gradients_kernel(
    Q, K, V, DO, Q_DESC, DO_DESC, K_DESC, V_DESC, DQ, DK, DV, LSE2, DELTA,
    CU_Q, CU_K, SEQLENS_Q, SEQLENS_K, MASK, BLOCKS, SLOPES, SINKS,  # each call's own (call_args)
    seed_lo, seed_hi, rng_offset, row0, key0,  # each call's own too (call_args: DROPOUT_DRAW)
    REDO,  # Passes's flags (None: one launch)
    strides, stride_lb, stride_lh,  # (batch, row, head) of q, k, v, do, dq, dk, dv; (batch, head) of LSE2 and DELTA
    padded_q, padded_k, heads_q, group, left, right,  # problem_args
    masks, dropout_rate, scales, mods, programs,  # groups (problem_args, score_mod_args); scales: (scale, in log2)
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    TILE: tl.constexpr, STREAM: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_SEQLENS_Q: tl.constexpr,
    HAS_SEQLENS_K: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, DROPOUT: tl.constexpr,
    # HAS_SINKS changes nothing here (the sink's gradient is _prepare_kernel's): it comes with the others
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, KEY_PARTS: tl.constexpr, QUERY_PARTS: tl.constexpr,
    HOST_DESCRIPTORS: tl.constexpr, KEY_PROGRAMS: tl.constexpr, QUERY_PROGRAMS: tl.constexpr,
    EXACT: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Per key head, the programs of its key tiles (dK, dV; if KEY_PROGRAMS) and then those of the
    query tiles of its query heads (dQ; if QUERY_PROGRAMS). Each program keeps TILE rows resident
    and streams the other axis STREAM rows at a time; the first key tiles and the last query tiles,
    which a causal band gives the most work, start first. Either part alone is the same kernel."""
    dropout = dropout_state(seed_lo, seed_hi, rng_offset, row0, key0, dropout_rate)
    key_tiles = tl.cdiv(padded_k, TILE) if KEY_PROGRAMS else 0
    query_tiles = tl.cdiv(padded_q, TILE)
    per_head = key_tiles + (group * query_tiles if QUERY_PROGRAMS else 0)
    ids, todo, runs = program_share(REDO, programs, EXACT)
    for _ in range(runs):
        pid, todo = next_program(ids, todo, REDO, EXACT)
        head_k = pid // per_head
        local = pid % per_head
        if KEY_PROGRAMS and QUERY_PROGRAMS:
            keys = local < key_tiles
        else:
            keys: tl.constexpr = KEY_PROGRAMS  # known when compiling: the other part is left out
        if keys:
            _dkdv_program(head_k, local * TILE, Q, K, V, DO, Q_DESC, DO_DESC, DK, DV, LSE2, DELTA, REDO, strides,
                          stride_lb, stride_lh, CU_Q, CU_K, SEQLENS_Q, SEQLENS_K, MASK, BLOCKS, SLOPES, padded_q,
                          padded_k, heads_q, group, left, right, masks, dropout, scales, mods, HEAD_DIM, HEAD_DIM_V,
                          BLOCK_D, BLOCK_DV, STREAM, TILE, IS_VARLEN, HAS_SEQLENS_Q, HAS_SEQLENS_K, HAS_MASK,
                          HAS_BLOCK_MASK, DROPOUT, SOFTCAP, FAST_TANH, ALIBI, DOT_PRECISION, USE_TMA, KEY_PARTS,
                          HOST_DESCRIPTORS, EXACT, ACCUMULATE)
        else:
            local -= key_tiles
            _dq_program(head_k * group + local // query_tiles, (query_tiles - 1 - local % query_tiles) * TILE, Q, K, V,
                        DO, K_DESC, V_DESC, DQ, LSE2, DELTA, REDO, strides, stride_lb, stride_lh, CU_Q, CU_K,
                        SEQLENS_Q, SEQLENS_K, MASK, BLOCKS, SLOPES, padded_q, padded_k, heads_q, group, left, right,
                        masks, dropout, scales, mods, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, TILE, STREAM, IS_VARLEN,
                        HAS_SEQLENS_Q, HAS_SEQLENS_K, HAS_MASK, HAS_BLOCK_MASK, DROPOUT, SOFTCAP, FAST_TANH, ALIBI,
                        DOT_PRECISION, USE_TMA, QUERY_PARTS, HOST_DESCRIPTORS, EXACT, ACCUMULATE)


def backward(problem, q, k, v, o, lse, do):
    q, k, v, o, do = (last_dim_contiguous(x) for x in (q, k, v, o, do))
    lse = lse.contiguous()
    # Varlen rows past cu_seqlens[-1] belong to no sequence: their gradients are 0. Gradients are
    # dense and row-major whatever the inputs' layout (an input's strides may tie or be 0, and
    # *_like would keep a layout the kernel does not write); *_like costs half the host time of
    # torch.empty with shape, dtype and device.
    alloc = torch.zeros_like if problem.varlen and problem.rows_past_sequences else torch.empty_like
    dq, dk, dv = (alloc(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    tensors, draws = call_args(problem)
    prepare, gradients, use_tma = per_problem(problem, ("backward", layout(q, k, v, o, do, lse, *tensors)),
                                              lambda: _launches(problem, q, k, v, o, do, lse))
    return _run(problem, prepare, gradients, use_tma, q, k, v, o, lse, do, dq, dk, dv, (*tensors, *draws))


def backward_into(problem, q, k, v, o, lse, do, dq_sums, dk_sums, dv_sums):
    """``Backend.backward_into``: the gradient kernel under ACCUMULATE, whose programs add their
    float32 dq, dk, dv into the running sums they would have written, under the plan and
    configurations the plain backward chooses (``tuning.settled``). Returns dsinks, or None."""
    given = q, k, v, o, lse, do
    q, k, v, o, do = (last_dim_contiguous(x) for x in (q, k, v, o, do))
    lse = lse.contiguous()
    dq, dk, dv = (last_dim_contiguous(x) for x in (dq_sums, dk_sums, dv_sums))  # written through their strides
    tensors, draws = call_args(problem)
    call = (*tensors, *draws)

    def build():
        settle = functools.partial(backward, problem, *given)
        plan = tuning.settled("gradients", problem, settle)
        # lse2 and delta are laid out as lse (_run): the launches bind their strides alone
        launches = [_gradients_launch(problem, tuning.settled(part, problem, settle), q, k, v, do, dq, dk, dv, lse,
                                      lse, *call, part=part, accumulate=True) for part in _PLANS[plan]]

        def gradients(problem, *tensors):
            for launch in launches:
                launch(*tensors)

        return _prepare_launch(problem, o, do, lse), gradients, tma_ready(problem, q, k, v, do)

    prepare, gradients, use_tma = per_problem(
        problem, ("backward_into", layout(q, k, v, o, do, lse, dq, dk, dv, *tensors), tuning.autotuning()),
        build)
    dsinks = _run(problem, prepare, gradients, use_tma, q, k, v, o, lse, do, dq, dk, dv, call)[3:]
    for sums, written in ((dq_sums, dq), (dk_sums, dk), (dv_sums, dv)):
        if written is not sums:
            sums.copy_(written)
    return dsinks[0] if dsinks else None


def _run(problem, prepare, gradients, use_tma, q, k, v, o, lse, do, dq, dk, dv, call: tuple):
    """The prepare launch, then ``gradients`` into dq, dk, dv: (dq, dk, dv), and dsinks with sinks."""
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    sinks = problem.sinks
    # rows past cu_seqlens[-1] get no term: they read no key
    sink_terms = None if sinks is None else (torch.zeros_like if problem.varlen and problem.rows_past_sequences
                                             else torch.empty_like)(lse)
    prepare(o, do, lse, delta, lse2, problem.cu_seqlens_q, problem.seqlens_q, sinks, sink_terms)
    if use_tma:  # some backward configurations build their descriptors in the kernel
        allow_kernel_descriptors(q)
    gradients(problem, q, k, v, do, dq, dk, dv, lse2, delta, *call)
    if sinks is None:
        return dq, dk, dv
    # dsinks[h] = -(sum of its rows' terms): lse's head axis is its second-to-last
    return dq, dk, dv, -sink_terms.transpose(0, -2).reshape(problem.heads_q, -1).sum(1)


def _launches(problem, q, k, v, o, do, lse):
    """The prepare launch, the gradient launches (tuned on first use), and whether the streamed
    operands load through TMA, for tensors laid out as these."""
    return _prepare_launch(problem, o, do, lse), tuning.Tuned("gradients", _gradients_plan), tma_ready(problem, q, k, v, do)


def _prepare_launch(problem, o, do, lse) -> Launch:
    varlen, args = problem.varlen, problem_args(problem)
    rows = 64 if not tuning.interpreting() else 16
    return Launch(_prepare_kernel, (problem.batch * problem.heads_q * triton.cdiv(problem.seqlen_q, rows),), {},
                  o_strides=row_strides(o, varlen), do_strides=row_strides(do, varlen),
                  **lse_strides(lse, varlen), padded_q=problem.seqlen_q,
                  heads_q=problem.heads_q, HEAD_DIM_V=problem.head_dim_v, BLOCK_DV=args["BLOCK_DV"],
                  BLOCK_M=rows, IS_VARLEN=varlen, HAS_SEQLENS_Q=args["HAS_SEQLENS_Q"],
                  HAS_SINKS=problem.sinks is not None)


_PLANS = {"fused": ("fused",), "split": ("dkdv", "dq")}


def _gradients_plan(problem, plan, q, k, v, do, dq, dk, dv, lse2, delta, *call):
    """dQ, dK and dV in one launch ("fused") or two ("split"), each launch tuned on its own."""
    launches = [tuning.tuned_launch(part, problem, functools.partial(_gradients_launch, part=part), q, k, v, do, dq,
                                    dk, dv, lse2, delta, *call) for part in _PLANS[plan]]

    def run(q, k, v, do, dq, dk, dv, lse2, delta, *call):
        for launch in launches:
            launch(q, k, v, do, dq, dk, dv, lse2, delta, *call)
        return dq, dk, dv

    return run


def _gradients_launch(problem, config, q, k, v, do, dq, dk, dv, lse2, delta, *call, part, accumulate=False):
    """The gradient kernel's ``part`` ("dkdv", "dq", or "fused": one launch for all three) under
    ``config`` (with ``accumulate``, adding into dq, dk and dv), whose block_n keys (dK/dV; fused, as many query rows for dQ) or block_m query
    rows (dQ) stay resident while the other axis streams.

    The streamed operands load through TMA descriptors built on the host, unless ``config`` says
    in the kernel."""
    varlen = problem.varlen
    keys, queries = part != "dq", part != "dkdv"
    tile, stream = (config.block_n, config.block_m) if keys else (config.block_m, config.block_n)
    use_tma = tma_ready(problem, q, k, v, do)
    args = problem_args(problem)
    host = use_tma and config.host_descriptors  # without TMA both placements are one kernel
    descriptors = [row_descriptors(x, varlen, stream, args[width], host and wanted)
                   for x, width, wanted in ((q, "BLOCK_D", keys), (do, "BLOCK_DV", keys), (k, "BLOCK_D", queries),
                                            (v, "BLOCK_DV", queries))]
    per_head = ((triton.cdiv(problem.seqlen_k, tile) if keys else 0)
                + (problem.group * triton.cdiv(problem.seqlen_q, tile) if queries else 0))
    key_parts = band_parts(problem, True, stream) if keys else 0
    query_parts = band_parts(problem, False, stream) if queries else 0
    kernel = Passes(_gradients_kernel, problem.batch * problem.heads_k * per_head, config.options(),
                    bool((key_parts | query_parts) & MASKED_PARTS) or problem.dropout_p > 0, q.device,
                    strides=tuple(row_strides(x, varlen) for x in (q, k, v, do, dq, dk, dv)),
                    **lse_strides(lse2, varlen),
                    **args, scales=(problem.softmax_scale, problem.scale_log2),
                    **score_mod_args(problem, problem.softmax_scale), TILE=tile, STREAM=stream,
                    USE_TMA=use_tma,
                    HOST_DESCRIPTORS=host, KEY_PARTS=key_parts, QUERY_PARTS=query_parts,
                    KEY_PROGRAMS=keys, QUERY_PROGRAMS=queries, ACCUMULATE=accumulate)

    def run(q, k, v, do, dq, dk, dv, lse2, delta, *call):
        kernel(q, k, v, do, *(descriptor(x) for descriptor, x in zip(descriptors, (q, do, k, v))), dq, dk, dv, lse2,
               delta, *call)
        return (dq,) * queries + (dk, dv) * keys

    return run
