"""The forward: one program per (sequence, query head, query tile), K/V streamed (FlashAttention-2).

Online softmax in base 2: scores are scaled by softmax_scale * log2(e) in one multiply, the
running max and sum stay in that base, and the LSE is converted to natural log on the way out.

A problem with masked tiles runs in two launches (``Passes``): plain products in the masked
tiles first, then exactly, only for the query tiles whose acc ended non-finite.

FP8 inputs (the contract's FP8 section) run the same kernel under the FP8 flag
(``flashx_triton.fp8``): Q K^T from the FP8 tiles, q_descale * k_descale folded into the scores'
scale once per program, the weights rounded to e4m3 against the running max for their product
with V (read with its keys contiguous), v_descale folded into o's factor, o in out_dtype.

A short query (a decoding step that reaches ``flashx.attention``) runs as decoding instead
(``flashx_triton.decode.attention_as_decoding``): split-KV, each kv head's keys read once for its
GQA group.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flashx_triton import tuning
from flashx_triton.arguments import LENGTHS, problem_args
from flashx_triton.decode import attention_as_decoding, decode
from flashx_triton.dropout import DROPOUT_DRAW, dropout_keep_tile, dropout_state, kept_scale
from flashx_triton.fp8 import descale_factors, fp8_mode, keys_contiguous, negated, readable_keys, widened
from flashx_triton.launch import (Passes, aligned, call_args, flag_nonfinite, layout, next_program, per_problem,
                                  program_share)
from flashx_triton.loads import last_dim_contiguous, load_rows, lse_strides, row_descriptors, row_strides, tma_ready
from flashx_triton.masking import (MASKED_PARTS, allowed_pairs, band_part, band_parts, band_tiles, diagonal_part,
                                   pair_rule, query_tile)
from flashx_triton.products import dot, masked_dot, pv_operand
from flashx_triton.score_mods import (LOG2E, ROW_MAX_START, alibi_split, descaled_scores, modified_scores,
                                      score_mod_args, score_rule, with_sink)


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_desc, v_desc, k_base, v_base, seq, k_start, kv_head, stride_kn, stride_vn,
                  stride_vd, rows, lo, hi, first_col, end_col, pairs, scale_log2, rule, stream, dropout,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr,
                  DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EXACT: tl.constexpr, FP8: tl.constexpr,
                  SIDE: tl.constexpr):
    """Fold key tiles [lo, hi) into the running (acc, m_i, l_i); MASKED tiles test every pair, and
    EXACT ones keep a non-finite V out of the rows that may not use it. Scores are modified by
    ``rule`` (``score_rule``) under SOFTCAP and ALIBI; SIDE, the sign of i + Lk - Lq - j at
    every pair of every tile (``diagonal_part``), splits ALiBi's bias (``alibi_split``), which
    0 takes per pair. FP8 tiles (``flashx_triton.fp8``) multiply as loaded, and P is rounded to
    e4m3 for its product with V (``pv_operand``)."""
    cols_in_tile = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        if FP8 != "":
            # band_part's tiles start at multiples of BLOCK_N, which the compiler learns from this
            # identity (tl.multiple_of on a loop variable is lost): FP8's V, its keys contiguous,
            # is then copied in 16-byte vectors, pipelined, instead of a byte at a time
            start_n = start_n // BLOCK_N * BLOCK_N
        cols = start_n + cols_in_tile
        if MASKED:
            ok = allowed_pairs(rows[:, None], cols[None, :], pairs, HAS_MASK, HAS_BLOCK_MASK)
            # Columns no row of this tile may use are zeroed: poison there must not leak.
            used = (cols >= first_col) & (cols < end_col)
            if HAS_MASK or HAS_BLOCK_MASK:
                nonempty = tl.max(ok.to(tl.int32)) > 0
            else:
                nonempty = True
        else:
            used = cols_in_tile  # unused: unmasked tiles lie inside the band and the sequence
            nonempty = True
        if nonempty:
            k = widened(load_rows(k_desc, k_base, seq, k_start, kv_head, start_n, stride_kn, used, HEAD_DIM, BLOCK_N,
                                  BLOCK_D, USE_TMA, MASKED, EXACT), FP8 == "emulated")
            v_rows = used
            if FP8 != "" and MASKED:  # whole 16-key groups, for 16-byte copies of V's keys
                v_rows = readable_keys(cols, end_col)
            v = widened(load_rows(v_desc, v_base, seq, k_start, kv_head, start_n, stride_vn, v_rows, HEAD_DIM_V,
                                  BLOCK_N, BLOCK_DV, USE_TMA, MASKED, EXACT, col_stride=stride_vd), FP8 == "emulated")
            s = dot(q, tl.trans(k), None, DOT_PRECISION)
            if MASKED or SOFTCAP or ALIBI:
                s, _ = modified_scores(s, rows[:, None], cols[None, :], scale_log2, rule, SOFTCAP, ALIBI and SIDE == 0,
                                       FAST_TANH)
                row_terms = 0.0  # a score is s + its row's term
                if ALIBI and SIDE != 0:  # ALiBi's bias split: the key's term joins s, the row's its max
                    key_terms, row_terms = alibi_split(rows, cols, start_n, rule, SIDE)
                    s += key_terms[None, :]
                if MASKED:
                    s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1) + row_terms)  # never -inf: ROW_MAX_START
                # Every p of a row is taken against its one rounded max, as its sum and LSE are.
                p = tl.exp2(s - (m_new - row_terms)[:, None])
                alpha = tl.exp2(m_i - m_new)
            else:  # a row's max is max(q k^T) * scale: one multiply less per score
                m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
                p = tl.exp2(s * scale_log2 - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DROPOUT:
                keep = dropout_keep_tile(rows, start_n, BLOCK_N, stream, dropout)
                p = tl.where(keep, p, 0.0)
            if EXACT and (MASKED or DROPOUT):
                # No product has seen V yet: masked_dot checks it itself. "Allowed" is read back
                # from the scores, -inf exactly where disallowed: ``ok`` kept alive across the
                # products costs about a register per element (128x64 tile, d64: 424 bytes of
                # spill stores against 76). The one pair this misreads, an allowed one whose score
                # is -inf (an infinity in q or k), adds 0 for a non-finite v where the oracle has
                # 0 * inf = NaN. A dropped pair reads no v either, in every tile.
                read = s != float("-inf")
                if DROPOUT:
                    read = read & keep
                acc = masked_dot(pv_operand(p, v, FP8), v, read, acc * alpha[:, None], True, DOT_PRECISION)
            else:
                acc = dot(pv_operand(p, v, FP8), v, acc * alpha[:, None], DOT_PRECISION)
            m_i = m_new
    return acc, m_i, l_i


# Passes's program count, LENGTHS and DROPOUT_DRAW: one compile for any
@triton.jit(do_not_specialize=["programs", *LENGTHS, *DROPOUT_DRAW])
def _forward_kernel(
    Q, K, V, K_DESC, V_DESC, O, LSE, Q_DESCALE, K_DESCALE, V_DESCALE,  # descales: FP8's (None: 1)
    CU_Q, CU_K, SEQLENS_Q, SEQLENS_K, MASK, BLOCKS, SLOPES, SINKS,  # each call's own (call_args)
    seed_lo, seed_hi, rng_offset, row0, key0,  # each call's own too (call_args: DROPOUT_DRAW)
    REDO,  # Passes's flags (None: one launch)
    q_strides, k_strides, v_strides, o_strides, stride_lb, stride_lh,  # (batch, row, head); lse: (batch, head)
    padded_q, padded_k, heads_q, group, left, right,  # problem_args
    masks, dropout_rate, scale_log2, mods, programs,  # groups of scalars (problem_args, score_mod_args)
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_SEQLENS_Q: tl.constexpr,
    HAS_SEQLENS_K: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, PARTS: tl.constexpr, EXACT: tl.constexpr,
    FP8: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    stride_qb, stride_qn, stride_qh = q_strides
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh, stride_vd = v_strides  # FP8: keys contiguous (fp8.keys_contiguous)
    stride_ob, stride_on, stride_oh = o_strides
    dropout = dropout_state(seed_lo, seed_hi, rng_offset, row0, key0, dropout_rate)
    ids, todo, runs = program_share(REDO, programs, EXACT)
    for _ in range(runs):
        pid, todo = next_program(ids, todo, REDO, EXACT)
        m0, b, h, q_start, q_len, k_start, k_len = query_tile(pid, CU_Q, CU_K, SEQLENS_Q, SEQLENS_K, padded_q,
                                                              padded_k, heads_q, BLOCK_M, IS_VARLEN, HAS_SEQLENS_Q,
                                                              HAS_SEQLENS_K)
        rows_out = q_len if IS_VARLEN else padded_q  # padded rows past q_len still get o = 0, lse = -inf
        if m0 < rows_out:
            b64 = b.to(tl.int64)
            q_base = Q + b64 * stride_qb + (q_start + m0).to(tl.int64) * stride_qn + h.to(tl.int64) * stride_qh
            kv_head = h // group
            k_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + kv_head.to(tl.int64) * stride_kh
            v_base = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vn + kv_head.to(tl.int64) * stride_vh
            seq = 0 if IS_VARLEN else b  # the descriptors' batch axis (a varlen tensor gets one of length 1)

            rows_in_tile = tl.arange(0, BLOCK_M)
            rows = m0 + rows_in_tile
            dims = tl.arange(0, BLOCK_D)
            q = widened(tl.load(q_base + rows_in_tile[:, None] * stride_qn + dims[None, :],
                                mask=(rows[:, None] < q_len) & (dims[None, :] < HEAD_DIM), other=0.0), FP8 == "emulated")

            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
            m_i = tl.full([BLOCK_M], ROW_MAX_START, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            first, full_lo, full_hi, end = band_tiles(m0, q_len, k_len, left, right, BLOCK_M, BLOCK_N,
                                                      HAS_MASK or HAS_BLOCK_MASK)
            stream = b * heads_q + h
            pairs = pair_rule(b, h, q_len, k_len, left, right, MASK, BLOCKS, masks, HAS_MASK, HAS_BLOCK_MASK)
            rule = score_rule(SLOPES, b, h, q_len, k_len, mods, ALIBI)
            scale = scale_log2
            if FP8 != "":  # the descales of the raw scores join their scale, V's joins o's
                score_factor, out_factor = descale_factors(Q_DESCALE, K_DESCALE, V_DESCALE, b * (heads_q // group) + kv_head)
                scale, rule = descaled_scores(scale_log2, rule, score_factor)
            SPLIT_PART: tl.constexpr = 1 if ALIBI else -1  # ALiBi's full tiles run by side of the diagonal
            for part in tl.static_range(3):  # masked tiles, full tiles, masked tiles (band_part)
                if PARTS >> part & 1:  # the parts this problem can have (band_parts)
                    lo, hi = band_part(part, first // BLOCK_N * BLOCK_N, full_lo, full_hi, end)
                    for side in tl.static_range(3 if part == SPLIT_PART else 1):
                        start, stop = (diagonal_part(side, lo, hi, m0, k_len - q_len, BLOCK_M, BLOCK_N)
                                       if part == SPLIT_PART else (lo, hi))
                        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, K_DESC, V_DESC, k_base, v_base, seq, k_start,
                                                      kv_head, stride_kn, stride_vn, stride_vd, rows, start, stop, first,
                                                      end, pairs, scale, rule, stream, dropout, HEAD_DIM, HEAD_DIM_V,
                                                      BLOCK_D, BLOCK_DV, BLOCK_N, part != 1, HAS_MASK, HAS_BLOCK_MASK,
                                                      DROPOUT, SOFTCAP, FAST_TANH, ALIBI, DOT_PRECISION, USE_TMA,
                                                      EXACT, FP8, 1 - side if part == SPLIT_PART else 0)
            if not EXACT:  # the plain launch, which only a problem with masked tiles has (Passes)
                finite = flag_nonfinite(REDO, tl.sum(tl.sum(acc, 1), 0))

            # l_i == 0 only where no key was allowed or every allowed score is -inf (the row max
            # contributes 1 otherwise): o = 0, lse = the sink or -inf, either way. NaN rows stay NaN.
            empty = (l_i == 0.0) | (rows >= q_len)
            if HAS_SINKS:  # a row without keys keeps the sink alone: lse = sink exactly, o = 0
                sink = tl.load(SINKS + h)
                m_i, l_i, alpha = with_sink(m_i, l_i, sink * LOG2E)
                scale_out = alpha / l_i
                no_key_lse = sink
            else:
                scale_out = 1.0 / l_i
                no_key_lse = float("-inf")
            if DROPOUT:
                scale_out *= kept_scale(dropout)
            if FP8 != "":
                scale_out *= out_factor
            o = tl.where(empty[:, None], 0.0, acc * scale_out[:, None])
            lse = tl.where(empty, no_key_lse, (m_i + tl.log2(l_i)) * 0.6931471805599453)  # ln 2: natural log
            dims_v = tl.arange(0, BLOCK_DV)
            o_base = O + b64 * stride_ob + (q_start + m0).to(tl.int64) * stride_on + h.to(tl.int64) * stride_oh
            o_at = o_base + rows_in_tile[:, None] * stride_on + dims_v[None, :]
            o_rows = (rows[:, None] < rows_out) & (dims_v[None, :] < HEAD_DIM_V)
            lse_at = LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + m0 + rows_in_tile
            lse_rows = rows < rows_out
            if ACCUMULATE:  # O and LSE hold running sums, into which this tile's state merges
                if not EXACT:  # a flagged program merges in the exact launch (flag_nonfinite)
                    o_rows = tl.where(finite, o_rows, False)
                    lse_rows = tl.where(finite, lse_rows, False)
                o, lse = _merged(tl.load(o_at, mask=o_rows, other=0.0), tl.load(lse_at, mask=lse_rows, other=0.0),
                                 o, lse)
            tl.store(o_at, o.to(O.dtype.element_ty), mask=o_rows)
            tl.store(lse_at, lse, mask=lse_rows)


@triton.jit
def _merged(o_sums, lse_sums, o, lse):
    """The running state (o_sums, lse_sums) with the state (o, lse) merged in, by the arithmetic of
    ``flashx.api.merge_weights`` (the contract's "Merging partial results"): lse = logaddexp of
    the two, each o weighted exp(its lse - lse), both 0 where lse = -inf."""
    top = tl.where(lse_sums > lse, lse_sums, lse)
    # logaddexp: NaN from either side; equal infinities are themselves (their difference is NaN)
    merged = tl.where((lse_sums == lse) & (tl.abs(lse) == float("inf")), lse,
                      top + tl.log(1.0 + tl.exp(-tl.abs(lse_sums - lse))))
    empty = merged == float("-inf")
    reference = tl.where(empty, 0.0, merged)
    weight_sums = tl.where(empty, 0.0, tl.exp(lse_sums - reference))
    weight = tl.where(empty, 0.0, tl.exp(lse - reference))
    return o_sums * weight_sums[:, None] + o * weight[:, None], merged


def forward(problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    decoding = attention_as_decoding(problem)
    if decoding is not None:
        return decode(decoding, q, k, v, None, None)
    q, k, v = _operands(problem, q, k, v)
    tensors, draws = call_args(problem)
    tensors = (problem.q_descale, problem.k_descale, problem.v_descale, *tensors)
    tuned = per_problem(problem, ("forward", layout(q, k, v, *tensors)), lambda: tuning.Tuned("forward", _launch))
    return tuned(problem, q, k, v, *_outputs(problem, q.device)(), *tensors, *draws)


def prepare_forward(problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``Backend.prepare_forward``: ``forward`` with what the problem and the layout of q, k and v
    fix worked out once (the operands as the kernel reads them, ``call_args``, the tuned launch,
    the outputs' allocation). A call's tensors must have the alignment that the launch was built
    for, which depends on their addresses: one with another goes through ``forward``. So do the
    calls of a problem whose operands are copied or negated on each call (a strided head dim, a
    negative scale). A short query runs as decoding (``decode.attention_as_decoding``)."""
    decoding = attention_as_decoding(problem)
    if decoding is not None:
        return lambda q, k, v: decode(decoding, q, k, v, None, None)
    if any(x is not y for x, y in zip(_operands(problem, q, k, v), (q, k, v))):
        return functools.partial(forward, problem)
    tensors, draws = call_args(problem)
    tensors = (problem.q_descale, problem.k_descale, problem.v_descale, *tensors)
    tuned = per_problem(problem, ("forward", layout(q, k, v, *tensors)), lambda: tuning.Tuned("forward", _launch))
    alignment, outputs, call = (aligned(q), aligned(k), aligned(v)), _outputs(problem, q.device), (*tensors, *draws)

    def run(q, k, v):
        if (aligned(q), aligned(k), aligned(v)) != alignment:
            return forward(problem, q, k, v)
        return tuned(problem, q, k, v, *outputs(), *call)

    return run


def _outputs(problem, device: torch.device):
    """A function that allocates o and lse for ``problem`` on ``device``: o in q's dtype (or
    FP8's out_dtype), and where rows lie past packed sequences, which no program writes, o and lse
    holding the contract's empty rows (lse = the sink with sinks)."""
    out_dtype = getattr(torch, problem.out_dtype)
    o_shape, lse_shape = problem.o_shape, problem.lse_shape
    if not (problem.varlen and problem.rows_past_sequences):
        # sizes as separate ints: torch parses a tuple of them a few tenths of a microsecond slower
        return lambda: (torch.empty(*o_shape, dtype=out_dtype, device=device),
                        torch.empty(*lse_shape, dtype=torch.float32, device=device))
    sinks = problem.sinks

    def empty_rows():
        o = torch.zeros(o_shape, dtype=out_dtype, device=device)
        lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=device)
        if sinks is not None:
            lse.copy_(sinks[:, None].expand_as(lse))
        return o, lse

    return empty_rows


def forward_into(problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_sums: torch.Tensor,
                 lse_sums: torch.Tensor) -> None:
    """``Backend.forward_into``: the forward kernel under ACCUMULATE, whose epilogue merges each
    tile's state into the running (o_sums, lse_sums) rows it would have written. Under the
    configuration the plain forward chooses (``tuning.settled``); rows of no sequence are not
    written, as the plain kernel writes none."""
    given = q, k, v
    q, k, v = _operands(problem, q, k, v)
    o, lse = (last_dim_contiguous(x) for x in (o_sums, lse_sums))  # the kernel writes rows through their strides
    tensors, draws = call_args(problem)
    tensors = (problem.q_descale, problem.k_descale, problem.v_descale, *tensors)

    def build():
        config = tuning.settled("forward", problem, lambda: forward(problem, *given))
        return _launch(problem, config, q, k, v, o, lse, *tensors, *draws, accumulate=True)

    run = per_problem(problem, ("forward_into", layout(q, k, v, o, lse, *tensors), tuning.autotuning()), build)
    run(q, k, v, o, lse, *tensors, *draws)
    for sums, written in ((o_sums, o), (lse_sums, lse)):
        if written is not sums:
            sums.copy_(written)


def _operands(problem, q, k, v):
    """q, k and v as the forward kernel reads them."""
    q, k = (last_dim_contiguous(x) for x in (q, k))
    v = keys_contiguous(v, problem.varlen) if problem.fp8 else last_dim_contiguous(v)
    if problem.softmax_scale < 0:
        # The unmasked tiles take a row's max as max(q k^T) * scale, which holds for scale >= 0:
        # a negative scale runs as (-q) k^T * |scale|, bit for bit the same scores.
        q = negated(q) if problem.fp8 else -q
    return q, k, v


def _launch(problem, config, q, k, v, o, lse, *call, accumulate=False):
    """The forward under ``config`` for tensors (and the descales, then ``call_args``) laid out as
    these: ``run(q, k, v, o, lse, *call)``; with ``accumulate``, merging into o and lse."""
    varlen, args = problem.varlen, problem_args(problem)
    # FP8 reads V with its keys contiguous (fp8.keys_contiguous), through pointers: a TMA copy
    # keeps the memory's order, whose last axis must be contiguous
    use_tma = tma_ready(problem, k, v) and not problem.fp8
    k_descriptor = row_descriptors(k, varlen, config.block_n, args["BLOCK_D"], use_tma)
    v_descriptor = row_descriptors(v, varlen, config.block_n, args["BLOCK_DV"], use_tma)
    parts = band_parts(problem, False, config.block_n)
    kernel = Passes(_forward_kernel, problem.batch * problem.heads_q * triton.cdiv(problem.seqlen_q, config.block_m),
                    config.options(), bool(parts & MASKED_PARTS) or problem.dropout_p > 0, q.device, PARTS=parts,
                    q_strides=row_strides(q, varlen), k_strides=row_strides(k, varlen),
                    v_strides=(*row_strides(v, varlen), v.stride(-1)), o_strides=row_strides(o, varlen),
                    **lse_strides(lse, varlen), **args, scale_log2=abs(problem.scale_log2),
                    **score_mod_args(problem, abs(problem.softmax_scale)), USE_TMA=use_tma,
                    FP8=fp8_mode(problem.fp8), ACCUMULATE=accumulate, **config.tiles())

    def run(q, k, v, o, lse, *call):
        kernel(q, k, v, k_descriptor(k), v_descriptor(v), o, lse, *call)
        return o, lse

    return run
